"""One trial's lifecycle: validate -> deploy -> read back -> flush -> warm up -> measure -> compare -> record -> teardown.

Every way a trial can end is an `Outcome`, recorded in MLflow with its reason and logs; nothing here raises for a bad
config or a dead engine. The engine runs behind a Ray Serve app named `trial-<label>` (route `/trial-<label>`).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pipeline.config import StudyConfig, TrialConfig
from pipeline.equivalence import EquivalenceReport, check_equivalence
from pipeline.load import LoadRequest, run_phase
from pipeline.measure import RequestRecord, Summary, summarize, to_records, to_table
from pipeline.record import Tracker
from pipeline.space import Resolution
from serve.engines.base import ReplicaConfig, effective_diff
from serve.replica import log_tail


class Outcome(str, enum.Enum):
    COMPLETE = "COMPLETE"
    INVALID = "INVALID"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    UNHEALTHY = "UNHEALTHY"
    TIMEOUT = "TIMEOUT"
    NOT_EQUIVALENT = "NOT_EQUIVALENT"
    PRUNED = "PRUNED"


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a study shares. Picklable: it travels to Tune's trial processes."""

    study: StudyConfig
    output_dir: str
    serve_url: str
    tracker: Tracker
    parent_run_id: str
    warmup: tuple[LoadRequest, ...]
    measure: tuple[LoadRequest, ...]

    @property
    def baseline_outputs(self) -> Path:
        return Path(self.output_dir) / "baseline_outputs.parquet"


@dataclass
class Measurement:
    """What one deploy-and-measure pass produced (a trial, or one finalist re-run)."""

    records: list[RequestRecord] = field(default_factory=list)
    server_info: dict[str, Any] = field(default_factory=dict)
    diffs: dict[str, tuple[object, object]] = field(default_factory=dict)
    engine_log: str = ""
    failure: tuple[Outcome, str] | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrialResult:
    outcome: Outcome
    reason: str
    config: TrialConfig | None
    summary: Summary | None = None
    equivalence: EquivalenceReport | None = None
    run_id: str | None = None

    def objective(self, metric: str) -> float | None:
        return getattr(self.summary, metric, None) if self.summary else None


def replica_config(study: StudyConfig, trial: TrialConfig, log_dir: Path) -> ReplicaConfig:
    return ReplicaConfig(
        engine=study.engine.kind, model=study.model.target, dtype=study.model.dtype, spec=trial.spec,
        max_running_requests=trial.max_running_requests, threads=study.engine.threads, tp_size=study.engine.tp_size,
        extra_flags=study.engine.extra_flags, env=study.engine.env, start_timeout_s=study.engine.start_timeout_s,
        log_dir=str(log_dir))


def _app_failure(name: str) -> str:
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return "application vanished"
    parts = [app.message] + [d.message for d in app.deployments.values() if d.message]
    return "\n".join(p for p in parts if p)


