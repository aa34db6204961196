"""MLflow I/O of the closed loop (`pipeline/loop/`): one run per cycle in the experiment `<registered model>-loop`,
and the measured requests behind a registered version (the drift test's reference).

A cycle's run: tags `specdec.kind` = `loop-cycle`, `cycle`, `trigger`, `production_version`, then `retune_study`,
`retune_output`, `candidate_version`, `capture` (the split in words) and `outcome`; artifacts `drift.json` (the
detectors' verdicts that started it), `retune.json`, `canary/step-<k>.json` (each decision), `outcome.txt`; metrics
`canary_share`, `canary_production_tput`, `canary_candidate_tput` per step; the run's description
(`mlflow.note.content`) links the re-tune's experiment and the candidate's version page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.records.registry import load_serving_config
from pipeline.records.tracking import KIND_TAG, REPLACED_TAG, Tracker
from pipeline.vocabulary.outcome import Outcome

__all__ = ["CYCLE_KIND", "CycleRecorder", "counted_reruns", "measured_requests"]

CYCLE_KIND = "loop-cycle"
NOTE_TAG = "mlflow.note.content"


class CycleRecorder:
    def __init__(self, tracker: Tracker, experiment: str) -> None:
        self.tracker, self.experiment = tracker, experiment

    def _client(self) -> Any:
        return self.tracker.client()

    def start(self, cycle: int, trigger: str, production_version: str | None, drift_json: str) -> str:
        client = self._client()
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        run = client.create_run(experiment_id, run_name=f"cycle-{cycle}", tags={
            KIND_TAG: CYCLE_KIND, "cycle": str(cycle), "trigger": trigger[:4000],
            "production_version": production_version or ""})
        client.log_text(run.info.run_id, drift_json, "drift.json")
        return str(run.info.run_id)

    def tags(self, run_id: str, tags: dict[str, str]) -> None:
        client = self._client()
        for key, value in tags.items():
            client.set_tag(run_id, key, str(value)[:4000])

    def text(self, run_id: str, text: str, path: str) -> None:
        self._client().log_text(run_id, text, path)

    def metrics(self, run_id: str, metrics: dict[str, float | None], step: int) -> None:
        client = self._client()
        for key, value in metrics.items():
            if value is not None:
                client.log_metric(run_id, key, float(value), step=step)

    def linked(self, run_id: str, registered_model: str, retune_study: str | None, candidate: str | None) -> None:
        """The run's description: where the re-tune's study and the candidate's version page are."""
        client = self._client()
        lines = []
        if retune_study:
            found = client.get_experiment_by_name(retune_study)
            if found is not None:
                lines.append(f"- re-tune study: [experiment {retune_study}](#/experiments/{found.experiment_id})")
        if candidate:
            lines.append(f"- candidate: [{registered_model} version {candidate}](#/models/{registered_model}/versions/"
                         f"{candidate})")
        if lines:
            client.set_tag(run_id, NOTE_TAG, "\n".join(lines))

    def end(self, run_id: str, outcome: str, reason: str, failed: bool) -> None:
        client = self._client()
        client.set_tag(run_id, "outcome", outcome)
        client.log_text(run_id, reason + "\n", "outcome.txt")
        client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


def counted_reruns(runs: list[Any]) -> list[Any]:
    """The re-runs the decision counted: COMPLETE, and not replaced by a fresh run (`REPLACED_TAG`)."""
    return [r for r in runs if r.data.tags.get("outcome") == Outcome.COMPLETE.value and REPLACED_TAG not in r.data.tags]


def measured_requests(tracker: Tracker, registered_model: str, version: str) -> tuple[Any, list[dict[str, Any]],
                                                                                      list[str], list[str]]:
    """(serving config, measured request rows, run ids, notes) of a registered version: the re-runs of the chosen
    config (tag `finalist` = `final-baseline` or the finalist's name, under the version's study run), else the
    search trial that measured it (`Provenance.trial_run_id`)."""
    client = tracker.client()
    mv = client.get_model_version(registered_model, version)
    serving = load_serving_config(tracker.tracking_uri, f"models:/{registered_model}/{version}")
    prov = serving.provenance
    finalist = "final-baseline" if prov.source == "baseline" else prov.source
    runs: list[Any] = []
    notes: list[str] = []
    if mv.run_id:
        experiment = client.get_run(mv.run_id).info.experiment_id
        runs = counted_reruns(client.search_runs(
            [experiment], filter_string=f"tags.mlflow.parentRunId = '{mv.run_id}' and tags.finalist = '{finalist}'",
            max_results=1000))
    if not runs and prov.trial_run_id:
        runs = [client.get_run(prov.trial_run_id)]
        notes.append(f"no re-runs of {finalist!r}: figures from the search trial {prov.trial_run_id} (one run, the "
                     "search level only)")
    rows: list[dict[str, Any]] = []
    for run in runs:
        try:
            path = client.download_artifacts(run.info.run_id, "requests.parquet")
        except Exception:  # noqa: BLE001 - a run without its table is skipped and said
            notes.append(f"run {run.info.run_id} has no requests.parquet")
            continue
        rows.extend(pq.read_table(Path(path)).to_pylist())
    return serving, rows, [r.info.run_id for r in runs], notes
