"""What the dry run says a study will cost: engine launches for the strategy that will run (simulate-first's, not the
fallback search's) and an estimate of the wall time, from figures measured on this project's reference machine.

Pure: the strategy, the study and (for tpe and grid) the launch plan of the sampled configs in; words out.

The figures and where they come from (docs/benchmarks.md; a 2-core AMD EPYC, SmolLM2-135M):
- CPU engine: a reused replica's engine start 2.5-3.0 s ("Default study", runs J and K: 2.8 s taken); warm-up and
  measurement of the default study's 8 + 4 prompts x 24 tokens in 11.0 s (run K, trial 1), i.e. 26.2 tok/s, the
  baseline's 26.5 tok/s of "Predict" (26.5 taken); 0.4 s a launch beyond engine start, warm-up and measurement;
  simulate-first's one-offs 10.7 s (prediction 4.7, reference pass 4.2, Tune's trial process 1.8); the rest of the
  133-s study (run K: Ray, MLflow, the report) 12 s. The same default study took up to 258 s run again on a fresh
  machine of the kind (README, "measured on a fresh 2-vCPU AMD EPYC machine"): 1.94x what these figures give, the
  range the estimate states.
- SGLang's CPU server: started in 21-23 s (22 s taken), 3.20x slower than the CPU engine per request
  ("SGLang: 0.5.23 on this CPU").
- llama-server: 113.9 / 53.8 = 2.12x the CPU engine's e2e tok/s ("llama.cpp: plain decode"); its start is not
  measured there, the CPU engine's is taken.
- Other models of the bundled table: decode on a CPU reads every weight once per token, so the rate scales with
  the GGUF's size against SmolLM2-135M's 98.4 MB.
No figure exists for SGLang on a GPU: its launches are counted, not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import StudyConfig
from pipeline.search.strategy import Strategy
from serve.engines import engine_for

__all__ = ["LaunchFigures", "Estimate", "estimate", "figures_for", "format_estimate", "format_seconds"]

CPU_ENGINE_START_S = 2.8
CPU_ENGINE_TOK_S = 26.5
LAUNCH_OVERHEAD_S = 0.4
SIMULATE_ONE_OFFS_S = 10.7
TRIAL_PROCESS_S = 1.8
STUDY_SETUP_S = 12.0
SLOWEST_MEASURED = 258 / 133  # the default study's slowest warm run against the run the figures come from
REFERENCE_MODEL_BYTES = 98_362_432  # smollm2-135m's GGUF
SOURCE = "docs/benchmarks.md, a 2-core AMD EPYC"


@dataclass(frozen=True)
class LaunchFigures:
    start_s: float
    tok_s: float
    basis: str  # what the figures are, in words


@dataclass(frozen=True)
class Estimate:
    launches: int  # as planned
    launches_most: int  # with every widening and spread re-run the study may add
    parts: tuple[str, ...]  # where the launches come from
    seconds: float | None  # None: no measured figures for this engine; as the figures give it
    seconds_most: float | None  # with every widening and spread re-run, at the slowest measured pace
    basis: str


def figures_for(kind: str, device: str, model_bytes: int | None, model: str) -> LaunchFigures | None:
    """Per-launch figures for engine `kind` on `device`, scaled to a bundled model's size; None on a GPU."""
    if device == "cuda":
        return None
    scale = REFERENCE_MODEL_BYTES / model_bytes if model_bytes else 1.0
    size = (f", scaled to {model}'s {model_bytes / 1e6:.0f} MB" if model_bytes and model_bytes != REFERENCE_MODEL_BYTES
            else "" if model_bytes else f" ({model} is outside the bundled table: its speed is not known here)")
    engine = engine_for(kind)  # its pace against the CPU engine's: `Engine.cpu_start_s`, `cpu_speed`, `cpu_basis`
    start = engine.cpu_start_s if engine.cpu_start_s is not None else CPU_ENGINE_START_S
    return LaunchFigures(start, CPU_ENGINE_TOK_S * engine.cpu_speed * scale, engine.cpu_basis.format(size=size))


