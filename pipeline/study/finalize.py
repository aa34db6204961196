"""End of a study: the table of trials, finalists re-measured on freshly started engines at every concurrency level, the
per-level promotion decision and action.

Finalists: the best trials by the objective, or the Pareto front when `objective.metrics` has several
(`pipeline.decide.pareto.choose_finalists`); trials that broke an SLA limit at the search level are not finalists. The
decision is pure (`pipeline.decide.levels.decide_levels`: the single-level rule at each level, SLA limits, the serving
policy); this module gathers its inputs by measuring (`pipeline.study.finalists`), then hands the result to the registry
action and writes the deployable winner (`deploy/`, carrying the policy) and `promoted.yaml`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pipeline.compare import format_table, mark_constraints
from pipeline.config import TrialConfig
from pipeline.console_log import detail, headline as say_headline, say
from pipeline.records.corpus_table import corpus_comparison, format_corpus_table
from pipeline.atomic import write_text_atomic
from pipeline.decide.decision import Decision
from pipeline.decide.disturbance import MEASUREMENT_TAG, disturbance, withhold
from pipeline.decide.headline import (Deploy, Headline, decision_sentence, level_table, levels_headline,
                                      search_only_headline)
from pipeline.study.finalists import measure_levels
from pipeline.decide.levels import (BASELINE, LEVELS_ARTIFACT, LevelInput, LevelsDecision, decide_levels,
                                    routing_policy)
from pipeline.decide.pareto import choose_finalists
from pipeline.decide.spread import gap_at_equal_steps
from pipeline.records.console import phase_echo, rerun_name
from pipeline.records.gaps import missing
from pipeline.records.labels import slug
from pipeline.records.tracking import runs_link
from pipeline.redact import mask_url
from pipeline.records.registry import register_config
from pipeline.records.prediction_plot import prediction_plots
from pipeline.records.report import write_report
from pipeline.records.report_data import report_inputs
from pipeline.records.trial_runs import child_rows, trial_config, with_decided
from pipeline.records.provenance import tuned_on
from pipeline.study.resume import workload_digest
from pipeline.study.served import engine_gpus, largest_node_gpus, served_config, serving_room
from pipeline.trial.engine_pass import shipped_replica_config
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.row import TrialRow
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.serving import (COMMAND_FILE, HIGH_COMMAND_FILE, RAYSERVICE_PATCH_FILE, SERVE_CONFIG_FILE, SERVING_FILE,
                           Provenance, RoutingPolicy, ServingConfig, deploy_files, engine_command, serving_config,
                           write_deploy_folder)

DEPLOY_DIR = "deploy"
LEVELS_TEXT = "study/levels.txt"  # the level table as printed, beside LEVELS_ARTIFACT on the parent run
HEADLINE_TEXT = "study/headline.txt"  # the headline as printed (also the parent run's MLflow description)
RULE = "=" * 100


def distinct_configs(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Rows in order, each config once (its first, i.e. fastest, row): a sampler may propose the same point twice,
    and re-measuring one config as two finalists would spend the re-runs on nothing."""
    seen: set[tuple] = set()
    out = []
    for row in rows:
        key = (row.algorithm, tuple(sorted(row.params.items())))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def no_finalist_reason(finalists_setting: int, infeasible: bool) -> str:
    """Why a study ends keeping the baseline without re-measuring anything. `finalists_setting`: the study's
    `promotion.finalists` (0 = search only, so no promotion is possible and the decision must say so rather than
    look like a verdict on the configs); `infeasible`: a completed speculative trial broke an SLA limit. Pure."""
    if finalists_setting == 0:
        return ("keep baseline: promotion.finalists is 0, so nothing was re-measured and nothing can be promoted "
                "(the table holds the search's single measurements; set promotion.finalists >= 1 to decide)")
    return ("keep baseline: no speculative trial completed with outputs equivalent to the baseline's"
            + (" and within the SLA limits" if infeasible else ""))


