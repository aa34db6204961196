"""Engine settings a study's engines share (SGLang on a GPU: one attention backend for the baseline, every trial, the
deterministic and finalist passes and the served config), decided before the first trial, and the dry run's check of
the sampled command lines with the engine's own verdict.

The pipeline's part: the widest and narrowest trees the search space can propose (`widest_specs`), where to ask for
a node's facts (this machine, then a GPU node of the Ray cluster: `ray_node_facts`), and the study updated with the
decision.
The engine's part (`Engine.shared_settings`, `Engine.check_commands`, `Engine.node_facts`) is the engine kind's; for
SGLang see serve/engines/sglang/study.py and serve/engines/sglang/backend.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
import sys
from typing import Any

from pipeline.config import StudyConfig, TrialConfig
from pipeline.errors import PipelineError, UserError
from pipeline.search.space import CategoricalParam, FixedParam, IntParam, Param, Resolution, SearchSpace, evaluate_bound
from pipeline.trial.gate import effective_mode
from pipeline.trial.replica_config import replica_config
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.spec import SPEC_TYPES, SpecConfig

__all__ = ["Decided", "widest_specs", "decide_backend", "local_node_facts", "ray_node_facts", "cluster_has_gpus",
           "argv_report"]


def _extremes(p: Param) -> tuple[int, int] | None:
    """The smallest and largest values a width parameter can take (None: not a number). A lower bound given by other
    parameters counts as 1, the narrowest any width can be."""
    if isinstance(p, FixedParam):
        values: list[Any] = [p.value]
    elif isinstance(p, CategoricalParam):
        values = list(p.choices)
    elif isinstance(p, IntParam):
        try:
            high = evaluate_bound(p.high, {})
        except UserError:
            raise PipelineError(f"the search space bounds a tree width by other parameters ({p.high!r}); give it a "
                                "constant upper bound, or set engine.attention_backend") from None
        try:
            low = evaluate_bound(p.low, {})
        except UserError:
            low = 1
        values = [low, high]
    else:
        return None
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return (min(numbers), max(numbers)) if numbers else None


def widest_specs(space: SearchSpace) -> list[SpecConfig]:
    """Per speculative algorithm of the space, a spec at each extreme draft tree it can propose: NGRAM at its largest
    and its smallest max_bfs_breadth (a backend's verify may apply the tree mask only above some topk, and NGRAM
    branches at every breadth), a drafted algorithm at its largest and smallest topk, with topk left to the engine
    where some points leave it unset, and adaptive where adaptive can be on. Only their tree shape means anything.
    Pure."""
    out: list[SpecConfig] = []
    for algorithm in space.algorithms:
        if algorithm == "none":
            continue
        spec_type = SPEC_TYPES[algorithm]
        params = {name: p for _, name, p in space.params_for(algorithm)}
        width_field = "max_bfs_breadth" if "max_bfs_breadth" in spec_type.model_fields else "topk"
        if width_field not in spec_type.model_fields:
            continue  # no tree (llama.cpp's algorithms)
        width = params.get(width_field)
        extremes = _extremes(width) if width is not None else None
        if extremes is not None:
            for value in sorted(set(extremes), reverse=True):
                out.append(spec_type.model_construct(**{width_field: value}))  # type: ignore[arg-type]
        if width is None or set(width.when) - {"adaptive"}:  # some points leave it at its default (or to the engine)
            out.append(spec_type.model_construct())  # type: ignore[arg-type]
        adaptive = params.get("adaptive")
        if isinstance(adaptive, CategoricalParam) and True in adaptive.choices or \
                isinstance(adaptive, FixedParam) and adaptive.value is True:
            out.append(spec_type.model_construct(adaptive=True))  # type: ignore[call-arg,arg-type]
    return out


def local_node_facts(config: ReplicaConfig) -> Any:
    """What the node this runs on says about itself for `config`'s engine kind (None: nothing to say)."""
    return engine_for(config.engine).node_facts(config)


