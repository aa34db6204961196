"""The re-tune's study starts from what production serves: its config is enqueued as a trial (Optuna `enqueue_trial`)
beside the baseline, so the study measures it on the new traffic and a candidate must beat the baseline as usual,
with production's config among its rivals.

`production_point` turns the served spec into the search space's Optuna parameters (`algorithm`,
`<algorithm>.<field>`, common fields) and says where the space cannot express it (a field the space fixes to another
value, a value outside a range: Optuna then uses the enqueued value anyway and warns). `seed_study` enqueues baseline
and production point in the study's Optuna storage before the driver loads it, baseline first (every trial's
outputs are checked against the baseline's). `with_capture_corpus` points a corpus dimension at the capture's corpus.
"""

from __future__ import annotations

from typing import Any, Literal

from pipeline.config import StudyConfig
from pipeline.errors import PipelineError
from pipeline.search.space import (TRIAL_FIELDS, CategoricalParam, FixedParam, SearchSpace, applies, default_value,
                                   enqueue_baseline, resolve)
from serve.serving import ServingConfig

__all__ = ["SEEDED_ATTR", "CAPTURE_CORPUS", "production_point", "seed_study", "with_capture_corpus"]

SEEDED_ATTR = "seeded_from"  # user attribute of the enqueued production trial
CAPTURE_CORPUS = "capture"  # a corpus choice in a space file that a re-tune replaces with the capture's corpus


def production_point(space: SearchSpace, serving: ServingConfig, study: StudyConfig,
                     corpus: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(Optuna params of the served config, mismatches in words). Empty params when production serves the baseline
    (it is enqueued anyway). A served external corpus becomes `corpus` (the capture's, rebuilt from production's own
    traffic), or none. Raises PipelineError when the space lacks the served algorithm."""
    spec = serving.replica.spec
    algorithm = spec.algorithm
    if algorithm == "none":
        return {}, []
    if algorithm not in space.algorithms:
        raise PipelineError(f"production serves {algorithm}, which the search space ({space.name or 'given'}) does "
                            f"not search (algorithms {space.algorithms}). Fix: add it to the space, or give "
                            "--search-space with it")
    fields = spec.model_dump()
    if fields.get("external_corpus") is not None:
        fields["external_corpus"] = corpus
    trial_fields = {"max_running_requests": serving.replica.max_running_requests}
    point: dict[str, Any] = {"algorithm": algorithm}
    values: dict[str, Any] = {}
    for optuna_name, name, p in space.params_for(algorithm):
        if not applies(p, values):
            continue
        if isinstance(p, FixedParam):
            values[name] = p.value
            continue
        if name in TRIAL_FIELDS:
            value = trial_fields.get(name) if trial_fields.get(name) is not None else default_value(p, values)
        elif name in fields:
            value = fields[name]
        else:
            continue
        values[name] = point[optuna_name] = value
    resolution = resolve(space, point, study)
    mismatches = []
    if resolution.config is None:
        mismatches.append("the served spec is not a valid trial of this study: "
                          + "; ".join(str(v) for v in resolution.violations))
    else:
        got = resolution.config.spec.model_dump()
        for key, wanted in fields.items():
            if got.get(key) != wanted:
                mismatches.append(f"spec.{key}: production runs {wanted!r}, the seeded trial {got.get(key)!r}")
    return point, mismatches


def seed_study(study: StudyConfig, space: SearchSpace, storage_url: str, point: dict[str, Any], label: str) -> bool:
    """Create (or load) the study's Optuna study and enqueue the baseline, then `point` with `SEEDED_ATTR` = label,
    unless a live or finished seeded trial exists (a resumed re-tune). Returns True when `point` was enqueued."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna
    from optuna.trial import TrialState

    directions: list[Literal["maximize", "minimize"]] = [
        "maximize" if m == "max" else "minimize" for m in study.objective.modes]
    ot_study = optuna.create_study(study_name=study.name, storage=storage_url, directions=directions,
                                   load_if_exists=True)
    enqueue_baseline(ot_study, space)
    if not point:
        return False
    alive = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    if any(t.user_attrs.get(SEEDED_ATTR) and t.state in alive for t in ot_study.get_trials(deepcopy=False)):
        return False
    ot_study.enqueue_trial(point, user_attrs={SEEDED_ATTR: label}, skip_if_exists=False)
    return True


def with_capture_corpus(space: SearchSpace, corpus: str | None) -> SearchSpace:
    """`space` with every categorical choice `capture` (and `when: {...: [capture]}` conditions) replaced by
    `corpus`; with no corpus the choice is dropped (null when it was the only one)."""
    branches: dict[Any, dict[str, Any]] = {}
    changed = False
    for algorithm, params in space.branches.items():
        new = {}
        for name, p in params.items():
            if isinstance(p, CategoricalParam) and CAPTURE_CORPUS in p.choices:
                choices = [corpus if c == CAPTURE_CORPUS else c for c in p.choices
                           if c != CAPTURE_CORPUS or corpus is not None]
                p = p.model_copy(update={"choices": list(dict.fromkeys(choices)) or [None]})
                changed = True
            if any(CAPTURE_CORPUS in allowed for allowed in p.when.values()):
                when = {key: [corpus if v == CAPTURE_CORPUS else v for v in allowed] for key, allowed in p.when.items()}
                p = p.model_copy(update={"when": when})
                changed = True
            new[name] = p
        branches[algorithm] = new
    return space.model_copy(update={"branches": branches}) if changed else space
