"""What the study report shows beside the decision, read back from MLflow once the study is done: the study's
details (model, engine and version, hardware, date, the project's commit, the workload's prompt and output lengths,
the concurrency levels), the runs the decision rests on (the finalist stage's re-runs; a study that re-measured
nothing rests on its search runs) with each run's requests, and the simulated space of a simulate-first study
(`simulate/space_predictions.jsonl` and `simulate/predictions.json` on the study run). `gather_report_inputs` is the
only I/O here; the report (`pipeline.records.report`) renders what it returns.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import statistics
import subprocess
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord, to_records
from pipeline.records.provenance import tuned_on
from pipeline.records.tracking import KIND_TAG, REPLACED_TAG, SPACE_PREDICTIONS, Tracker
from pipeline.records.trial_runs import run_server_info

__all__ = ["ReportInputs", "RunRecord", "SpacePoint", "StudyDetails", "gather_report_inputs", "point_label",
           "project_commit", "report_inputs", "run_record"]

REPO = Path(__file__).resolve().parents[2]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StudyDetails(_Frozen):
    """The facts a reader needs to judge where the answer holds: (label, value) pairs in reading order."""

    items: tuple[tuple[str, str], ...]

    def get(self, label: str) -> str | None:
        return next((value for key, value in self.items if key == label), None)


class RunRecord(_Frozen):
    """One measured run the decision rests on: its name, config, level, slot in the measuring order, outcome,
    throughput, flags, and each measured request's start, first token and end (seconds since the window's start)
    and gaps between tokens."""

    name: str
    config: str
    level: int
    order: int | None = None
    outcome: str = ""
    tput_tok_s: float | None = None
    flags: tuple[str, ...] = ()
    counted: bool = True  # False: a fresh run replaced it (its config's runs disagreed); listed, not decided on
    starts_s: tuple[float, ...] = ()
    ttfts_s: tuple[float | None, ...] = ()
    e2es_s: tuple[float, ...] = ()
    itls_s: tuple[float, ...] = ()


class SpacePoint(_Frozen):
    """One config of the simulated space: its label, predicted throughput, and the measured one when launched."""

    label: str
    predicted: float
    launched: bool = False
    measured: float | None = None


class ReportInputs(_Frozen):
    details: StudyDetails
    runs: tuple[RunRecord, ...] = ()
    finalist_stage: bool = False  # False: the runs are the search's (nothing was re-measured)
    space: tuple[SpacePoint, ...] = ()
    space_metric: str = "tput_tok_s"


def run_record(name: str, config: str, level: int, order: int | None, outcome: str, tput: float | None,
               flags: Sequence[str], requests: Sequence[RequestRecord], counted: bool = True) -> RunRecord:
    """A run's record from its measured requests (the `measure` phase; failed requests have no first token). Pure."""
    measured = sorted((r for r in requests if r.phase == "measure"), key=lambda r: r.start_s)
    return RunRecord(name=name, config=config, level=level, order=order, outcome=outcome, tput_tok_s=tput,
                     flags=tuple(flags), counted=counted, starts_s=tuple(r.start_s for r in measured),
                     ttfts_s=tuple(r.ttft_s for r in measured), e2es_s=tuple(r.e2e_s for r in measured),
                     itls_s=tuple(gap for r in measured for gap in r.itl_s))


