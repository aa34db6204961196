"""A whole study: Ray + Serve up, Optuna study (baseline first) driven by Ray Tune, trials, table, promotion.

Called by `pipeline.tune` (the composition root) with a resolved `StudyConfig` and `SearchSpace`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from pipeline.config import StudyConfig, study_to_yaml
from pipeline.errors import PipelineError
from pipeline.load import LoadRequest
from pipeline.record import Tracker, default_tracking_uri
from pipeline.space import SearchSpace, define_by_run, enqueue_baseline, resolve, tpe_sampler
from pipeline.trial import Outcome, TrialContext, run_trial, teardown
from pipeline.workloads import load_workload

TUNE_DIR = "tune"
SENTINEL = {"max": 0.0, "min": 1e12}  # what a failed trial reports: the worst value, so TPE steers away from it


def _trainable(config: dict[str, Any], ctx: TrialContext, space: SearchSpace) -> None:
    from ray import tune

    label = tune.get_context().get_trial_id()
    result = run_trial(ctx, label, resolve(space, config, ctx.study))
    report: dict[str, Any] = {"outcome": result.outcome.value, "mlflow_run_id": result.run_id or ""}
    for metric, mode in zip(ctx.study.objective.metrics, ctx.study.objective.modes):
        value = result.objective(metric) if result.outcome is Outcome.COMPLETE else None
        report[metric] = float(value) if value is not None else SENTINEL[mode]
    if result.summary is not None:
        report["accept_len"] = result.summary.accept_len or 1.0
    tune.report(report)  # once, after the measurement: a report-then-crash would reach Optuna as COMPLETE


def _progress_callback(total: int, metric: str) -> Any:
    from ray import tune

    class Progress(tune.Callback):
        """Live view: trial n/N, its outcome and objective, the best so far vs the baseline."""

        def __init__(self) -> None:
            self.done = 0
            self.best: float | None = None
            self.baseline: float | None = None

        def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: ANN001
            self.done += 1
            algorithm = trial.config.get("algorithm", "?")
            value = result.get(metric)
            if result.get("outcome") == "COMPLETE":
                if algorithm == "none" and self.baseline is None:
                    self.baseline = value
                elif self.best is None or value > self.best:
                    self.best = value
            vs = f"{self.best / self.baseline:.2f}x baseline" if self.best and self.baseline else "-"
            params = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in trial.config.items() if k != "algorithm")
            print(f"[trial {self.done}/{total}] {algorithm:<10} {result.get('outcome'):<14} {metric}={value:.2f}  "
                  f"best={self.best or 0:.2f} ({vs})  {params}", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):  # noqa: ANN001
            teardown(f"trial-{trial.trial_id}")  # belt and braces: the trial's own finally may not have run

        def on_trial_error(self, iteration, trials, trial, **info):  # noqa: ANN001
            teardown(f"trial-{trial.trial_id}")

    return Progress()


_SERVE_URLS: dict[str, str] = {}  # Serve started by this process, per Ray session: reuse it, never restart it


def connect_ray(address: str | None = None) -> str:
    """Start or join Ray, start Serve on a free local port; returns the Serve HTTP base URL."""
    import ray
    from ray import serve

    from serve.replica import free_port

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    session = ray.get_runtime_context().get_job_id()
    if session not in _SERVE_URLS:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        # On a long-lived cluster Serve may already run with another port ("new http_options will not be
        # applied"): ask the controller which port it serves on (a private helper of Ray 2.60, which we pin).
        from ray.serve.context import _get_global_client

        options = _get_global_client().http_config
        host = "127.0.0.1" if options.host in ("0.0.0.0", "::", None) else options.host
        _SERVE_URLS[session] = f"http://{host}:{options.port}"
    for name in list(serve.status().applications):
        if name.startswith("trial-"):  # left behind by a killed driver on a long-lived cluster
            serve.delete(name)
    return _SERVE_URLS[session]


def _resume_args() -> list[str]:
    import sys

    return [a for a in sys.argv[1:] if a != "--resume"]


def settle_previous_trials(ot_study: Any) -> int:
    """Trials left RUNNING by a driver that died are failed (their Serve apps died with it or are cleaned up);
    returns how many trials of the study are finished."""
    from optuna.trial import TrialState

    finished = 0
    for trial in ot_study.get_trials(deepcopy=False):
        if trial.state == TrialState.RUNNING:
            ot_study.tell(trial.number, state=TrialState.FAIL)
        elif trial.state.is_finished():
            finished += 1
    return finished


def _gpu_groups(tp_size: int) -> int:
    """Concurrent SGLang trials = GPU groups in the cluster; more would leave replicas pending until they time out."""
    import ray

    return max(1, int(ray.cluster_resources().get("GPU", 0) // tp_size))


def build_context(study: StudyConfig, out: Path, serve_url: str, tracker: Tracker, parent: str) -> TrialContext:
    workload = load_workload(study.workload.source, seed=study.seed, n_warmup=study.workload.warmup_prompts,
                             n_measure=study.workload.measure_prompts, max_new_tokens=study.workload.max_new_tokens)

    def items(prompts: Any) -> tuple[LoadRequest, ...]:
        return tuple(LoadRequest(p.index, p.text, p.max_new_tokens) for p in prompts)

    return TrialContext(study=study, output_dir=str(out), serve_url=serve_url, tracker=tracker,
                        parent_run_id=parent, warmup=items(workload.warmup), measure=items(workload.measure))


def run_study(study: StudyConfig, space: SearchSpace, resume: bool = False) -> int:
    """Run the study end to end; returns the process exit code."""
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from pipeline.finalize import finalize_study

    started = time.monotonic()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a progress bar per downloaded config
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # one "Deleting app" line per trial otherwise
    out = study.output_path().resolve()
    tune_path = out / TUNE_DIR
    if (out / "study.yaml").exists() and not resume:
        raise PipelineError(f"{out} already holds a study; pass --resume to continue it, or choose another "
                            f"--name/--output")
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(study_to_yaml(study))
    print(f"study '{study.name}': {study.budget.max_trials} trials, engine {study.engine.kind}, "
          f"model {study.model.target}, space {space.name or study.search_space}, output {out}", flush=True)

    tracker = Tracker(study.tracking.uri or default_tracking_uri(out), study.tracking.experiment or study.name,
                      artifact_dir=out / "mlartifacts")
    parent = tracker.start_study(study.name, study_to_yaml(study), resume=resume)
    serve_url = connect_ray(study.ray.address)
    ctx = build_context(study, out, serve_url, tracker, parent)

    storage = optuna.storages.RDBStorage(study.storage.url or f"sqlite:///{out / 'optuna.db'}")
    directions = ["maximize" if m == "max" else "minimize" for m in study.objective.modes]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ot_study = optuna.create_study(study_name=study.name, storage=storage, directions=directions, load_if_exists=True)
    restoring = resume and tune.Tuner.can_restore(str(tune_path))
    finished = 0 if restoring else settle_previous_trials(ot_study)
    enqueue_baseline(ot_study, space)  # no-op when the study already has a live or completed baseline
    sampler = tpe_sampler(study.seed, study.budget.max_trials)
    single = len(study.objective.metrics) == 1
    searcher = OptunaSearch(define_by_run(space), metric=study.objective.metrics[0] if single else
                            study.objective.metrics, mode=study.objective.modes[0] if single else study.objective.modes,
                            sampler=sampler, storage=storage, study_name=study.name, seed=study.seed)
    trainable = tune.with_resources(tune.with_parameters(_trainable, ctx=ctx, space=space), {"cpu": 0.25})
    # Concurrent trials = engine replicas that fit: one on a CPU box (the engine uses every core).
    concurrency = 1 if study.engine.kind == "cpu" else _gpu_groups(study.engine.tp_size)
    run_config = tune.RunConfig(name=TUNE_DIR, storage_path=str(out), verbose=0,
                                callbacks=[_progress_callback(study.budget.max_trials, study.objective.metrics[0])])
    if restoring:
        # Same driver folder: Tune restores its own state and resumes unfinished trials as the same Optuna trials.
        tune.Tuner.restore(str(tune_path), trainable, resume_unfinished=True, resume_errored=True).fit()
    else:
        # New driver (or new folder) on an existing Optuna study: the budget counts the trials already finished.
        remaining = study.budget.max_trials - finished
        if remaining > 0:
            tune.Tuner(trainable, run_config=run_config, tune_config=tune.TuneConfig(
                search_alg=searcher, num_samples=remaining, max_concurrent_trials=concurrency,
                time_budget_s=study.budget.time_budget_s,
                reuse_actors=True)).fit()  # Ray 2.60 defaults to False: a new worker (~3-4 s) per trial
        else:
            print(f"the study already has {study.budget.max_trials} finished trials: finalizing only", flush=True)
    from optuna.trial import TrialState

    unfinished = [t.number for t in ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if unfinished:  # Tune returns normally after Ctrl-C; the interrupted trials are still RUNNING in Optuna
        print(f"\ninterrupted with trial(s) {unfinished} unfinished; the state is saved. Continue with: "
              f"python -m pipeline.tune {' '.join(_resume_args())} --resume", flush=True)
        return 130
    code = finalize_study(ctx, ot_study)
    print(f"study finished in {time.monotonic() - started:.0f} s", flush=True)
    return code
