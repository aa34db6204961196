"""One attention backend for every SGLang engine of a study on a GPU, decided before the first trial, and the dry run's
check of the command lines with SGLang's own parser and resolution.

The choice (`serve.engines.sglang_backend.choose_backend`) needs three facts: the GPU architecture (`engine.gpu_arch`,
else this machine's GPU, else a GPU node of the Ray cluster), the model's attention type and architecture (its
config.json: a local folder, the Hugging Face cache, or read on that GPU node) and the widest draft tree the search
space can propose (`space_trees`). The decided backend is written into the study's `engine.attention_backend` (and the
architecture into `engine.gpu_arch`), so the baseline, every trial, the deterministic and finalist passes and the
served config all render the same `--attention-backend`. A study that names its own backend keeps it; a study in the
`deterministic` equivalence mode whose backend SGLang refuses to run deterministically is refused here, before any
launch, with the fix. No sglang import here: SGLang is asked in a subprocess (`serve.engines.sglang_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import StudyConfig
from pipeline.errors import PipelineError, UserError
from pipeline.search.space import CategoricalParam, FixedParam, IntParam, Param, Resolution, SearchSpace, evaluate_bound
from serve.engines.sglang_backend import (BASELINE_TREE, GpuArch, Tree, architecture_of, attention_kind, auto_topk,
                                          choose_backend, deterministic_problem)

__all__ = ["Decided", "space_trees", "decide_backend", "model_config_of", "local_node_facts", "ray_node_facts",
           "argv_report"]

# What a GPU node says about itself: (its architecture, the model's config.json as it reads it there).
NodeFacts = tuple[GpuArch | None, dict[str, Any] | None]


def _widest(p: Param) -> int | None:
    """The largest value a width parameter can take (None: not a number)."""
    if isinstance(p, FixedParam):
        values: list[Any] = [p.value]
    elif isinstance(p, CategoricalParam):
        values = list(p.choices)
    elif isinstance(p, IntParam):
        try:
            values = [evaluate_bound(p.high, {})]
        except UserError:
            raise PipelineError(f"the search space's {p!r} bounds a tree width by other parameters; give it a constant "
                                "upper bound, or set engine.attention_backend") from None
    else:
        return None
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return max(numbers) if numbers else None


def space_trees(space: SearchSpace, architecture: str) -> list[Tree]:
    """Every kind of tree the space can propose, each at its widest: NGRAM at its largest max_bfs_breadth, a drafted
    algorithm at its largest topk (or SGLang's own choice where topk is left unset, adaptive's chain where adaptive
    can be on). Pure."""
    from serve.spec import NgramSpec

    trees = [BASELINE_TREE]
    for algorithm in space.algorithms:
        if algorithm == "none":
            continue
        params = {name: p for _, name, p in space.params_for(algorithm)}
        name = algorithm.upper()
        if algorithm == "ngram":
            breadth = params.get("max_bfs_breadth")
            widest = _widest(breadth) if breadth is not None else None
            trees.append(Tree(name, None, widest or NgramSpec().max_bfs_breadth))
            continue
        topk = params.get("topk")
        widest = _widest(topk) if topk is not None else None
        if widest is not None:
            trees.append(Tree(name, widest, widest))
        if topk is None or set(topk.when) - {"adaptive"}:  # some points leave topk to SGLang (adaptive: a chain)
            trees.append(Tree(name, None, auto_topk(architecture, algorithm)))
        adaptive = params.get("adaptive")
        if adaptive is not None and True in (adaptive.choices if isinstance(adaptive, CategoricalParam)
                                             else [getattr(adaptive, "value", None)]):
            trees.append(Tree(name, None, 1))
    return trees


def model_config_of(model: str) -> dict[str, Any] | None:
    """The target's config.json as this machine can read it: a local folder, else the Hugging Face cache (no
    download). None where neither has it."""
    from serve.engines.sglang_cpu.launch import model_folder
    from serve.engines.sglang_node import local_model_config

    found = local_model_config(model_folder(model))
    if found is not None or Path(model).expanduser().is_absolute():
        return found
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, or no hub client: nothing cached to read
        return None
    return local_model_config(str(Path(cached).parent)) if isinstance(cached, str) else None


def local_node_facts(model: str) -> NodeFacts:
    from serve.engines.sglang_node import node_gpu_arch

    return node_gpu_arch(), model_config_of(model)


def ray_node_facts(model: str) -> NodeFacts:
    """The same facts from a GPU node of the Ray cluster this process is connected to ((None, None) without one)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or float(ray.cluster_resources().get("GPU", 0)) < 1:
        return None, None
    probe = ray.remote(num_gpus=1, num_cpus=0)(local_node_facts)
    try:
        return ray.get(probe.remote(model), timeout=300)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - every GPU held, or the node failed: unknown, said by the caller with the fix
        return None, None


@dataclass(frozen=True)
class Decided:
    """The study with its backend decided (unchanged where there is nothing to decide), and the line that says so."""

    study: StudyConfig
    line: str | None
    arch: GpuArch | None = None


