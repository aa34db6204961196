"""The study's sampler: one definition, used by the study, by `--dry-run` and by the search-efficiency replay."""

from __future__ import annotations

from typing import Any


def startup_trials(max_trials: int) -> int:
    """Random trials before TPE models the results: Optuna's default of 10 would make an 8-trial study pure random
    search. A quarter of the budget, 3 to 10 (the baseline counts as one). Measured by
    `python benchmarks/search_efficiency.py replay --seeds 100 [--startup-trials 10]` (docs/benchmarks.md)."""
    return min(10, max(3, max_trials // 4))


def tpe_sampler(seed: int, max_trials: int, n_startup_trials: int | None = None) -> Any:
    """Multivariate TPE with conditional groups (branches), seeded. `n_startup_trials` overrides
    `startup_trials(max_trials)` (the search-efficiency replay compares the two)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                          n_startup_trials=n_startup_trials or startup_trials(max_trials))