def finalist_ids(names: list[str]) -> dict[str, str]:
    """{finalist id: its label} for finalist rows named by their labels: the id is the label in the characters a
    Serve app, a folder and a run name take (`pipeline.records.labels.slug`), made unique and never BASELINE. Pure."""
    out: dict[str, str] = {}
    for name in names:
        base = slug(name) or "finalist"
        found, k = base, 2
        while found in out or found == BASELINE:
            found, k = f"{base}-{k}", k + 1
        out[found] = name
    return out


def finalize_study(ctx: TrialContext, ot_study: Any) -> int:
    """Print the trials, re-measure finalists, decide, promote; returns the exit code (0 also for keep-baseline)."""
    study = ctx.study
    rows = mark_constraints(child_rows(ctx.tracker, ctx.parent_run_id), study.objective.constraints,
                            study.search_concurrency)
    corpus_cells = corpus_comparison(rows)  # a study that searched an external corpus: corpus vs none
    if corpus_cells:
        say("\nNGRAM external corpus vs none, at equal draft tokens:\n" + format_corpus_table(corpus_cells))
    ctx.tracker.log_vs_baseline({r.run_id: r.vs_baseline for r in rows if r.vs_baseline})
    base_row = next((r for r in rows if r.baseline and r.complete), None)
    if base_row is None:
        reason = "no baseline measurement completed: nothing can be promoted (see the baseline trial's reason)"
        headline = search_only_headline(reason, None, study.search_concurrency, None)
        _print_trials(rows)
        write_study_report(ctx, ot_study, rows, headline)
        ctx.tracker.finish_study(ctx.parent_run_id, tags={"decision": "no_baseline"}, metrics={},
                                 texts={HEADLINE_TEXT: headline.text() + "\n"}, status="FAILED",
                                 description=headline.markdown())
        _print_headline(ctx, headline)
        return 1
    candidates = distinct_configs([r for r in rows if not r.baseline and r.complete])
    finalists: list[TrialRow] = []
    explanation = ""
    if study.promotion.finalists:
        choice = choose_finalists(candidates, study.objective.metrics, list(study.objective.modes),
                                  study.promotion.finalists)
        finalists = [next(r for r in candidates if r.name == name) for name in choice.names]
        explanation = choice.explanation
    base_config = trial_config(ctx.tracker, base_row.run_id)
    model_name = study.tracking.registered_model or f"specdec-{study.name}"
    if not finalists:
        # Nothing to compare: re-measuring the baseline alone would decide nothing.
        reason = no_finalist_reason(study.promotion.finalists, any(r.feasible is False for r in candidates))
        routing = RoutingPolicy(text="serve the baseline at every level (no finalist)", levels=list(study.concurrency),
                                source=BASELINE)
        version, serving = _promote(ctx, model_name, base_config, "keep_baseline", BASELINE, base_row.run_id, {},
                                    routing)
        fastest = max(candidates, key=lambda r: r.tput_tok_s or 0.0, default=None)
        best = (fastest.name, fastest.vs_baseline) if fastest and fastest.vs_baseline else None
        headline = search_only_headline(reason, base_row.tput_tok_s, study.search_concurrency,
                                        _deploy(ctx, serving), best)
        ctx.tracker.finish_study(ctx.parent_run_id, tags={"decision": "keep_baseline", "winner": "",
                                                          "registered_model": model_name,
                                                          "registered_version": version or ""},
                                 metrics={}, texts={"decision.txt": reason, HEADLINE_TEXT: headline.text() + "\n"},
                                 description=headline.markdown())
        _print_trials(rows)
        _print_deploy(ctx, serving)
        write_study_report(ctx, ot_study, rows, headline)
        _print_registered(ctx, model_name, version, moved=False)
        _print_headline(ctx, headline)
        return 0
    runs, levels = study.promotion.runs, list(study.concurrency)
    say(f"\nre-measuring the baseline and {len(finalists)} finalist(s) ({', '.join(r.name for r in finalists)}), "
        f"{runs} fresh runs each, at concurrency {levels} ...")
    labels = finalist_ids([row.name for row in finalists])
    configs, run_ids, names = {BASELINE: base_config}, {BASELINE: base_row.run_id}, {BASELINE: base_row.name}
    for config_id, row in zip(labels, finalists):
        configs[config_id], run_ids[config_id], names[config_id] = (trial_config(ctx.tracker, row.run_id), row.run_id,
                                                                    row.name)
    # a line per re-run while they run, each run named as the stage's own lines name it
    with phase_echo(Path(ctx.output_dir) / "finalists", who=rerun_name):
        inputs = measure_levels(ctx, base_config, [(n, c) for n, c in configs.items() if n != BASELINE], levels,
                                runs)
    # a split serves two engines at once: chosen only where production has room for both (ServingRoom)
    room = serving_room(study.engine.serving_gpus, engine_gpus(_served_replica(ctx, base_config)),
                        largest_node_gpus())
    levels_decision = decide_levels(inputs, study.promotion, study.objective.constraints, finalists=explanation,
                                    labels=labels, room=room)
    table = level_table(levels_decision)
    gap = _baseline_gap(ctx, base_row, levels_decision, inputs)
    # every view shows a finalist's speed-up as the decision read it, the search's beside it
    rows = with_decided(rows, levels_decision, names, study.search_concurrency)
    ctx.tracker.log_vs_baseline({r.run_id: r.vs_baseline for r in rows if r.vs_baseline},
                                decided={r.run_id: r.decided for r in rows if r.decided is not None})
    disturbed = disturbance(levels_decision)
    withheld = disturbed.provisional and not study.promotion.promote_when_disturbed
    if withheld:  # every re-run disturbed and the study says not to promote on that: the baseline everywhere
        levels_decision = withhold(levels_decision, decision_sentence(levels_decision))
    served = levels_decision.policy
    chosen_name, chosen_config, suggestion = served_config(levels_decision, configs)
    # The lowest level decides what is served there, so its single-level decision is the promotion's kind.
    low = levels_decision.levels[0]
    kind = "promote" if served.config else "keep_baseline"
    chosen = next(r for r in low.rows if r.id == chosen_name)
    version, serving = _promote(ctx, model_name, chosen_config, kind, chosen_name, run_ids[chosen_name],
                                {"tput_tok_s": chosen.median_tok_s,
                                 "baseline_tput_tok_s": low.decision.baseline.median,
                                 **({"speedup": chosen.speedup} if chosen.speedup is not None else {})},
                                routing_policy(levels_decision,
                                               {n: _served_replica(ctx, c) for n, c in configs.items()}),
                                measurement=disturbed.measurement)
    headline = levels_headline(levels_decision, _deploy(ctx, serving))
    if withheld:  # the rule's own sentence would explain a keep-baseline the runs did not call for
        headline = dataclasses.replace(headline, decision=served.text + ".")
    if suggestion:
        headline = dataclasses.replace(headline, notes=(*headline.notes, suggestion))
    _print_trials(rows)
    say("\nper-concurrency decision:\n" + table)
    _report(ctx, low.decision, model_name, version, [f for e in inputs for f in e.baseline_failures],
            levels_decision, table, headline, {**gap, "disturbed_runs": float(disturbed.disturbed),
                                               "deciding_runs": float(disturbed.total)},
            disturbed.measurement)
    _print_deploy(ctx, serving)
    write_study_report(ctx, ot_study, rows, headline, levels=levels_decision,
                       promoted=names[chosen_name] if served.config else None)
    _print_registered(ctx, model_name, version, moved=kind == "promote")
    _print_headline(ctx, headline)
    return 0