def _launch_s(figures: LaunchFigures, study: StudyConfig, levels: int) -> float:
    workload = study.workload
    tokens = (workload.warmup_prompts + workload.measure_prompts * levels) * workload.max_new_tokens
    return figures.start_s + tokens / figures.tok_s + LAUNCH_OVERHEAD_S


def estimate(study: StudyConfig, strategy: Strategy, mode: str, figures: LaunchFigures | None,
             planned_search: int | None = None) -> Estimate:
    """Launches and time of `study` under `strategy`. `mode`: the equivalence mode as it runs (`exact` for
    `deterministic` on a batch-invariant engine). `planned_search`: tpe/grid's search launches of the sampled configs
    (launch sharing counted); None = one a trial."""
    budget = study.budget.max_trials
    if strategy.simulated:
        search = min(study.search.simulate.launches + 1, budget)
        search_most = budget
        parts = [f"search {search}: the baseline + {search - 1} predicted (up to {budget}, budget.max_trials, "
                 f"while the predictions are off by more than {study.search.simulate.error_threshold:.0%})"]
    else:
        search = search_most = planned_search if planned_search is not None else budget
        parts = [f"search {search} ({strategy.name}: every trial a launch, equal engine settings sharing one)"]
    extra = extra_most = 0
    if mode == "baseline-noise":
        extra = extra_most = 1
        parts.append("the baseline's noise pass 1")
    elif mode == "deterministic" and study.workload.temperature == 0:
        extra, extra_most = search, search_most
        parts.append(f"deterministic-inference passes {search} (the baseline and every compared trial)")
    configs = 1 + study.promotion.finalists if study.promotion.finalists else 0
    finalists = configs * study.promotion.runs
    spread = configs * study.promotion.spread_reruns
    if finalists:
        parts.append(f"finalists {finalists} (baseline + {study.promotion.finalists} finalist(s) x "
                     f"{study.promotion.runs} runs; up to {spread} more where runs disagree)")
    launches, most = search + extra + finalists, search_most + extra_most + finalists + spread
    if figures is None:
        return Estimate(launches, most, tuple(parts), None, None, "")
    search_s = _launch_s(figures, study, 1)
    finalist_s = _launch_s(figures, study, len(study.concurrency))
    fixed = STUDY_SETUP_S + (SIMULATE_ONE_OFFS_S if strategy.simulated else TRIAL_PROCESS_S)
    seconds = fixed + (search + extra) * search_s + finalists * finalist_s
    seconds_most = fixed + (search_most + extra_most) * search_s + (finalists + spread) * finalist_s
    seconds_most *= SLOWEST_MEASURED
    basis = (f"{figures.basis}: engine start {figures.start_s:g} s, {figures.tok_s:.1f} tok/s at concurrency 1, "
             f"{LAUNCH_OVERHEAD_S:g} s a launch besides ({SOURCE}; the default study took 133-258 s there), the "
             "first study on a machine longer (the model's fetch, the kernel's build)")
    return Estimate(launches, most, tuple(parts), seconds, seconds_most, basis)


def format_seconds(seconds: float) -> str:
    """Seconds, minutes or hours, rounded as an estimate is."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_estimate(est: Estimate, strategy: Strategy, study: StudyConfig) -> str:
    """The estimate as the dry run prints it (comment lines)."""
    most = f", at most {est.launches_most}" if est.launches_most > est.launches else ""
    lines = [f"# engine launches for {strategy.name}: {est.launches}{most}",
             *(f"#   {part}" for part in est.parts)]
    if est.seconds is None or est.seconds_most is None:
        lines.append(f"# time: not estimated: no launch of SGLang on a GPU is measured here; each engine start may "
                     f"take up to engine.start_timeout_s={study.engine.start_timeout_s:g} s (a node's first start "
                     "with a model longer: weights, CUDA graphs, kernel builds)")
    else:
        low, high = format_seconds(est.seconds), format_seconds(est.seconds * SLOWEST_MEASURED)
        lines.append(f"# time, an estimate: {low} to {high} (at most {format_seconds(est.seconds_most)} with every "
                     f"extra launch), from {est.basis}")
    return "\n".join(lines)
