"""The dry run's verdict on the search space: a study whose every speculative config is INVALID for its engine cannot
run (the baseline alone would be measured and kept), and the fix is a search space the engine can run, named here.
Pure apart from reading the bundled spaces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from pipeline.config import SEARCH_SPACES_DIR, StudyConfig
from pipeline.search.space import Resolution, SearchSpace, load_space
from serve.engines import algorithms_of, engine_for
from serve.engines.base import EngineKind

__all__ = ["ENGINE_KINDS", "fitting_spaces", "space_problem"]

ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)


def fitting_spaces(kind: str) -> list[str]:
    """The bundled spaces (search_spaces/<name>) every algorithm of which engine `kind` implements, the recommended
    one first (`Engine.recommended_space`)."""
    implemented = algorithms_of(kind)
    names = [path.name for path in sorted(SEARCH_SPACES_DIR.glob("*.yaml"))
             if set(load_space(path).algorithms) <= implemented]
    first = engine_for(kind).recommended_space
    return sorted(names, key=lambda name: name != first)


def space_problem(study: StudyConfig, space: SearchSpace, sampled: Sequence[Resolution],
                  fitting: Sequence[str]) -> str | None:
    """Why the study cannot search anything: the space has no algorithm but `none` that the engine implements, or
    every sampled config of each one it implements is INVALID (e.g. a draft-model algorithm without its draft).
    `fitting`: the bundled spaces that fit the engine (`fitting_spaces`). None when an algorithm can run (or the
    space is the baseline alone, on purpose)."""
    speculative = [r for r in sampled if r.params.get("algorithm") != "none"]
    kind = study.engine.kind
    offered = set(space.algorithms) - {"none"}
    if not offered:
        return None
    implemented = offered & algorithms_of(kind)
    # an algorithm can run unless each of its sampled configs is INVALID (one not sampled gets the benefit of doubt)
    runnable = [a for a in implemented if not (mine := [r for r in speculative if r.params.get("algorithm") == a])
                or any(r.valid for r in mine)]
    if runnable:
        return None
    spaces = (f"--search-space search_spaces/{fitting[0]} (spaces engine {kind} can run: "
              f"{', '.join(f'search_spaces/{name}' for name in fitting)})" if fitting else "")
    if implemented:  # the engine runs the algorithms: the configs' own reasons say what to change
        ours = [r for r in speculative if r.params.get("algorithm") in implemented]
        first = "; ".join(str(v) for v in ours[0].violations) or "no engine config"
        return (f"search space {space.name} ({study.search_space}): all {len(ours)} sampled configs of "
                f"{', '.join(sorted(implemented))} are INVALID (the first: {first}), so the study would measure the "
                f"baseline alone. Fix: what the reasons say{f', or {spaces}' if spaces else ''}")
    others = [other for other in ENGINE_KINDS if other != kind and offered <= algorithms_of(other)]
    engines = (f", or --engine {' / '.join(others)} ({'each implements' if len(others) > 1 else 'implements'} "
               "them)" if others else "")
    return (f"search space {space.name} ({study.search_space}): none of its algorithms {sorted(offered)} is one "
            f"engine {kind} implements, so the study would measure the baseline alone. Fix: "
            f"{spaces or 'a search space with algorithms the engine implements'}{engines}")
