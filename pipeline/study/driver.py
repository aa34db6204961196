"""A whole study: Ray + Serve up, Optuna study (baseline first) driven by Ray Tune, trials, table, promotion.

Called by `pipeline.tune` (the composition root) with a resolved `StudyConfig` and `SearchSpace`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Literal

from pipeline.atomic import write_text_atomic
from pipeline.config import StudyConfig, TrialConfig, study_to_yaml
from pipeline.console_log import detail, say, warn
from pipeline.errors import PipelineError
from pipeline.measure.load import LoadRequest, requests_of
from pipeline.trial.pruning import intermediate_report
from pipeline.records.console import progress_callback
from pipeline.records.gaps import GAPS, conclude
from pipeline.records.labels import config_label, params_label
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.redact import mask_url
from pipeline.study.interrupts import watching_interrupts
from pipeline.study.backend import decide_backend, local_node_facts, ray_node_facts
from pipeline.study.resume import (
    IDENTITY_ATTR, budget_note, check_resume, finished_trials, read_identity, settle_running, study_identity,
    recorded_reports, saved_tune_trials, tune_unfinished, workload_digest, write_identity,
)
from pipeline.decide.sla import constraint_user_attrs
from pipeline.search.space import SearchSpace, define_by_run, enqueue_baseline, resolve, tpe_sampler
from pipeline.search.space.sampler import constrained_search_class
from pipeline.search.strategy import enqueue_grid, resolve_strategy
from pipeline.trial.replicas import delete_study_apps, start_standby, study_apps
from pipeline.measure.window import flag
from pipeline.search.simulate_first import SimulateFirstPlan
from pipeline.search.simulate_searcher import simulate_first_search_class
from pipeline.study.finalize import finalize_study
from pipeline.trial.lifecycle import run_trial
from pipeline.trial.launches import record_launches
from pipeline.trial.replica_config import replica_config
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.report import TrialReport
from pipeline.workloads import load_workload
from serve.engines import engine_for, retokenizes
from serve.engines.load_failures import cause_in_reason
from serve.ports import free_port

TUNE_DIR = "tune"
SENTINEL = {"max": 0.0, "min": 1e12}  # what a failed trial reports: the worst value, so TPE steers away from it


def _trainable(config: dict[str, Any], ctx: TrialContext, space: SearchSpace,
               recorded: dict[str, dict[str, Any]] | None = None) -> None:
    ctx.tracker.warm_up_in_background()  # a fresh Tune worker: MLflow loads while the trial waits for its replica
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray import tune

    label = tune.get_context().get_trial_id()
    if recorded and label in recorded:  # a restore runs this trial again, but Tune holds its final report already:
        tune.report(recorded[label])  # report it again (Optuna is told as usual); measuring again would count it twice
        return
    objective = ctx.study.objective

    def progress(records: Any, stop: Any) -> None:  # after each measured chunk (early stopping on)
        tune.report(intermediate_report(records, stop, objective.metrics, objective.modes, SENTINEL, ctx.study.seed))

    result = run_trial(ctx, label, resolve(space, config, ctx.study), progress)
    metrics = {}
    for metric, mode in zip(ctx.study.objective.metrics, ctx.study.objective.modes):
        # PRUNED reports its partial figure: Optuna keeps it as the pruned trial's value (pipeline/search/searcher.py)
        value = result.objective(metric) if result.outcome.reports_measurement else None
        metrics[metric] = float(value) if value is not None else SENTINEL[mode]
    s = result.summary
    noise = None
    if s is not None and s.tput_ci_low is not None and s.tput_ci_high is not None and s.tput_tok_s > 0:
        # the figure's own noise: half its bootstrap CI, relative (simulate-first judges predictions against it)
        noise = (s.tput_ci_high - s.tput_ci_low) / 2 / s.tput_tok_s
    # SLA figures at the search level, copied into the Optuna trial's user attributes by the searcher
    # (`constrained_search_class`) for the sampler's constraints_func; an unmeasured one is left out (= broken).
    figures = s.to_metrics() if s is not None and result.outcome is Outcome.COMPLETE else {}
    sla = {k: v for k, v in constraint_user_attrs(ctx.study.objective.constraints, ctx.study.search_concurrency,
                                                  figures).items() if v is not None}
    windows = result.windows  # the measurement's own noise and whether other work disturbed it (measure/window.py)
    report = TrialReport(
        said=result.outcome.value, run_id=result.run_id or "",
        # for the driver's progress line (pipeline.records.console)
        label=config_label(result.config) if result.config else params_label(config), reason=result.reason[:300],
        # a load failure a retry would repeat: the searcher does not queue a baseline again for it
        load_failure=cause_in_reason(result.reason), metrics=metrics,
        accept_len=(s.accept_len or 1.0) if s is not None else None, tput_noise=noise,
        measurement_flag=flag(windows) if windows else None, window_remeasured=len(windows) - 1 if windows else 0,
        tput_spread=windows[-1].spread if windows else None, sla=sla)
    # The final report, after the measurement; intermediate ones say MEASURING, and a trial that ends on one is a FAIL
    # in Optuna (pipeline/search/searcher.py), so a report-then-crash never reaches Optuna as COMPLETE.
    tune.report(report.to_tune())


def connect_ray(study_name: str, address: str | None = None) -> str:
    """Start or join Ray, start Serve on a free local port (or find the port it already serves on); delete this
    study's trial apps left behind by a killed driver, and no one else's. Returns the Serve HTTP base URL."""
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    import ray
    from ray import serve

    if not ray.is_initialized():
        # No address = a new local Ray ("local"): never join whatever cluster `ray start` last left in /tmp/ray
        # (ray.init(None) would, even a dead one, or a long-lived one with other studies' apps).
        # WARNING: Ray's INFO lines (a local instance started, where its token was saved, Tune's checkpoint
        # writes) are not the user's business; its warnings still show.
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    # When Serve already runs (a long-lived cluster, a second study in one process) the options above are not
    # applied: ask the controller which port it serves on (a private helper of Ray 2.60, which we pin).
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("Serve did not start: no controller to ask for its HTTP port")
    options = client.http_config
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::", None) else options.host
    for name in study_apps(study_name, serve.status().applications):
        serve.delete(name)
    return f"http://{host}:{options.port}"


def workload_requests(study: StudyConfig, prompt_ids: bool = False
                      ) -> tuple[tuple[LoadRequest, ...], tuple[LoadRequest, ...]]:
    """The warm-up and measurement requests every trial of the study sends (`prompt_ids`: with text prompts'
    token ids for the records, as simulate-first needs; sent as the prompt to an engine that `retokenizes`)."""
    workload = load_workload(study.workload.source, seed=study.seed, n_warmup=study.workload.warmup_prompts,
                             n_measure=study.workload.measure_prompts, max_new_tokens=study.workload.max_new_tokens)

    def items(prompts: Any) -> tuple[LoadRequest, ...]:
        # chat prompts: rendered with the target's template
        made = requests_of(prompts, study.model.target, prompt_ids=prompt_ids)
        if prompt_ids and retokenizes(study.engine.kind):  # the replay must see the tokens the engine saw
            made = tuple(r if r.input_ids is not None or r.prompt_ids is None
                         else dataclasses.replace(r, input_ids=r.prompt_ids) for r in made)
        return made

    return items(workload.warmup), items(workload.measure)


def build_context(study: StudyConfig, out: Path, serve_url: str, tracker: Tracker, parent: str,
                  simulated: bool = False) -> TrialContext:
    """`simulated` (simulate-first): requests record their prompt ids and the baseline answers the whole warm-up
    split (`TrialContext.reference`)."""
    warmup, measure = workload_requests(study, prompt_ids=simulated)
    reference = tuple({item.index: item for item in warmup}.values()) if simulated else ()
    return TrialContext(study=study, output_dir=str(out), serve_url=serve_url, tracker=tracker,
                        parent_run_id=parent, warmup=warmup, measure=measure, reference=reference)


def _identity(study: StudyConfig, space: SearchSpace) -> dict[str, str]:
    warmup, measure = workload_requests(study)
    prompts = [(r.index, r.text, r.max_new_tokens) for r in (*warmup, *measure)]
    return study_identity(study, space.model_dump(mode="json"), workload_digest(prompts, study.workload.temperature))


def _interrupted(ot_study: Any, resume_command: str | None) -> int:
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    from optuna.trial import TrialState

    unfinished = [t.number for t in ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    command = resume_command or "python -m pipeline.tune <the same arguments> --resume"
    where = f"with trial(s) {unfinished} unfinished" if unfinished else "between trials"
    warn(f"\ninterrupted {where}; the state is saved. Continue with: {command}")
    return 130


def run_study(study: StudyConfig, space: SearchSpace, resume: bool = False,
              resume_command: str | None = None) -> int:
    """Run the study end to end; returns the process exit code (130 when interrupted, state saved; 3 when it decided
    but a record could not be written, `pipeline.records.gaps`).

    `resume_command` is what to print for continuing an interrupted study (the CLI passes its own command line).
    A library call: it reads no process state (sys.argv) and leaves environment and logging to the caller.
    Resume rules (pipeline/study/resume.py): a changed study is refused; a changed budget is honoured; trials left
    RUNNING in Optuna by a dead driver, or asked by Optuna but never checkpointed by Tune, are failed, so a resume
    never waits on them forever.
    """
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna
    from ray import tune

    started = time.monotonic()
    GAPS.clear()  # records missing from an earlier study in this process are not this one's
    out = study.output_path().resolve()
    tune_path = out / TUNE_DIR
    if (out / "study.yaml").exists() and not resume:
        raise PipelineError(f"{out} already holds a study; pass --resume to continue it, or choose another "
                            f"--name/--output")
    identity = _identity(study, space)
    recorded = read_identity(out) if resume else None
    check_resume(recorded, identity, out)  # before anything is started or written
    # One attention backend for every engine of the study, for the GPU they run on (pipeline/study/backend.py): what
    # this machine can decide (and refuse) now, the rest from a GPU node once Ray is up.
    decided = decide_backend(study, space)
    study = decided.study
    out.mkdir(parents=True, exist_ok=True)  # SQLite (the default storage) cannot create its file in a missing folder
    storage = optuna.storages.RDBStorage(study.storage.url or f"sqlite:///{out / 'optuna.db'}")
    directions: list[Literal["maximize", "minimize"]] = [
        "maximize" if m == "max" else "minimize" for m in study.objective.modes]
    ot_study = optuna.create_study(study_name=study.name, storage=storage, directions=directions, load_if_exists=True)
    # A new driver folder on a shared database has no identity.json: the Optuna study carries the same record.
    recorded = recorded or ot_study.user_attrs.get(IDENTITY_ATTR)
    check_resume(recorded, identity, f"the Optuna study '{study.name}' in {mask_url(storage.url)}")
    write_text_atomic(out / "study.yaml", study_to_yaml(study))
    write_identity(out, identity, study.budget.max_trials)
    ot_study.set_user_attr(IDENTITY_ATTR, {"identity": identity, "max_trials": study.budget.max_trials})
    say(f"study '{study.name}': {study.budget.max_trials} trials, engine {study.engine.kind}, "
        f"model {study.model.target}, space {space.name or study.search_space}, output {out}")
    note = budget_note(recorded, study.budget.max_trials)
    if note:
        say(note)
    strategy = resolve_strategy(study, space)
    say(f"search: {strategy.name} -- {strategy.reason}")

    tracker = Tracker(study.tracking.uri or default_tracking_uri(out), study.tracking.experiment or study.name,
                      artifact_dir=out / "mlartifacts")
    parent = tracker.start_study(study.name, study_to_yaml(study), resume=resume)
    serve_url = connect_ray(study.name, study.ray.address)
    if decided.line and study.engine.attention_backend is None:  # undecided here: a GPU node of the cluster says
        # (still unknown: every engine renders the backend that is safe on any GPU, the same for all of them; a node
        # without a driver, or a cluster without GPUs, is named by its trials' own checks)
        decided = decide_backend(study, space, (local_node_facts, ray_node_facts))
        study = decided.study
        write_text_atomic(out / "study.yaml", study_to_yaml(study))
    if decided.line:
        say(decided.line[2:])
    try:
        ctx = build_context(study, out, serve_url, tracker, parent, simulated=strategy.simulated)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        if not strategy.simulated:
            raise
        # simulate-first records the prompts' token ids, which needs the target's tokenizer on this machine
        strategy = strategy.fall_back(f"the prompts' token ids cannot be computed here ({type(exc).__name__}: "
                                      f"{str(exc)[:200]})")
        say(f"search: {strategy.name} -- {strategy.reason}")
        ctx = build_context(study, out, serve_url, tracker, parent)

    # Tune's own checkpoint holds the budget it was started with: restore it only when that is still the budget.
    restoring = resume and note is None and tune.Tuner.can_restore(str(tune_path))
    if not restoring:
        settled = settle_running(ot_study)  # no trial of this study runs now: RUNNING ones belong to a dead driver
        if settled:
            say(f"trial(s) {settled} were left running by a previous driver: recorded as failed")
    enqueue_baseline(ot_study, space)  # no-op when the study already has a live or completed baseline
    if strategy.name == "grid":
        enqueue_grid(ot_study, space, study.budget.max_trials)
    # SLA limits at the search level steer the sampler (Optuna's constraints_func); the others are checked when the
    # finalists are re-measured at every level (pipeline/study/finalists.py).
    sampler = tpe_sampler(study.seed, study.budget.max_trials, constraints=study.objective.constraints,
                          search_level=study.search_concurrency)
    single = len(study.objective.metrics) == 1
    modes: list[str] = list(study.objective.modes)
    search_class, plan = constrained_search_class(), {}
    if strategy.simulated:  # the launches after the baseline come from the simulator (pipeline/search/simulate_first.py)

        search_class, plan = simulate_first_search_class(), {"plan": SimulateFirstPlan(ctx, space)}
    searcher = search_class(define_by_run(space), metric=study.objective.metrics[0] if single else
                            study.objective.metrics, mode=modes[0] if single else modes,
                            sampler=sampler, storage=storage, study_name=study.name, seed=study.seed, **plan)
    # The trial process only drives HTTP and logs: a quarter CPU (Ray's resource name), the replica holds the engine.
    trainable = tune.with_resources(tune.with_parameters(_trainable, ctx=ctx, space=space),
                                    tune.PlacementGroupFactory([{"CPU": 0.25}]))
    # Concurrent trials = engine replicas that fit the cluster (one per node for the CPU engine, GPU groups for SGLang).
    import ray

    concurrency = engine_for(study.engine.kind).concurrent_replicas(
        replica_config(study, TrialConfig(), out), ray.cluster_resources())
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    # Tune's result files named explicitly: `python -m pipeline.tune` turns Tune's automatic loggers off, whose
    # TensorBoard logger only adds a "run tensorboard" hint for files nobody needs (MLflow is the record).
    progress = progress_callback(study.budget.max_trials, study.objective.metrics[0], study.objective.modes[0],
                                 out / "trials")
    run_config = tune.RunConfig(name=TUNE_DIR, storage_path=str(out), verbose=0,
                                callbacks=[progress, CSVLoggerCallback(), JsonLoggerCallback()])
    if restoring:
        # Same driver folder: Tune restores its own state and resumes unfinished trials as the same Optuna trials.
        # A trial interrupted after it reported (before Optuna was told) is not measured again: it reports what
        # Tune's checkpoint holds, so Optuna gets its result once and the baseline is neither lost nor run twice.
        recorded = recorded_reports(saved_tune_trials(tune_path))
        restored = tune.with_resources(tune.with_parameters(_trainable, ctx=ctx, space=space, recorded=recorded),
                                       tune.PlacementGroupFactory([{"CPU": 0.25}]))  # as `trainable`
        try:
            start_standby(study.name, replica_config(study, TrialConfig(), out / "trials"))
            with watching_interrupts() as interrupted:
                tune.Tuner.restore(str(tune_path), restored, resume_unfinished=True, resume_errored=True).fit()
        finally:
            delete_study_apps(study.name)  # as after the search below
        # Tune returns normally after Ctrl-C: the returned grid shows nothing unfinished (its checkpoint does, unless
        # the Ctrl-C fell between two trials), so the Ctrl-C itself is what says the user stopped the study
        if interrupted.is_set() or tune_unfinished(saved_tune_trials(tune_path)):
            return _interrupted(ot_study, resume_command)
        # Trials Optuna handed out after Tune's last checkpoint: no one will ever report them.
        orphans = settle_running(ot_study)
        if orphans:
            say(f"trial(s) {orphans} were never checkpointed by Tune: recorded as failed")
    # The budget counts every finished trial, whichever driver ran it.
    remaining = study.budget.max_trials - finished_trials(ot_study)
    if remaining > 0:
        try:
            # the first trial's replica deploys while Tune starts its worker (pipeline/trial/replicas.py)
            start_standby(study.name, replica_config(study, TrialConfig(), out / "trials"))
            with watching_interrupts() as interrupted:
                tune.Tuner(trainable, run_config=run_config, tune_config=tune.TuneConfig(
                    search_alg=searcher, num_samples=remaining, max_concurrent_trials=concurrency,
                    time_budget_s=study.budget.time_budget_s,
                    reuse_actors=True)).fit()  # Ray 2.60 defaults to False: a new worker (~3-4 s) per trial
        finally:  # the workers' live apps (and their engines): gone before the finalists or an interrupted exit
            delete_study_apps(study.name)
        if interrupted.is_set() or tune_unfinished(saved_tune_trials(tune_path)):  # as above
            return _interrupted(ot_study, resume_command)
    elif not restoring:
        say(f"the study already has {study.budget.max_trials} finished trials: finalizing only")
    settle_running(ot_study)  # Tune finished every trial it knows: a RUNNING one was stopped before reporting
    try:
        code = finalize_study(dataclasses.replace(ctx, reference=()), ot_study)  # finalists answer no reference
        record_launches(ctx)  # every trial's and finalist run's engine_launches, summed on the study run
    finally:  # this process's live app from the finalist re-runs
        delete_study_apps(study.name)
    detail(f"study finished in {time.monotonic() - started:.0f} s")  # after the headline: the log file only
    return conclude(code, out, ctx.tracker, ctx.parent_run_id)  # a record not written: said, and exit 3
