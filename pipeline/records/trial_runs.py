"""A study's runs read back from MLflow, typed: trial and finalist runs as `TrialRow`s (`rows_from_runs`, built once
per run by `row_from_run`), the study's baseline trial and what a trial needs of it (`read_baseline`), a run's
measured requests, its recorded config and its engine's `/server_info`, and the per-level decision on the study run.
The rest of the pipeline reads MLflow through these and `tracking.Tracker`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.config import TrialConfig
from pipeline.decide.equivalence import StoredBaseline
from pipeline.decide.levels import BASELINE, LEVELS_ARTIFACT, LevelsDecision
from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord, records_from_json, to_records
from pipeline.records.labels import unique_names
from pipeline.records.tracking import KIND_TAG, TRIAL_ID_TAG, VS_BASELINE_DECIDED, Tracker
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import TrialRow

__all__ = ["DETERMINISTIC_ARTIFACT", "NOISE_ARTIFACT", "PASS_ARTIFACTS", "SERVER_INFO_ARTIFACT", "baseline_trial",
           "child_rows", "order_rows", "read_baseline", "row_from_run", "rows_from_runs", "run_requests",
           "run_server_info", "stored_pass_records", "study_levels", "trial_config", "with_decided"]

SERVER_INFO_ARTIFACT = "server_info.json"  # a trial run's engine's `/server_info`, as the engine answered it
# the baseline trial's equivalence passes (`pipeline.decide.equivalence.Gate.reference_pass`), by the pass's name
NOISE_ARTIFACT = "equivalence/noise_requests.json"
DETERMINISTIC_ARTIFACT = "equivalence/deterministic_requests.json"
PASS_ARTIFACTS = {"noise": NOISE_ARTIFACT, "deterministic": DETERMINISTIC_ARTIFACT}

HIDDEN_PARAMS = ("spec.algorithm", "trial.concurrency")  # the algorithm is the row's own field; concurrency is a level


def row_from_run(run: Any) -> TrialRow:
    """One MLflow run (a trial's or a finalist run's) as a row, named by its run name. Pure over the run object."""
    params = dict(run.data.params)
    return TrialRow(run_id=run.info.run_id, name=run.info.run_name, trial_id=run.data.tags.get(TRIAL_ID_TAG),
                    outcome=Outcome.read(run.data.tags.get("outcome")), reason=run.data.tags.get("reason", ""),
                    algorithm=params.get("spec.algorithm", "?"),
                    params={k: v for k, v in sorted(params.items()) if k not in HIDDEN_PARAMS},
                    figures=dict(run.data.metrics), decided=run.data.metrics.get(VS_BASELINE_DECIDED))


def rows_from_runs(runs: Sequence[Any], kind: str | None = "trial") -> list[TrialRow]:
    """The runs of `kind` (tag `specdec.kind`: trial, finalist; None: every kind) as rows, ordered (`order_rows`),
    each with its ratio to the baseline; a config the sampler proposed twice gets ` #<trial id>` on its slower rows' names. Pure over
    run objects."""
    ordered = order_rows([row_from_run(run) for run in runs if kind is None or run.data.tags.get(KIND_TAG) == kind])
    base = next((r.tput_tok_s for r in ordered if r.baseline and r.complete), None)
    names = unique_names([r.name for r in ordered], [r.trial_id or r.run_id[:8] for r in ordered])
    return [dataclasses.replace(row, name=name, vs_baseline=round(tput / base, 4) if (tput := row.tput_tok_s) and base
                                else None) for row, name in zip(ordered, names)]


def with_decided(rows: Sequence[TrialRow], decision: LevelsDecision, names: Mapping[str, str],
                 level: int) -> list[TrialRow]:
    """`rows` with each finalist's speed-up as the decision read it (`TrialRow.decided`): its row's at `level` (the
    search's, where the trials were measured; the first level when the decision has no such level) in `decision`.
    `names`: each config id of the decision -> its trial row's name. Pure."""
    result = next((r for r in decision.levels if r.level == level), decision.levels[0] if decision.levels else None)
    figures = {names[row.id]: row.speedup for row in (result.rows if result else ())
               if row.id != BASELINE and row.id in names and row.speedup is not None}
    return [dataclasses.replace(row, decided=figures[row.name]) if row.name in figures else row for row in rows]


def order_rows(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Baseline first; then COMPLETE trials by throughput (best first); then the rest; name breaks ties. Pure."""
    return sorted(rows, key=lambda r: (not r.baseline, not r.complete, -(r.tput_tok_s or 0.0), r.name))


def child_rows(tracker: Tracker, parent_run_id: str, kind: str | None = "trial") -> list[TrialRow]:
    """The study run's child runs of `kind` as rows (`rows_from_runs`)."""
    return rows_from_runs(tracker.trial_runs(parent_run_id), kind)


def baseline_trial(tracker: Tracker, parent_run_id: str) -> TrialRow | None:
    """The study's first COMPLETE baseline trial, None when none completed."""
    runs = [r for r in tracker.trial_runs(parent_run_id)
            if r.data.tags.get(KIND_TAG) == "trial" and r.data.tags.get("outcome") == Outcome.COMPLETE.value
            and r.data.params.get("spec.algorithm") == "none"]
    return row_from_run(min(runs, key=lambda r: r.info.start_time or 0)) if runs else None


def run_requests(tracker: Tracker, run_id: str, phase: str | None = "measure") -> list[RequestRecord]:
    """A run's requests from its `requests.parquet`: one `phase`'s (None: every phase: warm-up, measurement,
    reference). Raises what MLflow raises when the run has none."""
    return [r for r in to_records(tracker.requests_table(run_id)) if phase is None or r.phase == phase]


def read_baseline(tracker: Tracker, parent_run_id: str, stored_pass: str | None = None) -> StoredBaseline | None:
    """What a trial needs of the study's COMPLETE baseline trial (`baseline_trial`), in one read: its throughput, its
    measured requests, and its pass `stored_pass` ("noise", "deterministic": `PASS_ARTIFACTS`) where it has one.
    None when no baseline completed; raises what MLflow raises when the store cannot be read."""
    run = baseline_trial(tracker, parent_run_id)
    if run is None:
        return None
    table = tracker.requests_table(run.run_id)
    text = tracker.artifact_text(run.run_id, PASS_ARTIFACTS[stored_pass]) if stored_pass else None
    requests = tuple(r for r in to_records(table) if r.phase == "measure")  # as `run_requests` reads them
    stored = tuple(records_from_json(text)) if text is not None else None
    return StoredBaseline(tput_tok_s=run.tput_tok_s, requests=requests,
                          noise=stored if stored_pass == "noise" else None,
                          deterministic=stored if stored_pass == "deterministic" else None)


def stored_pass_records(tracker: Tracker, parent_run_id: str, artifact: str) -> list[RequestRecord] | None:
    """The records of a pass (`artifact`) of the study's COMPLETE baseline trial, None when it has none."""
    run = baseline_trial(tracker, parent_run_id)
    text = tracker.artifact_text(run.run_id, artifact) if run is not None else None
    return records_from_json(text) if text is not None else None


def run_server_info(tracker: Tracker, run_id: str) -> ServerInfo | None:
    """What the engine of the trial run `run_id` reported (its `server_info.json`), None when the run has none.
    ValueError when the artifact is no JSON."""
    text = tracker.artifact_text(run_id, SERVER_INFO_ARTIFACT)
    return ServerInfo.from_text(text) if text else None


def trial_config(tracker: Tracker, run_id: str) -> TrialConfig:
    """The config a trial or finalist run measured (its `trial_config.json`)."""
    text = tracker.artifact_text(run_id, "trial_config.json")
    if text is None:
        raise FileNotFoundError(f"run {run_id} has no trial_config.json")
    return TrialConfig.model_validate(json.loads(text))


def study_levels(tracker: Tracker, runs: Sequence[Any]) -> LevelsDecision | None:
    """The per-level decision logged on the study's newest study run among `runs`
    (`pipeline.decide.levels.LEVELS_ARTIFACT`), None when it has none (single level, or a study from before per-level
    promotion)."""
    parents = [r for r in runs if r.data.tags.get(KIND_TAG) == "study"]
    for parent in sorted(parents, key=lambda r: r.info.start_time or 0, reverse=True):
        text = tracker.artifact_text(parent.info.run_id, LEVELS_ARTIFACT)
        if text is not None:
            return LevelsDecision.model_validate_json(text)
    return None
