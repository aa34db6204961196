"""`python -m pipeline.compare --study FILE`: the trials of a study from MLflow, as a table, CSV or JSON.

Rows: the baseline first (marked), then the other trials by throughput, best first; outcome, key metrics, the ratio
to the baseline's throughput and the trial's settings. The same rows are printed at the end of every study.
With SLA limits (`objective.constraints`) each row gets its verdicts at the search level and infeasible trials are
marked; when the study's parent run holds a per-level decision (`pipeline.decide.levels.LEVELS_ARTIFACT`), its level table
(winner, speed-up, latencies and verdicts per concurrency level, and the serving policy) follows the rows.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from typing import Any, Sequence

from pipeline.errors import PipelineError, UserError
from pipeline.records.labels import unique_names
from pipeline.records.tracking import TRIAL_ID_TAG

METRICS = ("tput_tok_s", "accept_len", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms", "tput_ci_low", "tput_ci_high",
           "ttft_p90_ms", "ttft_p99_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p90_ms", "e2e_p99_ms",
           "corpus_tokens", "corpus_load_s")  # corpus: only trials with an external corpus (pipeline/trial/corpus.py)


def rows_from_runs(runs: Sequence[Any], kind: str = "trial") -> list[dict[str, Any]]:
    """MLflow runs -> rows, baseline first, then by throughput (failed trials last). Pure over run objects.

    `name` is the run name -- a trial's config label (`pipeline.records.labels`) -- made unique: a config the sampler
    proposed twice gets ` #<trial id>` on its slower rows; `trial_id` is the Tune trial id (tag `trial_id`; None in
    records from before it was kept)."""
    rows = []
    for run in runs:
        if run.data.tags.get("specdec.kind") != kind:
            continue
        params = dict(run.data.params)
        rows.append({
            "run_id": run.info.run_id, "name": run.info.run_name, "trial_id": run.data.tags.get(TRIAL_ID_TAG),
            "outcome": run.data.tags.get("outcome", "?"),
            "reason": run.data.tags.get("reason", ""), "algorithm": params.get("spec.algorithm", "?"),
            "params": {k: v for k, v in sorted(params.items()) if k not in ("spec.algorithm", "trial.concurrency")},
            **{m: run.data.metrics.get(m) for m in METRICS},
        })
    ordered = order_rows(rows)
    names = unique_names([r["name"] for r in ordered], [r["trial_id"] or r["run_id"][:8] for r in ordered])
    for row, name in zip(ordered, names):
        row["name"] = name
    return ordered


def order_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Baseline first; then COMPLETE trials by throughput (best first); then the rest; name breaks ties."""
    def key(row: dict[str, Any]) -> tuple:
        return (row["algorithm"] != "none", row["outcome"] != "COMPLETE", -(row["tput_tok_s"] or 0.0), row["name"])

    ordered = sorted(rows, key=key)
    base = next((r["tput_tok_s"] for r in ordered if r["algorithm"] == "none" and r["outcome"] == "COMPLETE"), None)
    for row in ordered:
        row["baseline"] = row["algorithm"] == "none"
        tput = row["tput_tok_s"]
        row["vs_baseline"] = round(tput / base, 4) if tput and base else None
    return ordered


def mark_constraints(rows: list[dict[str, Any]], constraints: Sequence[Any], level: int) -> list[dict[str, Any]]:
    """Add each row's SLA verdicts at the search `level` (`sla`: verdict texts) and `feasible` (False when a COMPLETE
    trial breaks a limit; None when no limit holds at that level). Pure; returns the same rows."""
    from pipeline.decide.sla import limits_at, row_verdicts

    checkable = limits_at(constraints, level)
    for row in rows:
        verdicts = row_verdicts(row, checkable, level) if checkable and row["outcome"] == "COMPLETE" else []
        row["sla"] = [("ok: " if v.ok else "BROKEN: ") + v.text for v in verdicts]
        row["feasible"] = all(v.ok for v in verdicts) if verdicts else None
    return rows


