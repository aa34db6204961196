"""MLflow I/O only: one experiment per study, a parent run for the study, one child run per trial.

Uses `MlflowClient` with explicit run ids (no global "active run"), so the driver and the trial processes can log
without stepping on each other. Names are chosen to sort and read well in the MLflow UI's table and compare view:
params `spec.*` / `trial.*`, metrics from `Summary.to_metrics()` (`tput_tok_s`, `accept_len`, `ttft_p50_ms`, ...),
tags `outcome` and `reason`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.records.gaps import keeping
from pipeline.vocabulary.outcome import Outcome

STUDY_TAG = "specdec.study"
KIND_TAG = "specdec.kind"  # "study" | "trial" | "finalist"
REPLACED_TAG = "run_replaced"  # a finalist run a fresh run replaced (its config's runs disagreed): why; not counted
# A trial run is named by its config label (`pipeline.records.labels.config_label`), which two trials of one config
# share; the Tune trial id (also its folder under trials/) is this tag.
TRIAL_ID_TAG = "trial_id"
# a trial's speed-up as the search measured it (one run against the search's baseline run), and as the decision
# read it (the finalist stage's paired ratio at the search level; finalists only); `vs_baseline` shows the latter
# where it exists
VS_BASELINE_SEARCH, VS_BASELINE_DECIDED = "vs_baseline_search", "vs_baseline_decided"
# The run's description in the MLflow UI (Markdown): the study run carries the headline of its decision.
DESCRIPTION_TAG = "mlflow.note.content"
# The experiment's kind, for the MLflow versions whose UI reads it. 3.17's UI ignores it (its navigation flag is on in
# the OSS build): an experiment opens under the browser's GenAI / "Model training" switch, taken from the URL parameter
# `workflowType`, else the browser's remembered choice, else GenAI; so a bare experiment URL lands on the GenAI
# overview whatever this tag says.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# Hence the printed link names the workflow itself: with `workflowType=machine_learning` the runs table opens under
# "Model training" in any browser, new or not.
WORKFLOW_PARAM = "workflowType=machine_learning"
# The UI's saved/shared views: a link with `?viewStateShareKey=<key>` loads the view stored in the experiment tag
# `mlflow.sharedViewState.<key>` (search filter, sort, visible columns, no clicking). Stored as the UI's own
# saved-view envelope ({name, createdAt, updatedAt, state}) so the view is also listed by name under "Views".
VIEW_KEY = "specdec-trials"
VIEW_NAME = "Trials: throughput vs baseline"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
# every predicted point of a simulate-first study (`pipeline.search.simulate_first`), on the study run; the report reads it
SPACE_PREDICTIONS = "simulate/space_predictions.jsonl"
COMPARE_METRICS = ("tput_tok_s", "vs_baseline", "accept_len", "ttft_p50_ms")


def trials_view(metrics: tuple[str, ...] = COMPARE_METRICS) -> dict[str, Any]:
    """The runs table as a user comparing trials needs it: trial runs only (unnested from the study run, so none
    is folded away), fastest first, with the comparison columns, the outcome and the algorithm in view."""
    return {"searchFilter": f"tags.`{KIND_TAG}` = 'trial'", "orderByKey": f"metrics.`{metrics[0]}`",
            "orderByAsc": False,
            "selectedColumns": [f"metrics.`{m}`" for m in metrics] + ["tags.`outcome`", "params.`spec.algorithm`"]}


def trials_view_tag(now_ms: int) -> str:
    """The experiment tag value holding `trials_view()`, in the UI's saved-view envelope (state is a JSON string)."""
    return json.dumps({"name": VIEW_NAME, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(trials_view())})


