"""End of a study: the table of trials, finalists re-measured on fresh replicas, the promotion decision and action.

The decision itself is pure (`pipeline.decision.decide`); this module gathers its inputs by measuring, then hands the
result to the registry action and writes the deployable winner (`deploy/`) and `promoted.yaml`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.compare import format_table, rows_from_runs
from pipeline.config import TrialConfig
from pipeline.measure import to_table
from pipeline.atomic import write_text_atomic
from pipeline.decision import Decision, Finalist, decide
from pipeline.record import runs_link
from pipeline.redact import mask_url
from pipeline.registry import register_config
from pipeline.report import write_report
from pipeline.resume import workload_digest
from pipeline.trial import Outcome, TrialContext, measure_and_check, replica_config
from serve.serving import (COMMAND_FILE, RAYSERVICE_PATCH_FILE, SERVE_CONFIG_FILE, SERVING_FILE, Provenance,
                           deploy_files, engine_command, serving_config)

DEPLOY_DIR = "deploy"


def distinct_configs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in order, each config once (its first, i.e. fastest, row): a sampler may propose the same point twice,
    and re-measuring one config as two finalists would spend the re-runs on nothing."""
    seen: set[tuple] = set()
    out = []
    for row in rows:
        key = (row["algorithm"], tuple(sorted(row["params"].items())))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def trial_rows(ctx: TrialContext) -> list[dict[str, Any]]:
    """The study's trials from MLflow, baseline first then by throughput."""
    return rows_from_runs(ctx.tracker.trial_runs(ctx.parent_run_id))


def _config_of(ctx: TrialContext, run_id: str) -> TrialConfig:
    client = ctx.tracker.client()
    path = client.download_artifacts(run_id, "trial_config.json")
    return TrialConfig.model_validate(json.loads(Path(path).read_text()))


def remeasure(ctx: TrialContext, name: str, config: TrialConfig, runs: int) -> tuple[list[float], bool, list[str]]:
    """`runs` fresh passes through the trial's own measure+check path (`measure_and_check`: lost requests, settings the
    engine rewrote, equivalence with the baseline's outputs read from MLflow); (throughputs, all equivalent, failures).
    A speculative config compared with nothing (no baseline outputs) is not equivalent: it cannot be promoted."""
    throughputs, failures, equivalent = [], [], True
    compared = config.spec.algorithm != "none" and ctx.study.workload.temperature == 0
    for k in range(runs):
        label = f"{name}-run{k}"
        started_at = time.time()
        checked = measure_and_check(ctx, config, label, Path(ctx.output_dir) / "finalists" / label)
        m, outcome, reason, summary = checked.measurement, checked.outcome, checked.reason, checked.summary
        if outcome is Outcome.COMPLETE and compared and checked.equivalence is None:
            outcome, reason = Outcome.NOT_EQUIVALENT, f"not compared: {reason or 'no baseline outputs'}"
        if outcome is not Outcome.COMPLETE:
            equivalent = False
            if outcome is not Outcome.NOT_EQUIVALENT:
                failures.append(f"{label}: {outcome.value}: {reason[:200]}")
        throughputs.append(summary.tput_tok_s if summary and m.failure is None and outcome is not Outcome.INVALID
                           else 0.0)
        texts = {"engine.log": m.engine_log}
        if checked.equivalence is not None:
            texts["equivalence.json"] = checked.equivalence.model_dump_json(indent=2)
        ctx.tracker.log_trial(
            ctx.parent_run_id, study_name=ctx.study.name, run_name=label, kind="finalist",
            config=config.model_dump(mode="json"), outcome=outcome.value, reason=reason,
            metrics=summary.to_metrics() if summary else {}, requests=to_table(m.records) if m.records else None,
            texts=texts, extra_tags={"finalist": name}, started_at=started_at)
    return throughputs, equivalent, failures


