"""One trial's lifecycle: validate -> measure (`pipeline.trial.engine_pass`: start the engine, read back, flush, warm
up, measure) -> compare (`pipeline.trial.gate`) -> record.

Every way a trial can end is an `Outcome`, recorded in MLflow with its reason and logs; nothing here raises for a bad
config or a dead engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import TrialConfig
from pipeline.decide.equivalence import EquivalenceReport
from pipeline.measure.summary import RequestRecord, Summary, summarize, to_table
from pipeline.measure.window import Window, flag, window_record
from pipeline.records.console import note_phase
from pipeline.records.labels import config_label, params_label
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import SERVER_INFO_ARTIFACT, baseline_requests
from pipeline.trial.pruning import Progress, Watch, stop_metrics, trial_watch
from pipeline.vocabulary.resolution import Resolution
from pipeline.trial.engine_pass import measure_config
from pipeline.trial.gate import MeasurePass, baseline_passes, judge_trial
from pipeline.trial.context import Measurement, TrialContext
from pipeline.vocabulary.outcome import Ending, Outcome
from serve.engines import engine_for
from serve.engines.spec_flags import effective_settings


@dataclass
class Checked:
    """One deploy-and-measure pass judged like a trial: outcome, summary, equivalence with the baseline's outputs."""

    measurement: Measurement
    outcome: Outcome
    reason: str
    summary: Summary | None = None
    equivalence: EquivalenceReport | None = None


@dataclass(frozen=True)
class PassCheck:
    """A measured pass against the baseline's outputs (`check_pass`): the outcome it leaves the pass with and why,
    the equivalence report when outputs were compared, and the engine launches the check itself cost."""

    outcome: Outcome
    reason: str
    report: EquivalenceReport | None = None
    launches: int = 0


@dataclass(frozen=True)
class TrialResult:
    outcome: Outcome
    reason: str
    config: TrialConfig | None
    summary: Summary | None = None
    equivalence: EquivalenceReport | None = None
    run_id: str | None = None
    windows: tuple[Window, ...] = ()  # the measurement windows, the recorded one last

    def objective(self, metric: str) -> float | None:
        return getattr(self.summary, metric, None) if self.summary else None


def _node_id() -> str:
    """The Ray node this trial process runs on ('' outside Ray): recorded beside the replica's node."""
    try:
        # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - bookkeeping must never fail a trial
        return ""


def _meaning_changed(trial: TrialConfig, diffs: dict[str, tuple[object, object]]) -> str | None:
    """A diff changes what the trial means when the engine ran another algorithm or another draft/tree shape."""
    serious = {k: v for k, v in diffs.items() if k != "max_running_requests"}
    if not serious:
        return None
    return "engine changed the requested settings: " + ", ".join(
        f"{k}: requested {a!r}, effective {b!r}" for k, (a, b) in serious.items())


def run_trial(ctx: TrialContext, label: str, resolution: Resolution, progress: Progress | None = None) -> TrialResult:
    """The whole trial; records a child run in MLflow whatever the outcome. `progress` gets the measured records and
    the early-stopping verdict after each chunk (Tune's intermediate report) when early stopping is on."""
    started_at = time.time()
    trial_dir = Path(ctx.output_dir) / "trials" / label
    trial_dir.mkdir(parents=True, exist_ok=True)
    study = ctx.study
    config = resolution.config
    m = Measurement()
    equivalence: EquivalenceReport | None = None
    summary: Summary | None = None
    watch, stopping_note = None, "not applied: the config is invalid"
    gate_texts: dict[str, str] = {}  # the baseline's noise or deterministic pass (pipeline/trial/gate.py)
    gate_metrics: dict[str, float] = {}
    if config is None or resolution.violations:
        outcome, reason = Outcome.INVALID, "; ".join(str(v) for v in resolution.violations)
    else:
        watch, stopping_note = trial_watch(study, ctx.tracker, ctx.parent_run_id, ctx.measure, config, progress)
        checked = measure_and_check(ctx, config, label, trial_dir, watch)
        m, outcome, reason = checked.measurement, checked.outcome, checked.reason
        summary, equivalence = checked.summary, checked.equivalence
        if outcome is Outcome.COMPLETE:
            passes = baseline_passes(study, config, m.records, label, trial_dir, another_pass(ctx, config))
            gate_texts, gate_metrics, m.launches = passes.texts, passes.metrics, m.launches + passes.launches
            if passes.problem:
                reason = f"its equivalence pass failed, so no trial can be compared with it: {passes.problem}"
    texts = {**gate_texts, "engine.log": m.engine_log or "(no engine was started)",
             SERVER_INFO_ARTIFACT: json.dumps(m.server_info.as_json(), indent=2, default=str),
             "effective_diff.json": json.dumps({k: list(v) for k, v in m.diffs.items()}, indent=2, default=str),
             "timings.json": json.dumps(m.timings, indent=2)}
    window_metrics, window_tags, window_texts = window_record(m.windows)
    texts.update(window_texts)
    if equivalence is not None:
        texts["equivalence.json"] = equivalence.model_dump_json(indent=2)
    metrics = dict(summary.to_metrics()) if summary else {}
    metrics.update({f"time_{k}": v for k, v in m.timings.items()})
    metrics.update(m.corpus)
    metrics.update(stop_metrics(watch.last if watch else None))
    metrics["engine_launches"] = m.launches
    metrics.update(window_metrics)
    metrics.update(gate_metrics)
    if equivalence is not None:
        metrics["equiv_identical_share"] = equivalence.identical_share
    # SGLang's own cumulative figure: only after its 40-batch window, reset by a flush; optional, and labelled so.
    server_avg = engine_for(study.engine.kind).server_accept_length(
        {"internal_states": m.server_info.internal_states_after})
    if server_avg is not None:
        metrics["server_window_accept_len"] = server_avg
    run_id = ctx.tracker.log_trial(
        ctx.parent_run_id, study_name=study.name, kind="trial", trial_id=label,
        run_name=config_label(config) if config else params_label(resolution.params),
        config=config.model_dump(mode="json") if config else {"spec": {"algorithm": resolution.params.get("algorithm")}},
        outcome=outcome, reason=reason, metrics=metrics, requests=to_table(m.records) if m.records else None,
        texts=texts, extra_tags={"optuna.params": json.dumps(resolution.params, default=str)[:4000],
                                 "trial_node_id": _node_id(), "early_stopping": stopping_note,
                                 "replica_node_id": m.server_info.replica_node_id or "",
                                 # the cpu engine's resolved decode weights (fp32, gguf-avx512, gguf-avx2)
                                 "engine_weights": m.server_info.weights,
                                 # engine restarted in the process's live replica, in the study's standby
                                 # replica, or in a fresh Serve app
                                 "serve_replica": m.replica,
                                 # a launch of its own or the previous config's, shared (serve/replica/sharing.py)
                                 "engine_launch": m.launch,
                                 "engine_diffs": json.dumps({k: list(v) for k, v in m.diffs.items()}, default=str),
                                 # what the engine says it ran with (attention backend, running-request cap, ...)
                                 "engine_effective": json.dumps(effective_settings(m.server_info.as_json()),
                                                                default=str),
                                 **window_tags},
        started_at=started_at)
    return TrialResult(outcome, reason, config, summary, equivalence, run_id, tuple(m.windows))