def _settings(row: dict[str, Any]) -> str:
    return " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in row["params"].items()
                    if k.startswith("spec.") or k == "trial.warmup_requests")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The trials as a terminal table: each config's label (its settings: `pipeline.records.labels`), outcome,
    throughput, ratio to the baseline, accept length, TTFT p50; a failed trial's reason and broken limits below it."""
    width = max([len(r["name"]) for r in rows] + [6])
    lines = [f"{'config':<{width}}  {'outcome':<14} {'tok/s':>7} {'vs base':>7} {'accept':>6} {'ttft p50':>8}"]
    for r in rows:
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] else "-"
        accept = f"{r['accept_len']:.2f}" if r["accept_len"] else "-"
        ttft = f"{r['ttft_p50_ms']:.0f}ms" if r["ttft_p50_ms"] else "-"
        mark = "  <- baseline" if r["baseline"] else ""
        if r.get("feasible") is False:
            mark += "  INFEASIBLE (SLA)"
        tput = f"{r['tput_tok_s']:.2f}" if r["tput_tok_s"] else "-"
        lines.append(f"{r['name']:<{width}}  {r['outcome']:<14} {tput:>7} {ratio:>7} {accept:>6} {ttft:>8}{mark}")
        if r["outcome"] != "COMPLETE" and r["reason"]:
            lines.append(f"{'':<4}-> {r['reason'][:160]}")
        for text in r.get("sla") or []:
            if text.startswith("BROKEN"):
                lines.append(f"{'':<4}-> {text}")
    return "\n".join(lines)


def read_levels(client: Any, runs: Sequence[Any]) -> Any:
    """The per-level decision logged on the study's parent run, or None when the study has none (single level,
    or a study from before per-level promotion)."""
    import tempfile

    from pipeline.decide.levels import LEVELS_ARTIFACT, LevelsDecision

    parents = [r for r in runs if r.data.tags.get("specdec.kind") == "study"]
    for parent in sorted(parents, key=lambda r: r.info.start_time or 0, reverse=True):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(parent.info.run_id, LEVELS_ARTIFACT, tmp)
            except Exception:  # noqa: BLE001  # MLflow raises several types for "no such artifact"
                continue
            with open(path) as handle:
                return LevelsDecision.model_validate_json(handle.read())
    return None


def level_text(levels: Any) -> str:
    """The per-level decision for a terminal: the level table with labels, then the policy and what no config could
    do (`pipeline.decide.headline`)."""
    from pipeline.decide.headline import decision_sentence, impossible_lines, level_table

    lines = [level_table(levels), f"decision: {decision_sentence(levels)}"]
    lines += [f"not possible: {line}" for r in levels.levels for line in impossible_lines(levels, r)]
    lines.append(f"policy: {levels.policy.text}")
    return "\n".join(lines)


def format_rows(rows: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        fields = ["name", "baseline", "algorithm", "outcome", *METRICS, "vs_baseline", "feasible", "sla", "settings",
                  "reason", "run_id"]
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "settings": _settings(row), "sla": "; ".join(row.get("sla") or [])})
        return out.getvalue()
    return format_table(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--study", metavar="FILE", help="the study file the study was run with")
    parser.add_argument("--name", help="study name (default: from the study file, else 'default')")
    parser.add_argument("--output", help="output folder of the study (default: ./runs/<name>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the output folder)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--finalists", action="store_true", help="show the finalists' re-measurements instead")
    parser.add_argument("--levels", action="store_true", help="show only the per-concurrency decision (table or json)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per artifact read, on stdout
    from pipeline.config import load_study
    from pipeline.records.tracking import Tracker, default_tracking_uri

    overrides = {k: v for k, v in {"name": args.name, "output_dir": args.output,
                                   "tracking.uri": args.tracking_uri}.items() if v}
    try:
        study = load_study(args.study, overrides)
        uri = study.tracking.uri or default_tracking_uri(study.output_path())
        if uri.startswith("sqlite:///") and not study.output_path().joinpath("mlflow.db").exists() \
                and not study.tracking.uri:
            raise PipelineError(f"no study found at {study.output_path()} (no mlflow.db); pass --output or --name")
        tracker = Tracker(uri, study.tracking.experiment or study.name)
        if tracker.client().get_experiment_by_name(tracker.experiment) is None:  # experiment_id() would create it
            raise PipelineError(f"no study named {tracker.experiment!r} in this tracking store; pass the study's "
                                "--name (or --study / --output)")
        runs = tracker.client().search_runs([tracker.experiment_id()], max_results=5000)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    levels = read_levels(tracker.client(), runs)
    if args.levels:
        if levels is None:
            print("error: this study has no per-concurrency decision (study/levels.json on its parent run)",
                  file=sys.stderr)
            return 1
        print(levels.model_dump_json(indent=2) if args.format == "json" else level_text(levels))
        return 0
    rows = rows_from_runs(runs, "finalist" if args.finalists else "trial")
    if not args.finalists:
        mark_constraints(rows, study.objective.constraints, study.search_concurrency)
    print(format_rows(rows, args.format))
    if levels is not None and args.format == "table":
        print("\nPer-concurrency decision:\n" + level_text(levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