def _deploy(ctx: TrialContext, serving: ServingConfig) -> Deploy:
    folder = Path(ctx.output_dir) / DEPLOY_DIR
    policy = serving.policy
    two = policy is not None and policy.high is not None
    return Deploy(command=str(folder / COMMAND_FILE), high_command=str(folder / HIGH_COMMAND_FILE) if two else None,
                  switch_above=policy.switch_above if policy is not None else None)


def _print_trials(rows: Sequence[TrialRow]) -> None:
    say("\n" + format_table(rows))


def _print_headline(ctx: TrialContext, headline: Headline) -> None:
    """The decision, last on the console (and alone with --quiet): nothing after it but where to look."""
    say_headline(f"\n{RULE}\n{headline.text()}\n{RULE}")
    for line in study_links(ctx):
        say_headline(line)


def study_links(ctx: TrialContext) -> list[str]:
    """Where the study's results are: the report, the deploy files, the promoted config and the MLflow runs table
    (those that were written)."""
    out = Path(ctx.output_dir)
    lines = [f"report: {out / 'report' / 'report.html'}"] if (out / "report" / "report.html").exists() else []
    if (out / DEPLOY_DIR).is_dir():
        lines.append(f"deploy files: {out / DEPLOY_DIR / SERVE_CONFIG_FILE} (serve deploy), "
                     f"{out / DEPLOY_DIR / RAYSERVICE_PATCH_FILE} (KubeRay)")
    if (out / "promoted.yaml").exists():
        lines.append(f"promoted config: {out / 'promoted.yaml'}")
    uri = mask_url(ctx.tracker.tracking_uri) or ""
    ui = "http://127.0.0.1:5000" if uri.startswith("sqlite") else (uri if uri.startswith("http") else "<mlflow ui>")
    lines.append(f"compare the trials: mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite")
                 else f"compare the trials in the MLflow UI of {uri}")
    lines.append(f"  runs table: {runs_link(ui, ctx.tracker.experiment_id())}")
    return lines