def deploy(name: str, config: ReplicaConfig, timeout_s: float) -> None:
    """Start app `name` without blocking Serve forever (serve.run has no timeout); raise RuntimeError/TimeoutError."""
    from ray import serve

    from serve.replica import EngineReplica

    num_gpus = config.tp_size if config.engine == "sglang" else 0
    target = EngineReplica.options(ray_actor_options={"num_cpus": 0.1, "num_gpus": num_gpus}).bind(
        config.model_dump(mode="json"))
    serve.run_many([serve.RunTarget(target, name=name, route_prefix=f"/{name}")], wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "MISSING"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
            raise RuntimeError(f"Serve app {name} is {status.split('.')[-1]}: {_app_failure(name)}")
        time.sleep(0.2)
    raise TimeoutError(f"Serve app {name} not RUNNING after {timeout_s:.0f} s")


def teardown(name: str) -> None:
    """Delete the app if it exists (idempotent: also called from the driver's callback)."""
    from ray import serve

    try:
        if name in serve.status().applications:
            serve.delete(name)
    except Exception:  # noqa: BLE001 - cleanup must never hide the trial's own outcome
        pass


def _engine_log(url: str, log_dir: Path) -> str:
    try:
        response = httpx.get(f"{url}/replica/log", timeout=10)
        if response.status_code == 200:
            return response.text
    except httpx.HTTPError:
        pass
    return "\n".join(log_tail(p, 200_000) for p in sorted(log_dir.glob("engine-*.log")))


def measure_config(ctx: TrialContext, trial: TrialConfig, label: str, log_dir: Path) -> Measurement:
    """Deploy one replica for `trial`, flush, warm up, measure, read back, tear down. Never raises for engine trouble."""
    study, name = ctx.study, f"trial-{label}"
    config = replica_config(study, trial, log_dir)
    url = f"{ctx.serve_url}/{name}"
    out = Measurement()
    started = time.monotonic()
    if config.engine == "sglang":
        out.failure = _sglang_preflight(config, out)
        if out.failure is not None:
            return out
    try:
        try:
            deploy(name, config, study.engine.start_timeout_s + 60)
        except TimeoutError as exc:
            out.failure = (Outcome.TIMEOUT, str(exc))
            return out
        except RuntimeError as exc:
            out.failure = (Outcome.LAUNCH_FAILED, str(exc))
            return out
        out.timings["deploy_s"] = time.monotonic() - started
        with httpx.Client(base_url=url, timeout=30) as client:
            startup = client.get("/replica/argv").json().get("startup_s")
            if isinstance(startup, (int, float)):
                out.timings["engine_start_s"] = float(startup)
            out.server_info = client.get("/server_info").json()
            out.diffs.update(effective_diff(config, out.server_info))
            flushed = client.post("/flush_cache")
            if flushed.status_code != 200:
                out.failure = (Outcome.UNHEALTHY, f"/flush_cache answered {flushed.status_code}: {flushed.text}")
                return out
        phase_start = time.monotonic()
        kwargs = dict(concurrency=trial.concurrency, temperature=study.workload.temperature,
                      timeout_s=study.engine.request_timeout_s)
        # warmup_requests may exceed the warm-up split: cycle it (the trie then sees some prompts twice).
        warm = [ctx.warmup[i % len(ctx.warmup)] for i in range(trial.warmup_requests)] if ctx.warmup else []
        out.records += run_phase(url, warm, phase="warmup", **kwargs) if warm else []
        out.timings["warmup_s"] = time.monotonic() - phase_start
        phase_start = time.monotonic()
        out.records += run_phase(url, list(ctx.measure), phase="measure", **kwargs)
        out.timings["measure_s"] = time.monotonic() - phase_start
        try:
            after = httpx.get(f"{url}/server_info", timeout=30).json()
            out.server_info["internal_states_after"] = after.get("internal_states")
        except (httpx.HTTPError, ValueError):
            pass
        measured = [r for r in out.records if r.phase == "measure"]
        if measured and all(r.error for r in measured):
            kind = Outcome.TIMEOUT if all("timeout" in (r.error or "") for r in measured) else Outcome.UNHEALTHY
            out.failure = (kind, f"every measured request failed; first: {measured[0].error}")
        return out
    except (httpx.HTTPError, ValueError) as exc:
        out.failure = (Outcome.UNHEALTHY, f"{type(exc).__name__}: {exc}")
        return out
    finally:
        out.engine_log = _engine_log(url, log_dir)
        teardown(name)
        out.timings["total_s"] = time.monotonic() - started


def _sglang_preflight(config: ReplicaConfig, out: Measurement) -> tuple[Outcome, str] | None:
    """SGLang's own parser and rules on the exact argv, then the GPU check: both before any deployment."""
    from serve.engines.sglang import gpu_problem, preflight, sglang_argv

    argv = sglang_argv(config, "127.0.0.1", 30000)
    result = preflight(argv)
    if result is None:
        out.server_info["preflight"] = "skipped: sglang is not installed on the driver's machine"
    else:
        out.server_info["preflight"] = {"ok": result.ok, "stage": result.stage, "error": result.error,
                                        "resolved": result.resolved}
        if not result.ok and result.stage in ("parse", "resolve", "check"):
            return Outcome.INVALID, f"SGLang rejected the flags at {result.stage}: {result.error}"
        if not result.ok:  # our side could not run SGLang's parser: not a verdict on the config
            return Outcome.LAUNCH_FAILED, f"SGLang preflight could not run ({result.stage}): {result.error}"
        out.diffs = result.diffs(config.spec, config.max_running_requests)
    problem = gpu_problem(config.tp_size)
    if problem:
        return Outcome.LAUNCH_FAILED, problem
    return None


def _meaning_changed(trial: TrialConfig, diffs: dict[str, tuple[object, object]]) -> str | None:
    """A diff changes what the trial means when the engine ran another algorithm or another draft/tree shape."""
    serious = {k: v for k, v in diffs.items() if k != "max_running_requests"}
    if not serious:
        return None
    return "engine changed the requested settings: " + ", ".join(
        f"{k}: requested {a!r}, effective {b!r}" for k, (a, b) in serious.items())


def run_trial(ctx: TrialContext, label: str, resolution: Resolution) -> TrialResult:
    """The whole trial; records a child run in MLflow whatever the outcome."""
    started_at = time.time()
    trial_dir = Path(ctx.output_dir) / "trials" / label
    trial_dir.mkdir(parents=True, exist_ok=True)
    study = ctx.study
    config = resolution.config
    m = Measurement()
    equivalence: EquivalenceReport | None = None
    summary: Summary | None = None
    if config is None or resolution.violations:
        outcome, reason = Outcome.INVALID, "; ".join(str(v) for v in resolution.violations)
    else:
        m = measure_config(ctx, config, label, trial_dir)
        outcome, reason = m.failure or (Outcome.COMPLETE, "")
        changed = _meaning_changed(config, m.diffs)
        if m.failure is None and changed:
            outcome, reason = Outcome.INVALID, changed
        if m.records:
            summary = summarize(m.records, seed=study.seed)
        if outcome is Outcome.COMPLETE:
            outcome, reason, equivalence = _compare(ctx, config, m.records)
    texts = {"engine.log": m.engine_log or "(no engine was started)",
             "server_info.json": json.dumps(m.server_info, indent=2, default=str),
             "effective_diff.json": json.dumps({k: list(v) for k, v in m.diffs.items()}, indent=2, default=str),
             "timings.json": json.dumps(m.timings, indent=2)}
    if equivalence is not None:
        texts["equivalence.json"] = equivalence.model_dump_json(indent=2)
    metrics = dict(summary.to_metrics()) if summary else {}
    metrics.update({f"time_{k}": v for k, v in m.timings.items()})
    if equivalence is not None:
        metrics["equiv_identical_share"] = equivalence.identical_share
    server_avg = (m.server_info.get("internal_states_after") or [{}])[0].get("avg_spec_accept_length")
    if isinstance(server_avg, (int, float)):
        metrics["server_accept_len"] = float(server_avg)
    run_id = ctx.tracker.log_trial(
        ctx.parent_run_id, study_name=study.name, run_name=f"trial-{label}", kind="trial",
        config=config.model_dump(mode="json") if config else {"spec": {"algorithm": resolution.params.get("algorithm")}},
        outcome=outcome.value, reason=reason, metrics=metrics, requests=to_table(m.records) if m.records else None,
        texts=texts, extra_tags={"optuna.params": json.dumps(resolution.params, default=str)[:4000],
                                 "engine_diffs": json.dumps({k: list(v) for k, v in m.diffs.items()}, default=str)},
        started_at=started_at)
    return TrialResult(outcome, reason, config, summary, equivalence, run_id)


def _compare(ctx: TrialContext, config: TrialConfig, records: list[RequestRecord]) -> tuple[Outcome, str, Any]:
    """Baseline: store its outputs. Others: greedy outputs must match the baseline's by the policy threshold."""
    if config.spec.algorithm == "none":
        if not ctx.baseline_outputs.exists():
            import pyarrow.parquet as pq

            pq.write_table(to_table([r for r in records if r.phase == "measure"]), ctx.baseline_outputs)
        return Outcome.COMPLETE, "", None
    if ctx.study.workload.temperature > 0:
        return Outcome.COMPLETE, "sampling (temperature > 0): outputs are not compared", None
    if not ctx.baseline_outputs.exists():
        return Outcome.COMPLETE, "no baseline outputs to compare with (the baseline did not complete)", None
    import pyarrow.parquet as pq

    baseline = to_records(pq.read_table(ctx.baseline_outputs))
    report = check_equivalence(baseline, records, threshold=ctx.study.promotion.equivalence_threshold)
    if not report.passed:
        return Outcome.NOT_EQUIVALENT, report.reason, report
    return Outcome.COMPLETE, "", report
