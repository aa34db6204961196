"""Search: what to try next. The search space (YAML -> typed `SearchSpace` -> Optuna's define-by-run, `space/`), Ray
Tune's Optuna searcher told about pruned trials (`searcher`; early stopping itself is the trial's
`pipeline.trial.pruning` over the pure rule `pipeline.decide.stopping`). Which search a study runs (`strategy`: tpe
over launches, or simulate-first), and simulate-first's parts: the search over the simulator's predictions
(`simulated`), its driver-side plan (`simulate_first`) and Tune searcher (`simulate_searcher`). Nothing here starts
an engine; a sampled point becomes a `TrialConfig` or an INVALID verdict
(`pipeline.vocabulary.resolution.Resolution`). Search sits above the trial: it may read the trial's corpus and
context, the trial never imports search."""

__all__ = ["draft_replay", "searcher", "simulate_first", "simulate_searcher", "simulated", "space", "strategy"]