def cluster_has_gpus() -> bool:
    """Whether the Ray cluster this process is connected to has a GPU (False outside Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and float(ray.cluster_resources().get("GPU", 0)) >= 1


def ray_node_facts(config: ReplicaConfig) -> Any:
    """The same facts from a GPU node of the Ray cluster this process is connected to (None without one)."""
    ray = sys.modules.get("ray")
    if ray is None or not cluster_has_gpus():
        return None
    probe = ray.remote(num_gpus=1, num_cpus=0)(local_node_facts)
    try:
        return ray.get(probe.remote(config), timeout=300)
    except Exception:  # noqa: BLE001 - every GPU held, or the node failed: unknown, said by the caller with the fix
        return None


@dataclass(frozen=True)
class Decided:
    """The study with its shared engine settings decided (unchanged where nothing is decided), the line that says so
    (None: nothing to say), and the GPU architecture the engines' command lines resolve as."""

    study: StudyConfig
    line: str | None
    arch: str | None = None


def decide_backend(study: StudyConfig, space: SearchSpace,
                   probes: Sequence[Callable[[ReplicaConfig], Any]] = (local_node_facts,)) -> Decided:
    """The study with the engine settings its engines share decided (module docstring). `probes`: where to ask for a
    node's facts, in order. A setting the engine kind refuses is a PipelineError with the fix."""
    config = replica_config(study, TrialConfig(), study.output_path())
    deterministic = effective_mode(study) == "deterministic" and study.workload.temperature == 0
    answered = [lambda c, probe=probe: probe(c) or _NO_FACTS for probe in probes]
    try:
        shared = engine_for(config.engine).shared_settings(config, study.engine.gpu_arch, widest_specs(space), answered,
                                                           deterministic)
    except UserError as exc:
        raise PipelineError(str(exc)) from None
    if shared is None:
        return Decided(study, None)
    engine = study.engine.model_copy(update=shared.update)
    return Decided(study.model_copy(update={"engine": engine}), "# " + shared.line, shared.arch)


class _Silent:
    gpu_arch = None
    model_config = None


_NO_FACTS = _Silent()


def argv_report(decided: Decided, resolutions: Sequence[Resolution], output: Path) -> list[str]:
    """For the dry run: each valid sampled config's engine command line and the engine's own verdict on it (SGLang:
    its parser, `resolve_once()` and `check_server_args()`, resolved as `decided.arch` would), and whether every
    engine resolved the same attention backend. Lines to print (none for an engine kind without a verdict)."""
    study = decided.study
    numbered = [(n, r.config) for n, r in enumerate(resolutions) if r.valid and r.config is not None]
    configs = [replica_config(study, config, output / "trials" / f"dry-run-{n}") for n, config in numbered]
    checks = engine_for(study.engine.kind).check_commands(configs, decided.arch) if configs else None
    if checks is None:
        return []
    where = f"resolved as {decided.arch}" if decided.arch else "resolved on this machine (no GPU architecture given)"
    if decided.arch is None and study.engine.attention_backend is None:
        where += "; their --attention-backend is a placeholder, the study decides its own on the GPU node"
    lines = [f"# command lines of the sampled configs, checked by SGLang's own parser, resolve_once() and "
             f"check_server_args() ({where}):"]
    backends = set()
    for (number, _), check in zip(numbered, checks):
        lines.append(f"  #{number:<3} {' '.join(check.argv)}")
        if check.resolved:
            backends.add(str(check.resolved.get("attention_backend")))
        if check.problem:
            lines.append(f"         INVALID: {check.problem}")
        elif check.ok is None and check.unanswered:
            lines.append(f"         (no verdict: the preflight could not answer here, the launch decides: "
                         f"{check.unanswered})")
        elif check.ok is None:
            lines.append("         (sglang is not importable here: bash infra/install-sglang-parser.sh to check)")
        else:
            r = check.resolved
            lines.append(f"         SGLang accepts it: attention_backend={r.get('attention_backend')}, "
                         f"topk={r.get('speculative_eagle_topk')}, use_mla={r.get('use_mla_backend')}")
    if backends:
        same = "the same for every engine" if len(backends) == 1 else "DIFFERENT between engines"
        lines.append(f"# attention backend SGLang resolved: {', '.join(sorted(backends))} ({same})")
    return lines
