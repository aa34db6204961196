"""Search: what to try next. The search space (YAML -> typed `SearchSpace` -> Optuna's define-by-run, `space/`), Ray
Tune's Optuna searcher told about pruned trials (`searcher`), and early stopping of a trial that cannot beat the
baseline: the pure rule over a partial measurement (`stopping`) and its wiring into a trial's measurement
(`pruning`). Which search a study runs (`strategy`: tpe over launches, or simulate-first), and simulate-first's parts:
the search over the simulator's predictions (`simulated`), its driver-side plan (`simulate_first`) and Tune searcher
(`simulate_searcher`). Nothing here starts an engine; a sampled point becomes a `TrialConfig` or an INVALID verdict."""

__all__ = ["pruning", "searcher", "simulate_first", "simulate_searcher", "simulated", "space", "stopping", "strategy"]
