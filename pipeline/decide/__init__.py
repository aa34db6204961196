"""Decide: pure verdicts over measured figures, no I/O. Greedy-output equivalence with the baseline (`equivalence`) and
the baseline's own divergence with the `baseline-noise` test (`noise`), whether a partial measurement can still beat
the baseline (`stopping`, early stopping's rule), SLA limits (`sla`), the noise-aware promotion rule at one level
(`decision`) and per concurrency level with the serving policy that follows (`levels`), the Pareto front for several
objectives (`pareto`), and the decision in the words a serving team acts on (`headline`). Each is unit-tested on
hand-made inputs."""

__all__ = ["decision", "equivalence", "headline", "levels", "noise", "pareto", "sla", "stopping"]
