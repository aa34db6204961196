"""One trial's lifecycle, top to bottom: validate -> read what it needs of the baseline trial, once
(`pipeline.records.trial_runs.read_baseline`) -> early stopping's watch (`pipeline.trial.pruning`) -> measure
(`pipeline.trial.engine_pass`: start the engine, read back, flush, warm up, measure) -> judge
(`pipeline.decide.equivalence.judge_pass`, with the passes the study's equivalence mode asks for:
`pipeline.trial.gate`) -> record.

Every way a trial can end is an `Outcome`, recorded in MLflow with its reason and logs; nothing here raises for a bad
config or a dead engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import TrialConfig
from pipeline.decide.equivalence import EquivalenceReport, Gate, StoredBaseline, judge_pass
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import Summary, to_table
from pipeline.measure.window import Window, flag, window_record
from pipeline.records.console import note_phase
from pipeline.records.labels import config_label, params_label
from pipeline.records.trial_runs import SERVER_INFO_ARTIFACT, read_baseline
from pipeline.trial.context import TrialContext
from pipeline.trial.engine_pass import measure_config
from pipeline.trial.gate import References, gate_for, gate_pass, reference_pass
from pipeline.trial.pruning import Progress, Watch, stop_metrics, trial_watch
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.resolution import Resolution
from serve.engines.spec_flags import effective_settings


@dataclass(frozen=True)
class Checked:
    """One deploy-and-measure pass judged like a trial: what it measured, its outcome and why, and the equivalence
    report where its outputs were compared with the baseline's."""

    measurement: Measurement
    outcome: Outcome
    reason: str
    equivalence: EquivalenceReport | None = None

    @property
    def summary(self) -> Summary | None:
        return self.measurement.summary


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


def run_trial(ctx: TrialContext, label: str, resolution: Resolution, progress: Progress | None = None) -> TrialResult:
    """The whole trial; records a child run in MLflow whatever the outcome. `progress` gets the measured records and
    the early-stopping verdict after each chunk (Tune's intermediate report) when early stopping is on."""
    started_at = time.time()
    trial_dir = Path(ctx.output_dir) / "trials" / label
    trial_dir.mkdir(parents=True, exist_ok=True)
    config = resolution.config
    watch, stopping_note, references = None, "not applied: the config is invalid", References()
    if config is None or resolution.violations:
        checked = Checked(Measurement(), Outcome.INVALID, "; ".join(str(v) for v in resolution.violations))
    else:
        gate = gate_for(ctx, config)
        baseline, unread = None, None
        if config.spec.algorithm != "none":  # early stopping's bar and the comparison's reference, read once
            try:
                baseline = read_baseline(ctx.tracker, ctx.parent_run_id, gate.stored_pass)
            except Exception as exc:  # noqa: BLE001 - the tracking store's trouble must not fail the trial here
                unread = f"the baseline's run could not be read ({type(exc).__name__}: {str(exc)[:200]})"
        watch, stopping_note = trial_watch(ctx.study, baseline, ctx.measure, config, progress, unread)
        checked = measure_and_check(ctx, config, label, trial_dir, watch, gate, baseline)
        if checked.outcome is Outcome.COMPLETE:
            references = reference_pass(ctx, gate, config, label, trial_dir, checked.measurement.records)
    return record_trial(ctx, label, resolution, checked, references, watch, stopping_note, started_at)


def measure_and_check(ctx: TrialContext, config: TrialConfig, label: str, log_dir: Path, watch: Watch | None = None,
                      gate: Gate | None = None, baseline: StoredBaseline | None = None) -> Checked:
    """The trial's judgement of one pass, shared by trials and finalist re-runs (never watched, never gated): measure,
    then judge (`judge_pass`): INVALID when the engine changed what the config means; with a `gate` (a search trial),
    its outputs against the baseline trial's (`baseline`, as read before the trial), measuring its own deterministic
    pass first where the mode asks for it. Finalists compare with the baseline's re-runs at their level themselves."""
    m = measure_config(ctx, config, label, log_dir, watch)
    own = None
    if gate is not None and gate.compares and m.ending.outcome is Outcome.COMPLETE:
        if baseline is None:  # it may have completed while this trial measured: on a cluster trials run beside it
            baseline = read_baseline(ctx.tracker, ctx.parent_run_id, gate.stored_pass)
        if baseline is not None and baseline.deterministic is not None:
            # `deterministic`: the outputs compared are those of engines started deterministically, its own too
            own = gate_pass(ctx, gate, config, label, log_dir, "deterministic")
            m.launches += own.launches
    verdict = judge_pass(m, gate, baseline, own)
    note_phase(log_dir, "measured", outcome=verdict.outcome.value,
               tput_tok_s=m.summary.tput_tok_s if m.summary else None, timings=m.timings,
               window=flag(m.windows) if m.windows else None)
    return Checked(m, verdict.outcome, verdict.reason, verdict.report)


def record_trial(ctx: TrialContext, label: str, resolution: Resolution, checked: Checked, references: References,
                 watch: Watch | None, stopping_note: str, started_at: float) -> TrialResult:
    """The trial's child run in MLflow (its config, outcome, figures, artifacts and tags) and its result. A baseline
    whose reference pass failed stays COMPLETE, with that reason: no trial can be compared with it."""
    config, m, report = resolution.config, checked.measurement, checked.equivalence
    reason = (f"its equivalence pass failed, so no trial can be compared with it: {references.problem}"
              if references.problem else checked.reason)
    window_metrics, window_tags, window_texts = window_record(m.windows)
    diffs = {k: list(v) for k, v in m.diffs.items()}
    texts = {**references.texts, "engine.log": m.engine_log or "(no engine was started)",
             SERVER_INFO_ARTIFACT: json.dumps(m.server_info.as_json(), indent=2, default=str),
             "effective_diff.json": json.dumps(diffs, indent=2, default=str),
             "timings.json": json.dumps(m.timings, indent=2), **window_texts,
             **({"equivalence.json": report.model_dump_json(indent=2)} if report is not None else {})}
    # SGLang's own cumulative figure: only after its 40-batch window, reset by a flush; optional, and labelled so.
    server_avg = ctx.engine.server_accept_length({"internal_states": m.server_info.internal_states_after})
    metrics = {**(m.summary.to_metrics() if m.summary else {}), **{f"time_{k}": v for k, v in m.timings.items()},
               **m.corpus, **stop_metrics(watch.last if watch else None),
               "engine_launches": m.launches + references.launches, **window_metrics, **references.metrics,
               **({"equiv_identical_share": report.identical_share} if report is not None else {}),
               **({"server_window_accept_len": server_avg} if server_avg is not None else {})}
    run_id = ctx.tracker.log_trial(
        ctx.parent_run_id, study_name=ctx.study.name, kind="trial", trial_id=label,
        run_name=config_label(config) if config else params_label(resolution.params),
        config=(config.model_dump(mode="json") if config
                else {"spec": {"algorithm": resolution.params.get("algorithm")}}),
        outcome=checked.outcome, reason=reason, metrics=metrics, requests=to_table(m.records) if m.records else None,
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
                                 "engine_diffs": json.dumps(diffs, default=str),
                                 # what the engine says it ran with (attention backend, running-request cap, ...)
                                 "engine_effective": json.dumps(effective_settings(m.server_info.as_json()),
                                                                default=str),
                                 **window_tags},
        started_at=started_at)
    return TrialResult(checked.outcome, reason, config, m.summary, report, run_id, tuple(m.windows))