def _on_gpu(study: StudyConfig) -> bool:
    from serve.engines.base import ReplicaConfig
    from serve.engines.sglang import resolve_device

    return study.engine.kind == "sglang" and resolve_device(
        ReplicaConfig(engine="sglang", model=study.model.target, device=study.engine.device)) == "cuda"


def decide_backend(study: StudyConfig, space: SearchSpace,
                   probes: Sequence[Callable[[str], NodeFacts]] = (local_node_facts,),
                   required: bool = False) -> Decided:
    """The study with `engine.attention_backend` decided (module docstring). `probes`: where to ask for the GPU
    architecture and the model's config, in order. `required`: a real run, where engines would otherwise choose
    per config on their nodes; an unknown architecture then is a PipelineError naming the fix."""
    if not _on_gpu(study):
        return Decided(study, None)
    from pipeline.trial.gate import effective_mode

    engine = study.engine
    arch: GpuArch | None = None if engine.gpu_arch == "auto" else engine.gpu_arch
    model: dict[str, Any] | None = None
    for probe in probes:
        if arch is not None and model is not None:
            break
        found_arch, found_model = probe(study.model.target)
        arch, model = arch or found_arch, model or found_model
    if engine.attention_backend is None and (arch is None or model is None):
        missing = "the GPU architecture" if arch is None else f"the config.json of {study.model.target!r}"
        line = (f"attention backend: not decided here ({missing} cannot be read here): set engine.gpu_arch "
                "(sm80, sm90, sm100, sm120) and give model.target as a local folder, or set engine.attention_backend")
        if required:
            raise PipelineError(line)
        return Decided(study, "# " + line, arch)
    model = model or {}
    kind, architecture = attention_kind(model), architecture_of(model)
    if engine.attention_backend is not None:
        backend, line = engine.attention_backend, f"attention backend {engine.attention_backend} (engine.attention_backend)"
    elif arch is not None:  # always here: an unknown architecture without a backend returned or raised above
        choice = choose_backend(arch, kind, architecture, space_trees(space, architecture))
        backend, line = choice.backend, choice.describe()
    else:
        return Decided(study, None)
    if effective_mode(study) == "deterministic" and study.workload.temperature == 0:
        problem = deterministic_problem(backend, kind, architecture)
        if problem:
            raise PipelineError(f"promotion.equivalence: deterministic: {problem}, so the baseline's deterministic "
                                "pass would be refused and no trial could be compared. Fix: set "
                                "engine.attention_backend to one it runs (triton runs everywhere), or use "
                                "promotion.equivalence: baseline-noise")
    decided = engine.model_copy(update={"attention_backend": backend, **({"gpu_arch": arch} if arch else {})})
    return Decided(study.model_copy(update={"engine": decided}), "# " + line, arch)


def argv_report(decided: Decided, resolutions: Sequence[Resolution], output: Path) -> list[str]:
    """For the dry run: each valid sampled config's SGLang command line, and SGLang's own verdict on it (its parser,
    `resolve_once()` and `check_server_args()`, resolved as `decided.arch` would), plus what it resolved the
    attention backend to; the last line says whether every engine runs the same backend. Lines to print."""
    from pipeline.trial.lifecycle import replica_config
    from serve.engines.sglang import resolved_problem, sglang_argv, static_problem
    from serve.engines.sglang_check import run_preflight

    study = decided.study
    numbered = [(n, r) for n, r in enumerate(resolutions) if r.valid and r.config is not None]
    configs = [(n, replica_config(study, r.config, output / "trials" / f"dry-run-{n}")) for n, r in numbered
               if r.config is not None]
    argvs = [sglang_argv(config, "127.0.0.1", 30000) for _, config in configs]
    verdicts = run_preflight(argvs, gpu_arch=decided.arch)
    where = f"resolved as {decided.arch}" if decided.arch else "resolved on this machine (no GPU architecture given)"
    lines = [f"# SGLang command lines of the sampled configs, checked by SGLang's own parser, resolve_once() and "
             f"check_server_args() ({where}):"]
    backends = set()
    for k, (number, config) in enumerate(configs):
        lines.append(f"  #{number:<3} {' '.join(argvs[k])}")
        refused = static_problem(config, argvs[k])
        verdict = verdicts[k] if verdicts is not None else None
        if verdict is not None and verdict.ok:
            refused = refused or resolved_problem(verdict.resolved)
            backends.add(verdict.resolved.get("attention_backend"))
        if refused:
            lines.append(f"         INVALID: {refused}")
        elif verdict is None:
            lines.append("         (sglang is not importable here: bash infra/install-sglang-parser.sh to check)")
        elif verdict.ok:
            r = verdict.resolved
            lines.append(f"         SGLang accepts it: attention_backend={r.get('attention_backend')}, "
                         f"topk={r.get('speculative_eagle_topk')}, use_mla={r.get('use_mla_backend')}")
        else:
            lines.append(f"         SGLang refuses it at {verdict.stage}: {verdict.error}")
    if backends:
        same = "the same for every engine" if len(backends) == 1 else "DIFFERENT between engines"
        lines.append(f"# attention backend SGLang resolved: {', '.join(sorted(map(str, backends)))} ({same})")
    return lines