def finalize_study(ctx: TrialContext, ot_study: Any) -> int:
    """Print the trials, re-measure finalists, decide, promote; returns the exit code (0 also for keep-baseline)."""
    study = ctx.study
    rows = trial_rows(ctx)
    print("\n" + format_table(rows), flush=True)
    ctx.tracker.log_vs_baseline({r["run_id"]: r["vs_baseline"] for r in rows if r.get("vs_baseline")})
    base_row = next((r for r in rows if r["algorithm"] == "none" and r["outcome"] == "COMPLETE"), None)
    if base_row is None:
        print("\nno baseline measurement completed: nothing can be promoted (see the baseline trial's reason)")
        write_study_report(ctx, ot_study, rows, "no baseline measurement completed: nothing was promoted")
        ctx.tracker.finish_study(ctx.parent_run_id, tags={"decision": "no_baseline"}, metrics={}, texts={},
                                 status="FAILED")
        return 1
    candidates = [r for r in rows if r["algorithm"] != "none" and r["outcome"] == "COMPLETE"]
    finalists = distinct_configs(candidates)[: study.promotion.finalists]
    base_config = _config_of(ctx, base_row["run_id"])
    model_name = study.tracking.registered_model or f"specdec-{study.name}"
    if not finalists:
        # Nothing to compare: re-measuring the baseline alone would decide nothing.
        reason = "keep baseline: no speculative trial completed with outputs equivalent to the baseline's"
        version = _promote(ctx, model_name, base_config, "keep_baseline", "baseline", base_row["run_id"], {})
        ctx.tracker.finish_study(ctx.parent_run_id, tags={"decision": "keep_baseline", "winner": "",
                                                          "registered_model": model_name,
                                                          "registered_version": version or ""},
                                 metrics={}, texts={"decision.txt": reason})
        print(f"\ndecision: KEEP_BASELINE -- {reason}")
        write_study_report(ctx, ot_study, rows, reason)
        _print_footer(ctx, model_name, version, moved=False)
        return 0
    runs = study.promotion.runs
    print(f"\nre-measuring the baseline and {len(finalists)} finalist(s), {runs} fresh runs each ...", flush=True)
    base_tputs, _, base_failures = remeasure(ctx, "final-baseline", base_config, runs)
    entries, configs, run_ids = [], {"baseline": base_config}, {"baseline": base_row["run_id"]}
    for i, row in enumerate(finalists):
        config = _config_of(ctx, row["run_id"])
        name = f"final-{i}-{row['name']}"
        tputs, equivalent, failures = remeasure(ctx, name, config, runs)
        entries.append(Finalist(id=name, throughputs=tuple(tputs), equivalent=equivalent, spec=config.spec,
                                failures=tuple(failures)))
        configs[name] = config
        run_ids[name] = row["run_id"]
    decision = decide(base_tputs, entries, study.promotion, baseline_failures=base_failures)
    chosen_name = decision.winner or "baseline"
    chosen = next((c for c in decision.candidates if c.id == chosen_name), decision.baseline)
    version = _promote(ctx, model_name, configs[chosen_name], decision.kind, chosen_name, run_ids[chosen_name],
                       {"tput_tok_s": chosen.median, "baseline_tput_tok_s": decision.baseline.median})
    write_study_report(ctx, ot_study, rows, f"{decision.kind}: {decision.reason}")
    _report(ctx, decision, model_name, version, base_failures)
    return 0


def write_study_report(ctx: TrialContext, ot_study: Any, rows: list[dict[str, Any]], decision: str) -> None:
    """HTML + PNGs beside the study and under the parent run's `report/` artifacts; never fails the study."""
    folder = Path(ctx.output_dir) / "report"
    try:
        files = write_report(folder, title=f"specdec-tuner study '{ctx.study.name}'", rows=rows, decision=decision,
                             ot_study=ot_study, metrics=ctx.study.objective.metrics, modes=list[str](ctx.study.objective.modes))
        for path in files:
            ctx.tracker.log_study_artifact(ctx.parent_run_id, path, "report")
        print(f"report: {folder / 'report.html'}")
    except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the study's result
        print(f"report could not be written: {type(exc).__name__}: {exc}")