def runs_link(ui_url: str, experiment_id: str) -> str:
    """The direct link to the experiment's runs table, under "Model training", with the trials view applied."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs?{WORKFLOW_PARAM}&viewStateShareKey={VIEW_KEY}"


def default_tracking_uri(output_dir: Path) -> str:
    return f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"


def flatten_trial(config: dict[str, Any]) -> dict[str, str]:
    """TrialConfig dict -> MLflow params: spec fields as `spec.<name>`, the rest as `trial.<name>`."""
    params = {f"spec.{k}": v for k, v in config.get("spec", {}).items()}
    params.update({f"trial.{k}": v for k, v in config.items() if k != "spec"})
    return {k: str(v) for k, v in params.items() if v is not None}


_WARM_UP: threading.Thread | None = None  # this process's MLflow warm-up (`Tracker.warm_up_in_background`)


def _wait_for_warm_up() -> None:
    if _WARM_UP is not None and _WARM_UP is not threading.current_thread():
        _WARM_UP.join()


class Tracker:
    """Thin wrapper over MlflowClient for one study. Picklable: it holds only strings."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_dir: Path | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_dir = str(artifact_dir.resolve()) if artifact_dir else None
        self._experiment_id: str | None = None

    def client(self) -> Any:
        _wait_for_warm_up()
        # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def experiment_id(self) -> str:
        if self._experiment_id is None:
            client = self.client()
            found = client.get_experiment_by_name(self.experiment)
            if found is not None:
                self._experiment_id = found.experiment_id
            else:
                # With a SQLite store, artifacts would land in ./mlruns of whatever cwd; keep them with the study.
                location = Path(self.artifact_dir).as_uri() if self.artifact_dir else None
                self._experiment_id = client.create_experiment(self.experiment, artifact_location=location)
            # Also on an existing experiment: a study resumed from an older store gets the tags (and the view) too.
            client.set_experiment_tag(self._experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            client.set_experiment_tag(self._experiment_id, VIEW_TAG_PREFIX + VIEW_KEY,
                                      trials_view_tag(int(time.time() * 1000)))
        return self._experiment_id

    def warm_up(self) -> None:
        """Import MLflow and open the store now (a fresh process spends ~1.5 s on it); errors are left for the real
        call to raise."""
        try:
            self.experiment_id()
        except Exception:  # noqa: BLE001 - a warm-up only; the trial's own MLflow call reports the problem
            pass

    def warm_up_in_background(self) -> None:
        """`warm_up` on a thread, in a process that has not imported MLflow yet (else nothing to gain). Every MLflow
        use of this module waits for it first: two threads importing MLflow at once break its protobuf registry
        ("Depends on file 'databricks.proto', but it has not been loaded")."""
        global _WARM_UP
        if "mlflow" in sys.modules or _WARM_UP is not None:
            return
        _WARM_UP = threading.Thread(target=self.warm_up, name="mlflow-warm-up", daemon=True)
        _WARM_UP.start()

    def log_vs_baseline(self, ratios: dict[str, float], decided: dict[str, float] | None = None) -> None:
        """The speed-up on each trial run, so the runs table shows the one figure the other views show:
        `vs_baseline` = the decision's (`decided`: the finalist stage's paired ratio, for the finalists) where there
        is one, else the search's; `VS_BASELINE_SEARCH` = the search's (`ratios`: throughput / the search baseline's)
        beside it; `VS_BASELINE_DECIDED` = the decision's alone (read back by `trial_runs.rows_from_runs`).
        A write the store refuses is kept as missing (`pipeline.records.gaps`)."""
        client = self.client()
        decided = decided or {}
        with keeping(f"the trial runs' metrics vs_baseline, {VS_BASELINE_SEARCH}"
                     + (f", {VS_BASELINE_DECIDED}" if decided else "")):
            for run_id, ratio in ratios.items():
                client.log_metric(run_id, VS_BASELINE_SEARCH, ratio)
                client.log_metric(run_id, "vs_baseline", decided.get(run_id, ratio))
            for run_id, ratio in decided.items():
                client.log_metric(run_id, VS_BASELINE_DECIDED, ratio)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_experiment_id": None}

    # --- study (parent) run ------------------------------------------------------------------------------------

    def start_study(self, study_name: str, resolved_yaml: str, resume: bool) -> str:
        """The parent run: reused when resuming (same study name, still open or not), else a new one."""
        client = self.client()
        exp = self.experiment_id()
        if resume:
            runs = client.search_runs([exp], filter_string=f"tags.`{KIND_TAG}` = 'study' and "
                                                           f"tags.`{STUDY_TAG}` = '{study_name}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
            if runs:
                client.update_run(runs[0].info.run_id, status="RUNNING")
                return runs[0].info.run_id
        run = client.create_run(exp, run_name=f"study-{study_name}", tags={KIND_TAG: "study", STUDY_TAG: study_name})
        client.log_text(run.info.run_id, resolved_yaml, "study/resolved_study.yaml")
        return run.info.run_id

    def finish_study(self, run_id: str, *, tags: dict[str, str], metrics: dict[str, float],
                     texts: dict[str, str], status: str = "FINISHED", description: str | None = None) -> None:
        """The study run's decision: tags, metrics, text artifacts, and `description` (Markdown: the headline) as
        the run's description in the MLflow UI. Each part is tried on its own: one the store refuses (a full disk)
        is kept as missing (`pipeline.records.gaps`), and the others, the run's end status included, still land."""
        client = self.client()
        if description is not None:
            tags = {**tags, DESCRIPTION_TAG: description[:5000]}
        with keeping(f"the study run's tags ({', '.join(sorted(tags))})"):
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
        if metrics:
            with keeping(f"the study run's metrics ({', '.join(sorted(metrics))})"):
                for name, number in metrics.items():
                    client.log_metric(run_id, name, number)
        for path, text in texts.items():
            with keeping(f"the study run's artifact {path}"):
                client.log_text(run_id, text, path)
        with keeping(f"the study run's end status ({status})"):
            client.set_terminated(run_id, status=status)

    def log_study_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client().log_artifact(run_id, str(path), artifact_path)

    # --- trial (child) runs ------------------------------------------------------------------------------------

    def log_trial(self, parent_id: str, *, study_name: str, run_name: str, kind: str, config: dict[str, Any],
                  outcome: Outcome, reason: str, metrics: dict[str, float], requests: pa.Table | None,
                  texts: dict[str, str], extra_tags: dict[str, str] | None = None,
                  started_at: float | None = None, trial_id: str | None = None) -> str:
        """One child run with everything about a trial; returns its run id. `started_at` (a time.time()) makes the
        run's duration in the MLflow UI the trial's, not just the logging's. `trial_id`: what identifies the record
        when `run_name` does not (a trial's run name is its config label; TRIAL_ID_TAG); None = the run name does."""
        client = self.client()  # first: it waits for a warm-up still importing MLflow
        # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
        from mlflow.entities import Metric, Param

        # A trial interrupted after logging and then resumed logs again: keep only the newest record of it. The old
        # records are looked up now but deleted only once the new one is complete, so a crash in between leaves two
        # records of the trial, never none. A record from before trial ids were tagged is named `trial-<id>`.
        where = f"tags.mlflow.parentRunId = '{parent_id}'"
        keys = ([f"tags.`{TRIAL_ID_TAG}` = '{trial_id}'", f"attributes.run_name = 'trial-{trial_id}'"] if trial_id
                else [f"attributes.run_name = '{run_name}'"])
        older = sorted({old.info.run_id for key in keys for old in client.search_runs(
            [self.experiment_id()], filter_string=f"{where} and {key}")})
        if trial_id:
            # A sampler may propose one config twice: the second trial's run must not read like the first in the
            # runs table or the compare view, so it takes the suffix the study's tables give it (unique_names).
            namesakes = client.search_runs([self.experiment_id()],
                                           filter_string=f"{where} and attributes.run_name = '{run_name}'")
            if any(r.info.run_id not in older for r in namesakes):
                run_name = f"{run_name} #{trial_id}"
        tags = {"mlflow.parentRunId": parent_id, KIND_TAG: kind, STUDY_TAG: study_name, "outcome": outcome.value,
                "reason": reason[:4000], **({TRIAL_ID_TAG: trial_id} if trial_id else {}), **(extra_tags or {})}
        start_ms = int(started_at * 1000) if started_at is not None else None
        run = client.create_run(self.experiment_id(), run_name=run_name, tags=tags, start_time=start_ms)
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if v is not None],
            params=[Param(k, v[:6000]) for k, v in flatten_trial(config).items()],
        )
        # One upload of a folder instead of one call per file (each call costs ~0.2 s on SQLite + local artifacts).
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "trial_config.json").write_text(json.dumps(config, indent=2))
            for path, text in texts.items():
                (folder / path).parent.mkdir(parents=True, exist_ok=True)
                (folder / path).write_text(text)
            if requests is not None:
                pq.write_table(requests, folder / "requests.parquet")
            client.log_artifacts(run_id, str(folder))
        client.set_terminated(run_id, status=outcome.run_status)
        for old_id in older:
            client.delete_run(old_id)
        return run_id

    def trial_runs(self, parent_id: str) -> list[Any]:
        return self.client().search_runs([self.experiment_id()], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                         max_results=5000)

    # --- reading back, adding to a run ------------------------------------------------------------------------------

    def experiment_exists(self) -> bool:
        """Whether the store holds the study's experiment (`experiment_id()` would create it)."""
        return self.client().get_experiment_by_name(self.experiment) is not None

    def all_runs(self) -> list[Any]:
        """Every run of the study's experiment: study, trial and finalist runs."""
        return self.client().search_runs([self.experiment_id()], max_results=5000)

    def artifact_text(self, run_id: str, path: str) -> str | None:
        """A run's text artifact, None when the run has none."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = self.client().download_artifacts(run_id, path, tmp)
            except Exception:  # noqa: BLE001 - MLflow raises several types for "no such artifact"
                return None
            return Path(local).read_text()

    def requests_table(self, run_id: str) -> pa.Table:
        """A run's `requests.parquet`; raises what MLflow raises when it has none."""
        with tempfile.TemporaryDirectory() as tmp:
            return pq.read_table(self.client().download_artifacts(run_id, "requests.parquet", tmp))

    def log_figures(self, run_id: str, metrics: dict[str, float] | None = None, texts: dict[str, str] | None = None,
                    tags: dict[str, str] | None = None) -> None:
        """Add metrics (step 0), text artifacts and tags to a run (the study run's bookkeeping, a launch's
        prediction)."""
        client = self.client()
        # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if metrics:
            client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
        for key, value in (tags or {}).items():
            client.set_tag(run_id, key, value)
        for path, text in (texts or {}).items():
            client.log_text(run_id, text, path)