def measure_and_check(ctx: TrialContext, config: TrialConfig, label: str, log_dir: Path,
                      watch: Watch | None = None, compare: bool = True) -> Checked:
    """The trial's judgement of one pass, shared by trials and finalist re-runs (never watched): measure, then INVALID
    when the engine changed what the config means, then (`compare`) equivalence with the baseline trial's outputs
    (read from MLflow; finalists compare with the baseline's re-runs at their level themselves)."""
    m = measure_config(ctx, config, label, log_dir, watch)
    ending = m.failure or Ending(Outcome.COMPLETE, "")
    outcome, reason = ending.outcome, ending.reason
    changed = _meaning_changed(config, m.diffs)
    if m.failure is None and changed:
        outcome, reason = Outcome.INVALID, changed
    study = ctx.study
    arrival = study.workload.arrival
    summary = summarize(m.records, seed=study.seed,
                        offered_rate_per_s=arrival.rate_per_s if arrival.open_loop else None) if m.records else None
    equivalence = None
    if outcome is Outcome.COMPLETE and compare:
        check = check_pass(ctx, config, m.records, label, log_dir)
        m.launches += check.launches
        outcome, reason, equivalence = check.outcome, check.reason, check.report
    note_phase(log_dir, "measured", outcome=outcome.value, tput_tok_s=summary.tput_tok_s if summary else None,
               timings=m.timings, window=flag(m.windows) if m.windows else None)
    return Checked(m, outcome, reason, summary, equivalence)


def another_pass(ctx: TrialContext, config: TrialConfig) -> MeasurePass:
    """How the equivalence gate measures `config` once more (`pipeline.trial.gate.MeasurePass`): a pass of its own,
    its engine started with the flags the gate adds."""
    def measure(flags: Sequence[str], label: str, log_dir: Path) -> Measurement:
        return measure_config(ctx.with_flags(flags) if flags else ctx, config, label, log_dir)
    return measure


def baseline_outputs(tracker: Tracker, parent_run_id: str) -> list[RequestRecord] | None:
    """The measured outputs of the study's COMPLETE baseline trial, from its MLflow run's `requests.parquet`; None
    when no baseline completed. Read from storage, not a folder, so any driver on any node finds them."""
    found = baseline_requests(tracker, parent_run_id)
    return found[1] if found is not None else None


def check_pass(ctx: TrialContext, config: TrialConfig, records: Sequence[RequestRecord], label: str = "compare",
               log_dir: Path | None = None) -> PassCheck:
    """A pass's greedy outputs (`records`) against the baseline trial's, by the study's equivalence mode
    (pipeline/trial/gate.py; `deterministic` measures once more, its launch counted in the result). The baseline
    itself is the reference: its requests.parquet, logged with its run, is what later comparisons read (a baseline
    that lost a request never gets here: `lost_requests` made it TIMEOUT/UNHEALTHY)."""
    study = ctx.study
    needed = config.spec.algorithm != "none" and study.workload.temperature == 0
    verdict = judge_trial(study, ctx.tracker, ctx.parent_run_id, config, records, label,
                          log_dir or Path(ctx.output_dir) / "trials" / label,
                          baseline_outputs(ctx.tracker, ctx.parent_run_id) if needed else None,
                          another_pass(ctx, config))
    if verdict.passed is False:
        return PassCheck(Outcome.NOT_EQUIVALENT, verdict.reason, verdict.report, verdict.launches)
    return PassCheck(Outcome.COMPLETE, "" if verdict.passed else verdict.reason, verdict.report, verdict.launches)
