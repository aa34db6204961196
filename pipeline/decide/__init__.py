"""Decide: pure verdicts over measured figures, no I/O. Greedy-output equivalence with the baseline (`equivalence`),
SLA limits (`sla`), the noise-aware promotion rule at one level (`decision`) and per concurrency level with the
serving policy that follows (`levels`), the Pareto front for several objectives (`pareto`). Each is unit-tested on
hand-made inputs."""

__all__ = ["decision", "equivalence", "levels", "pareto", "sla"]
