"""simulate-first's draft replay: before any STANDALONE config is launched, run its draft model -- never the target --
over the baseline's measured answers with the engine's own drafting code (`Engine.draft_replay_argv`; the CPU
engine's `serve.engines.cpu.draft_replay`), on the driver, as a child process (it loads a model: torch stays out of
the pipeline). The result (`pipeline.simulate.drafts.DraftTables`) gives every STANDALONE point's accept lengths
exactly, request by request and round by round, and the draft's measured forward cost for the step-cost model.

One replay per draft model, covering every topk of the space's STANDALONE points and their deepest num_steps. The
warm-up answers are not replayed (a draft model keeps nothing across requests, so they move no measured figure).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.search.space import SearchSpace, grid_points, resolve
from pipeline.simulate.drafts import DraftCurve, DraftTables, draft_curve
from pipeline.simulate.replay import Answer
from pipeline.simulate.workload import Unsimulable
from pipeline.trial.context import TrialContext
from serve.engines import engine_for
from serve.engines.base import child_env
from serve.spec import StandaloneSpec

__all__ = ["DraftReplayRun", "draft_plan", "draft_tables", "run_draft_replay", "tables_of"]

GRID_LIMIT = 10_000  # STANDALONE points enumerated to find the topks and depths the replay must cover


@dataclass(frozen=True)
class DraftReplayRun:
    tables: DraftTables
    total_s: float  # the child process, model load included
    summary: dict[str, Any]  # what it reported (seconds, forwards, the draft's weights mode), for the study run


def draft_plan(space: SearchSpace, study: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """draft model -> (deepest num_steps, topks) over the space's STANDALONE points ({} without any)."""
    if "standalone" not in space.algorithms:
        return {}
    only = space.model_copy(update={"algorithms": ["standalone"]})
    try:
        points = grid_points(only, limit=GRID_LIMIT)
    except ConfigError as exc:
        raise Unsimulable(f"the STANDALONE points cannot be enumerated for the draft replay: {exc}") from exc
    plan: dict[str, tuple[int, set[int]]] = {}
    for params in points:
        resolution = resolve(only, params, study)
        spec = resolution.config.spec if resolution.valid and resolution.config is not None else None
        if not isinstance(spec, StandaloneSpec) or not spec.draft_model or spec.num_steps is None or spec.topk is None:
            continue
        steps, topks = plan.get(spec.draft_model, (0, set()))
        plan[spec.draft_model] = (max(steps, spec.num_steps), topks | {spec.topk})
    return {model: (steps, tuple(sorted(topks))) for model, (steps, topks) in plan.items()}


def run_draft_replay(study: Any, draft_model: str, answers: Sequence[Answer], max_steps: int,
                     topks: Sequence[int], folder: Path | None = None) -> DraftReplayRun:
    """Replay `draft_model` over `answers` with the study's engine settings (dtype, weights, threads)."""
    engine = engine_for(study.engine.kind)
    if not engine.replays_drafts:
        raise Unsimulable(f"{engine.label} cannot replay a draft model's trees")
    argv = engine.draft_replay_argv(draft_model, study.model.dtype, study.engine.weights, study.engine.threads)
    env = child_env()
    if study.engine.threads is None:
        env.pop("OMP_NUM_THREADS", None)  # every core, as the engine itself runs with threads unset
    payload = {"answers": [{"prompt_ids": list(a.prompt_ids), "output_ids": list(a.output_ids)} for a in answers],
               "topks": list(topks), "max_steps": max_steps}
    with tempfile.TemporaryDirectory(prefix="draft-replay-", dir=folder) as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(payload))
        started = time.monotonic()
        try:
            proc = subprocess.run([*argv, "--input", str(src), "--output", str(dst)], env=env, capture_output=True,
                                  text=True, timeout=study.engine.start_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise Unsimulable(f"the draft replay of {draft_model!r} took over engine.start_timeout_s="
                              f"{study.engine.start_timeout_s:g} s") from exc
        total = time.monotonic() - started
        if proc.returncode != 0 or not dst.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise Unsimulable(f"the draft replay of {draft_model!r} failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(dst.read_text())
    return DraftReplayRun(tables_of(draft_model, answers, max_steps, result), total,
                          {k: result.get(k) for k in ("seconds", "forwards", "draft_weights", "threads")})


def tables_of(draft_model: str, answers: Sequence[Answer], max_steps: int, result: Mapping[str, Any]) -> DraftTables:
    """The replay's JSON as DraftTables (answers in the order they were sent)."""
    per_answer = result.get("answers")
    if not isinstance(per_answer, list) or len(per_answer) != len(answers):
        raise Unsimulable("the draft replay answered a different number of requests than it was sent")
    ranks = {(a.prompt_ids, a.output_ids): {int(k): v for k, v in per.items()} for a, per in zip(answers, per_answer)}
    seconds = result.get("seconds") or {}
    return DraftTables(draft_model, max_steps, ranks, draft_curve(result.get("draft_cost")),
                       float(seconds.get("replay", 0.0)))


def draft_tables(ctx: TrialContext, space: SearchSpace, answers: Mapping[int, Answer]
                 ) -> tuple[dict[str, DraftTables], DraftCurve | None, str]:
    """simulate-first's draft replay for the study `ctx`: (draft model -> tables, the draft's
    forward cost, a note for the explored line); nothing when the space has no STANDALONE point. The replay's time
    goes on the study run (`simulate_draft_replay_s`, the child process's `simulate_draft_replay_total_s`) with its
    summary (`simulate/draft_replay.json`). Raises Unsimulable when it cannot run (the study falls back to tpe)."""
    plan = draft_plan(space, ctx.study)
    if not plan:
        return {}, None, ""
    if len(plan) > 1:
        raise Unsimulable(f"the space drafts with {len(plan)} draft models ({sorted(plan)}); the step-cost model "
                          "holds one draft model's cost")
    model, (steps, topks) = next(iter(plan.items()))
    measured: list[Answer] = []
    for item in ctx.measure:
        answer = answers.get(item.index)
        if answer is None:
            raise Unsimulable(f"no recorded answer for measurement prompt {item.index}")
        if answer not in measured:
            measured.append(answer)
    folder = Path(ctx.output_dir) / "simulate"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[simulate-first] replaying draft model {model} over {len(measured)} measured answer(s) (topk "
          f"{list(topks)}, up to {steps} steps)", flush=True)
    run = run_draft_replay(ctx.study, model, measured, steps, topks, folder)
    note = (f"; draft replay of {model}: {run.tables.seconds:.1f} s ({run.total_s:.1f} s with the model load), "
            f"{'its measured step cost' if run.tables.curve is not None else 'no step cost measured'}")
    try:
        ctx.tracker.log_figures(
            ctx.parent_run_id, {"simulate_draft_replay_s": run.tables.seconds,
                                "simulate_draft_replay_total_s": run.total_s},
            texts={"simulate/draft_replay.json": json.dumps({
                "draft_model": model, "topks": list(topks), "max_steps": steps, "requests": len(measured),
                "total_s": run.total_s, **run.summary}, indent=2, default=str)})
    except Exception as exc:  # noqa: BLE001 - bookkeeping must not end the search
        print(f"[simulate-first] could not log the draft replay: {type(exc).__name__}: {exc}", flush=True)
    return {model: run.tables}, run.tables.curve, note
