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
import sys
from typing import Any, Sequence

from pipeline.errors import PipelineError, UserError

METRICS = ("tput_tok_s", "accept_len", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms", "tput_ci_low", "tput_ci_high",
           "ttft_p90_ms", "ttft_p99_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p90_ms", "e2e_p99_ms",
           "corpus_tokens", "corpus_load_s")  # corpus: only trials with an external corpus (pipeline/trial/corpus.py)


def rows_from_runs(runs: Sequence[Any], kind: str = "trial") -> list[dict[str, Any]]:
    """MLflow runs -> rows, baseline first, then by throughput (failed trials last). Pure over run objects."""
    rows = []
    for run in runs:
        if run.data.tags.get("specdec.kind") != kind:
            continue
        params = dict(run.data.params)
        rows.append({
            "run_id": run.info.run_id, "name": run.info.run_name, "outcome": run.data.tags.get("outcome", "?"),
            "reason": run.data.tags.get("reason", ""), "algorithm": params.get("spec.algorithm", "?"),
            "params": {k: v for k, v in sorted(params.items()) if k not in ("spec.algorithm", "trial.concurrency")},
            **{m: run.data.metrics.get(m) for m in METRICS},
        })
    return order_rows(rows)


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
    lines = [f"{'trial':<24} {'algorithm':<10} {'outcome':<14} {'tok/s':>7} {'vs base':>7} {'accept':>6} "
             f"{'ttft p50':>8}  settings"]
    for r in rows:
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] else "-"
        accept = f"{r['accept_len']:.2f}" if r["accept_len"] else "-"
        ttft = f"{r['ttft_p50_ms']:.0f}ms" if r["ttft_p50_ms"] else "-"
        mark = "  <- baseline" if r["baseline"] else ""
        if r.get("feasible") is False:
            mark += "  INFEASIBLE (SLA)"
        lines.append(f"{r['name']:<24} {r['algorithm']:<10} {r['outcome']:<14} {r['tput_tok_s'] or 0:>7.2f} "
                     f"{ratio:>7} {accept:>6} {ttft:>8}  {_settings(r)}{mark}")
        if r["outcome"] != "COMPLETE" and r["reason"]:
            lines.append(f"{'':<24} -> {r['reason'][:160]}")
        for text in r.get("sla") or []:
            if text.startswith("BROKEN"):
                lines.append(f"{'':<24} -> {text}")
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
        runs = tracker.client().search_runs([tracker.experiment_id()], max_results=5000)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pipeline.decide.levels import format_level_table

    levels = read_levels(tracker.client(), runs)
    if args.levels:
        if levels is None:
            print("error: this study has no per-concurrency decision (study/levels.json on its parent run)",
                  file=sys.stderr)
            return 1
        print(levels.model_dump_json(indent=2) if args.format == "json" else format_level_table(levels))
        return 0
    rows = rows_from_runs(runs, "finalist" if args.finalists else "trial")
    if not args.finalists:
        mark_constraints(rows, study.objective.constraints, study.search_concurrency)
    print(format_rows(rows, args.format))
    if levels is not None and args.format == "table":
        print("\nPer-concurrency decision:\n" + format_level_table(levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