def _promote(ctx: TrialContext, model_name: str, chosen: TrialConfig, kind: str, source: str,
             run_id: str | None, medians: dict[str, float]) -> str | None:
    """Registry action, then the deployable winner in `<output>/deploy/` (also logged under the study run's `deploy/`)
    and promoted.yaml. Keep-baseline registers the baseline only if nothing is in production yet."""
    study = ctx.study
    prompts = [(r.index, r.text, r.max_new_tokens) for r in (*ctx.warmup, *ctx.measure)]
    provenance = Provenance(study=study.name, decision=kind, source=source, trial_run_id=run_id,
                            workload=study.workload.source,
                            workload_digest=workload_digest(prompts, study.workload.temperature), medians=medians)
    # The same function that built the trial's replica; the log folder is the trial's and is dropped.
    serving = serving_config(replica_config(study, chosen, Path(ctx.output_dir)), provenance)
    version = register_config(ctx.tracker, ctx.parent_run_id, model_name, serving, move_production=kind == "promote")
    folder = Path(ctx.output_dir) / DEPLOY_DIR
    # A password in the tracking URI is masked: deploy files are shared, secrets are set where they are deployed.
    source_args = ({"registered_model": model_name, "version": version,
                    "tracking_uri": mask_url(ctx.tracker.tracking_uri) or ""} if version else
                   {"config_file": str((folder / SERVING_FILE).resolve())})
    for name, text in deploy_files(serving, source_args, version or kind).items():
        write_text_atomic(folder / name, text)
    try:
        ctx.tracker.log_study_artifact(ctx.parent_run_id, folder, DEPLOY_DIR)
    except Exception as exc:  # noqa: BLE001 - the files on disk and the registry already hold the winner
        print(f"deploy/ could not be logged to MLflow: {type(exc).__name__}: {exc}")
    promoted = Path(ctx.output_dir) / "promoted.yaml"
    write_text_atomic(promoted, yaml.safe_dump({**serving.model_dump(mode="json"), "registered_model": model_name,
                                                "version": version}, sort_keys=False))
    print(f"\nwinner's engine command line ({folder / COMMAND_FILE}):\n  {engine_command(serving)}")
    print(f"deploy files: {folder / SERVE_CONFIG_FILE} (serve deploy), {folder / RAYSERVICE_PATCH_FILE} (KubeRay)")
    return version


def _report(ctx: TrialContext, decision: Decision, model_name: str, version: str | None, failures: list[str]) -> None:
    summary = {"decision": decision.kind, "winner": decision.winner or "", "registered_model": model_name,
               "registered_version": version or ""}
    ctx.tracker.finish_study(
        ctx.parent_run_id, tags=summary,
        metrics={"baseline_score": decision.baseline.score, "baseline_median": decision.baseline.median,
                 **({"bar": decision.bar} if decision.bar is not None else {})},
        texts={"decision.json": decision.model_dump_json(indent=2), "decision.txt": decision.reason})
    print(f"\ndecision: {decision.kind.upper()} -- {decision.reason}")
    for c in decision.candidates:
        print(f"  {c.id}: median {c.median:.2f} tok/s, MAD {c.mad:.2f}, score {c.score:.2f}"
              + (f" -- {c.lost_because}" if c.lost_because else " -- winner"))
    print(f"  baseline: median {decision.baseline.median:.2f} tok/s, score {decision.baseline.score:.2f}")
    if failures:
        print("  baseline re-run failures: " + "; ".join(failures))
    _print_footer(ctx, model_name, version, moved=decision.kind == "promote")


def _print_footer(ctx: TrialContext, model_name: str, version: str | None, moved: bool) -> None:
    if version:
        print(f"registered {model_name} version {version} as alias 'production'"
              + ("" if moved else " (nothing was in production yet)"))
    else:
        print(f"production alias of {model_name} unchanged")
    print(f"promoted config: {Path(ctx.output_dir) / 'promoted.yaml'}")
    uri = mask_url(ctx.tracker.tracking_uri) or ""
    ui = "http://127.0.0.1:5000" if uri.startswith("sqlite") else (uri if uri.startswith("http") else "<mlflow ui>")
    print(f"compare the trials: mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite")
          else f"compare the trials in the MLflow UI of {uri}")
    print(f"  runs table: {runs_link(ui, ctx.tracker.experiment_id())}")
