"""Search spaces: YAML files in search_spaces/ -> a validated `SearchSpace` -> Optuna -> `TrialConfig`.

One job per module:
- `model`    the parsed shape of a space file (parameter types, branches) and each parameter's default;
- `loader`   reading and checking a file: every problem at load, so `--dry-run` finds it;
- `bounds`   bound expressions over earlier parameters (`high: max_bfs_breadth`);
- `define`   the Optuna define-by-run function and the enqueued baseline;
- `resolve`  a sampled point -> a validated `TrialConfig`, or the reasons it is INVALID;
- `grid`     enumeration of every point (the search-efficiency replay);
- `sampler`  the study's TPE sampler (the study, `--dry-run` and the replay use the same one).
The names below are the package's public surface; import them from `pipeline.search.space`.
"""

from pipeline.search.space.bounds import Bound, evaluate_bound, names_in
from pipeline.search.space.define import BASELINE_ATTR, SpaceSampler, define_by_run, enqueue_baseline, suggest
from pipeline.search.space.grid import grid_points
from pipeline.search.space.loader import check_space, load_space
from pipeline.search.space.model import (
    TRIAL_FIELDS, CategoricalParam, FixedParam, FloatParam, IntParam, Param, SearchSpace, applies, baseline_point,
    default_value,
)
from pipeline.search.space.resolve import Resolution, resolve
from pipeline.search.space.sampler import startup_trials, tpe_sampler

__all__ = [
    "BASELINE_ATTR", "Bound", "CategoricalParam", "FixedParam", "FloatParam", "IntParam", "Param", "Resolution",
    "SearchSpace", "SpaceSampler", "TRIAL_FIELDS", "applies", "baseline_point", "check_space", "default_value",
    "define_by_run", "enqueue_baseline", "evaluate_bound", "grid_points", "load_space", "names_in", "resolve",
    "startup_trials", "suggest", "tpe_sampler",
]