def project_commit() -> str:
    """The checkout's commit (with `+ local changes` when the tree differs from it), or the installed version."""
    git = shutil.which("git")
    if git and (REPO / ".git").exists():
        try:
            head = subprocess.run([git, "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                  text=True, timeout=20, check=True).stdout.strip()
            dirty = subprocess.run([git, "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=20, check=False).stdout.strip()
            return head + (" + local changes" if dirty else "") + " (the checkout that wrote this report)"
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return f"specdec-tuner {version('specdec-tuner')} (no git checkout)"
    except Exception:  # noqa: BLE001 - neither a checkout nor an installed distribution
        return "unknown"


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):g} / {statistics.median(values):g} / {max(values):g}"


def _run_date(run: Any) -> str:
    started = run.info.start_time
    if not started:
        return "-"
    return dt.datetime.fromtimestamp(started / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _details(study: Any, parent: Any, server_info: ServerInfo, lengths: Sequence[RequestRecord],
             engine: str, hardware: str | None, commit: str) -> StudyDetails:
    wl = study.workload
    isa = server_info.weights_isa
    items = [("study", study.name), ("date", _run_date(parent)), ("model", study.model.target),
             ("dtype", str(study.model.dtype)), ("engine", engine), ("device", str(study.engine.device)),
             ("hardware (the baseline engine's node)", (hardware or "not readable")
              + (f"; kernel ISA {isa}" if isa else "")),
             ("project commit", commit),
             ("workload", f"{wl.source}: {wl.warmup_prompts} warm-up + {wl.measure_prompts} measured prompts, "
                          f"temperature {wl.temperature:g}, {wl.arrival.describe(study.concurrency[0])}"),
             ("prompt tokens (min / median / max)", _spread([r.prompt_tokens for r in lengths])),
             ("output tokens (min / median / max)",
              _spread([r.completion_tokens for r in lengths]) + f" (max_new_tokens {wl.max_new_tokens})"),
             ("concurrency levels", f"{list(study.concurrency)} (search at {study.search_concurrency})"),
             ("search", f"{study.search.strategy}, up to {study.budget.max_trials} trials"),
             ("finalists", f"{study.promotion.finalists}, {study.promotion.runs} fresh runs each per level, "
                           f"equivalence {study.promotion.equivalence}")]
    return StudyDetails(items=tuple(items))


def _flags(run: Any) -> list[str]:
    tags = run.data.tags
    flags = []
    if tags.get("measurement_flag") and tags["measurement_flag"] != "clean":
        flags.append(f"window {tags['measurement_flag']}")
    if tags.get(REPLACED_TAG):
        flags.append("not counted, " + tags[REPLACED_TAG][:160])
    if tags.get("outcome") and tags["outcome"] != "COMPLETE":
        flags.append(tags["outcome"].lower())
    return flags


def point_label(params: dict[str, Any]) -> str:
    """A simulated point named by its algorithm and sampled values (Optuna's branch prefixes dropped). Pure."""
    values = " ".join(f"{str(k).rsplit('.', 1)[-1]}={v}" for k, v in params.items() if k != "algorithm")
    return f"{params.get('algorithm', '?')} {values}".strip()


def _records(tracker: Tracker, run_id: str) -> list[RequestRecord]:
    try:
        return to_records(tracker.requests_table(run_id))
    except Exception:  # noqa: BLE001 - a run that measured nothing has no requests.parquet
        return []


def _space(tracker: Tracker, parent_id: str) -> tuple[list[SpacePoint], str]:
    text = tracker.artifact_text(parent_id, SPACE_PREDICTIONS)
    if not text:
        return [], "tput_tok_s"
    summary = json.loads(tracker.artifact_text(parent_id, "simulate/predictions.json") or "{}")
    metric = str(summary.get("metric") or "tput_tok_s")
    launched = {json.dumps(entry.get("params"), sort_keys=True, default=str): entry.get("measured")
                for entry in summary.get("launches") or []}
    points = []
    for line in text.splitlines():
        entry = json.loads(line)
        value = (entry.get("predicted") or {}).get(metric)
        if not isinstance(value, (int, float)):
            continue
        key = json.dumps(entry.get("params"), sort_keys=True, default=str)
        measured = launched.get(key)
        points.append(SpacePoint(label=point_label(entry.get("params") or {}), predicted=float(value),
                                 launched=key in launched,
                                 measured=float(measured) if isinstance(measured, (int, float)) else None))
    return points, metric


def gather_report_inputs(tracker: Tracker, parent_run_id: str, study: Any,
                         labels: dict[str, str] | None = None) -> ReportInputs:
    """Everything the report shows beside the decision, from the study's MLflow runs. `labels`: finalist id ->
    config label (the per-level decision's). The engine's version and node are the baseline trial's
    (`pipeline.records.provenance.tuned_on`: the node is read through Ray where the study is connected)."""
    runs = tracker.trial_runs(parent_run_id)
    parent = tracker.client().get_run(parent_run_id)
    finalist_runs = [r for r in runs if r.data.tags.get(KIND_TAG) == "finalist"]
    trial_runs = sorted((r for r in runs if r.data.tags.get(KIND_TAG) == "trial"),
                        key=lambda r: r.info.start_time or 0)
    base = next((r for r in trial_runs if r.data.params.get("spec.algorithm") == "none"
                 and r.data.tags.get("outcome") == "COMPLETE"), None)
    info = (run_server_info(tracker, base.info.run_id) if base else None) or ServerInfo()
    base_requests = [r for r in _records(tracker, base.info.run_id) if r.phase == "measure"] if base else []
    engine, hardware = tuned_on(tracker, base.info.run_id if base else None, study.engine.kind)
    details = _details(study, parent, info, base_requests, engine, hardware, project_commit())
    records = []
    if finalist_runs:
        names = {**(labels or {}), "final-baseline": "baseline"}
        for run in finalist_runs:
            tags = run.data.tags
            tag = tags.get("finalist", "")
            order = tags.get("run_order")
            records.append(run_record(run.info.run_name, names.get(tag, tag), int(tags.get("concurrency") or 1),
                                      int(order) if order and order.isdigit() else None, tags.get("outcome", ""),
                                      run.data.metrics.get("tput_tok_s"), _flags(run),
                                      _records(tracker, run.info.run_id), counted=not tags.get(REPLACED_TAG)))
    else:
        for k, run in enumerate(trial_runs, start=1):
            level = run.data.params.get("trial.concurrency")
            records.append(run_record(run.info.run_name, "baseline" if run is base else run.info.run_name,
                                      int(level) if level and level.isdigit() else study.search_concurrency, k,
                                      run.data.tags.get("outcome", ""), run.data.metrics.get("tput_tok_s"),
                                      _flags(run), _records(tracker, run.info.run_id)))
    # a replaced run shares its slot with its replacement, and ran before it
    records.sort(key=lambda r: (r.level, r.order if r.order is not None else 10**9, r.counted, r.name))
    space, metric = _space(tracker, parent_run_id)
    return ReportInputs(details=details, runs=tuple(records), finalist_stage=bool(finalist_runs), space=tuple(space),
                        space_metric=metric)


def report_inputs(tracker: Tracker, parent_run_id: str, study: Any,
                  labels: dict[str, str] | None = None) -> ReportInputs | None:
    """`gather_report_inputs`, or None (said on the console) when the records cannot be read: the report then shows
    the decision without them rather than not at all."""
    try:
        return gather_report_inputs(tracker, parent_run_id, study, labels)
    except Exception as exc:  # noqa: BLE001 - the decision's report must not be lost to a detail
        print(f"report: the study's details and runs could not be read ({type(exc).__name__}: {exc}); "
              "the report shows the decision without them")
        return None