def _served_replica(ctx: TrialContext, config: TrialConfig) -> ReplicaConfig:
    """The replica a finalist's trial ran, corpus included: its documents travel in the served config (production
    may run on a node that never saw the study's files; the `warmup` choice is written under the output folder)."""
    return shipped_replica_config(ctx.study, config, ctx.warmup, Path(ctx.output_dir))[0]


def write_study_report(ctx: TrialContext, ot_study: Any, rows: Sequence[TrialRow], headline: Headline,
                       levels: LevelsDecision | None = None, promoted: str | None = None) -> None:
    """HTML + PNGs beside the study and under the parent run's `report/` artifacts; never fails the study.
    `levels`: the per-level decision (its table and speed-up chart go in the page); `promoted`: the promoted trial's
    row name."""
    folder = Path(ctx.output_dir) / "report"
    try:
        inputs = report_inputs(ctx.tracker, ctx.parent_run_id, ctx.study, levels.labels if levels else None)
        files = write_report(folder, title=f"specdec-tuner study '{ctx.study.name}'", rows=rows, headline=headline,
                             ot_study=ot_study, metrics=ctx.study.objective.metrics,
                             modes=list[str](ctx.study.objective.modes), promoted=promoted, levels=levels,
                             extra_plots=prediction_plots(ot_study, ctx.study.objective.metrics[0]), inputs=inputs)
        for path in files:
            ctx.tracker.log_study_artifact(ctx.parent_run_id, path, "report")
        detail(f"report written: {folder / 'report.html'}")  # the links after the headline name it
    except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the study's result
        missing(f"the study report ({folder / 'report.html'} and its copy in MLflow)", exc)


def _promote(ctx: TrialContext, model_name: str, chosen: TrialConfig, kind: str, source: str,
             run_id: str | None, medians: dict[str, float],
             routing: RoutingPolicy, measurement: str | None = None) -> tuple[str | None, ServingConfig]:
    """Registry action, then the deployable winner in `<output>/deploy/` (also logged under the study run's `deploy/`)
    and promoted.yaml; returns the registered version (None when nothing was registered) and the served config.
    Keep-baseline registers the baseline only if nothing is in production yet. `routing`: the per-level serving
    policy the config carries (production serves it)."""
    study = ctx.study
    prompts = [(r.index, r.text, r.max_new_tokens) for r in (*ctx.warmup, *ctx.measure)]
    engine, hardware = tuned_on(ctx.tracker, run_id, study.engine.kind)
    provenance = Provenance(study=study.name, decision=kind, source=source, trial_run_id=run_id,
                            workload=study.workload.source,
                            workload_digest=workload_digest(prompts, study.workload.temperature), medians=medians,
                            engine=engine, hardware=hardware, measurement=measurement)
    # The same function that built the trial's replica; the log folder is the trial's and is dropped.
    serving = serving_config(_served_replica(ctx, chosen), provenance, routing)
    version = register_config(ctx.tracker, ctx.parent_run_id, model_name, serving, move_production=kind == "promote",
                              alias=study.tracking.alias)
    folder = Path(ctx.output_dir) / DEPLOY_DIR
    # A password in the tracking URI is masked: deploy files are shared, secrets are set where they are deployed.
    here = mask_url(ctx.tracker.tracking_uri) or ""
    reached = study.tracking.deploy_uri or (here if here.startswith(("http://", "https://")) else None)
    source_args = ({"registered_model": model_name, "version": version, "tracking_uri": reached or here} if version
                   else {"config_file": str((folder / SERVING_FILE).resolve())})
    # the RayService's pods: a registry they reach, else (a local store) the file says what to set
    cluster_args = {**source_args, "tracking_uri": reached} if version and reached else None
    write_deploy_folder(folder, deploy_files(serving, source_args, version or kind, cluster_args))
    checked = engine_for(serving.replica.engine).deploy_folder_report(folder)  # SGLang: its adaptive config's loader
    if checked:
        say(checked)
    try:
        ctx.tracker.log_study_artifact(ctx.parent_run_id, folder, DEPLOY_DIR)
    except Exception as exc:  # noqa: BLE001 - the files on disk and the registry already hold the winner
        missing(f"the study run's artifact {DEPLOY_DIR}/ (the deploy files' copy in MLflow)", exc)
    promoted = Path(ctx.output_dir) / "promoted.yaml"
    write_text_atomic(promoted, yaml.safe_dump({**serving.model_dump(mode="json"), "registered_model": model_name,
                                                "version": version}, sort_keys=False))
    return version, serving


def _print_deploy(ctx: TrialContext, serving: ServingConfig) -> None:
    folder = Path(ctx.output_dir) / DEPLOY_DIR
    say(f"\nengine command line of the served config ({folder / COMMAND_FILE}):\n  {engine_command(serving)}")


def baseline_gap(search_tok_s: float, reruns_tok_s: Sequence[float]) -> tuple[float, float]:
    """(pooled, gap): the baseline's figure over its search run and its re-runs at the search level (median), and
    how far the search run was from the re-runs' median (-0.1 = 10% below). A re-run that measured nothing (a failed
    launch, an unhealthy engine: 0 tok/s) is no figure of the baseline's speed and is left out; ValueError when no
    re-run measured anything. Pure."""
    measured = [t for t in reruns_tok_s if t > 0]
    if not measured:
        raise ValueError("baseline_gap: no re-run of the baseline measured a throughput")
    reruns = statistics.median(measured)
    return statistics.median([search_tok_s, *measured]), search_tok_s / reruns - 1


def _baseline_gap(ctx: TrialContext, base_row: TrialRow, levels: LevelsDecision,
                  inputs: Sequence[LevelInput]) -> dict[str, float]:
    """Say how far the search's baseline was from its re-runs (the search compared each trial with that one run;
    the finalists' figures come from run-by-run pairs instead), and how far at equal step speed where every window
    timed its plain steps (`gap_at_equal_steps`). Returns the study run's metrics of it."""
    level = next((r for r in levels.levels if r.level == ctx.study.search_concurrency), None)
    row = next((r for r in level.rows if r.id == BASELINE), None) if level else None
    search = base_row.tput_tok_s
    measured = [t for t in (row.runs_tok_s if row else []) if t > 0]
    if not measured or not search:  # no re-run measured anything (each failed): there is no gap to state
        return {}
    pooled, gap = baseline_gap(search, measured)
    entry = next((e for e in inputs if e.level == ctx.study.search_concurrency), None)
    runs = [(r.tput_tok_s, r.step_ratio) for r in entry.baseline if r.tput_tok_s > 0] if entry else []
    search_ratio = base_row.figures.get("window_step_ratio")
    steady = gap_at_equal_steps((search, search_ratio), runs)
    why = ""
    if steady is not None and search_ratio is not None:
        ratios = sorted(r for _, r in runs if r is not None)
        why = (f"; at equal step speed {steady:+.1%} (the engine's plain steps ran {search_ratio:.2f}x its calibrated "
               f"step in the search's window, {ratios[0]:.2f}-{ratios[-1]:.2f}x in the re-runs': the rest of the "
               "gap is the machine's speed when each ran)")
    say(f"\nbaseline: the search measured {search:.2f} tok/s, its {len(measured)} measured re-runs a median of "
        f"{statistics.median(measured):.2f} ({gap:+.1%}){why}: the finalists' speed-ups are the re-runs', "
        "the other trials' the search's (labelled as such)")
    out = {"search_baseline_tok_s": search, "search_baseline_gap": gap, "baseline_pooled_tok_s": pooled}
    if steady is not None:
        out["search_baseline_gap_equal_steps"] = steady
    return out


def _report(ctx: TrialContext, decision: Decision, model_name: str, version: str | None, failures: list[str],
            levels: LevelsDecision, table: str, headline: Headline, gap: dict[str, float],
            measurement: str = "") -> None:
    """`decision`: the lowest level's (what is served there); `levels`: the whole per-level decision, logged on the
    parent run as LEVELS_ARTIFACT (read by `python -m pipeline.compare`) and as a readable table; the headline is
    the run's description. Prints the policy and, per level, the rule's own reason (bars, scores, why each lost)."""
    # what is served (the policy's), which differs from the lowest level's pick where a split did not fit
    summary = {"decision": "promote" if levels.policy.config else "keep_baseline",
               "winner": levels.policy.config or "", "registered_model": model_name,
               "registered_version": version or "", "serving_policy": levels.policy.text[:5000],
               # clean | partly-disturbed | disturbed: whether other work disturbed the re-runs decided on
               **({MEASUREMENT_TAG: measurement} if measurement else {})}
    ctx.tracker.finish_study(
        ctx.parent_run_id, tags=summary,
        metrics={"baseline_score": decision.baseline.score, "baseline_median": decision.baseline.median,
                 **({"bar": decision.bar} if decision.bar is not None else {}), **gap},
        texts={"decision.json": decision.model_dump_json(indent=2), "decision.txt": levels.reason,
               LEVELS_ARTIFACT: levels.model_dump_json(indent=2), LEVELS_TEXT: table + "\n",
               HEADLINE_TEXT: headline.text() + "\n"},
        description=headline.markdown())
    say(f"policy: {levels.policy.text}")
    if levels.finalists:
        say(levels.finalists)
    for result in levels.levels:
        say(f"  at {result.level} in flight: {result.reason}")
    if failures:
        say("  baseline re-run failures: " + "; ".join(failures))


def _print_registered(ctx: TrialContext, model_name: str, version: str | None, moved: bool) -> None:
    if version and ctx.study.tracking.alias != "production":  # a re-tune: production stays where it is
        say(f"registered {model_name} version {version} as alias '{ctx.study.tracking.alias}'")
    elif version:
        say(f"registered {model_name} version {version} as alias 'production'"
            + ("" if moved else " (nothing was in production yet)"))
    else:
        say(f"production alias of {model_name} unchanged")
