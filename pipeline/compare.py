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
import dataclasses
import io
import json
import os
import sys
from collections.abc import Sequence

from pipeline.cli_common import add_version, program
from pipeline.config import SlaConstraint, load_study
from pipeline.decide.headline import decision_sentence, impossible_lines, level_table
from pipeline.decide.levels import LevelsDecision
from pipeline.decide.sla import limits_at, row_verdicts
from pipeline.errors import PipelineError, UserError
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.records.trial_runs import rows_from_runs, study_levels
from pipeline.vocabulary.row import ROW_METRICS, TrialRow


def mark_constraints(rows: Sequence[TrialRow], constraints: Sequence[SlaConstraint], level: int) -> list[TrialRow]:
    """The rows with their SLA verdicts at the search `level` (`sla`: verdict texts) and `feasible` (False when a
    COMPLETE trial breaks a limit; None when no limit holds at that level). Pure."""
    checkable = limits_at(constraints, level)
    out = []
    for row in rows:
        verdicts = row_verdicts(row, checkable, level) if checkable and row.complete else []
        out.append(dataclasses.replace(row, sla=tuple(("ok: " if v.ok else "BROKEN: ") + v.text for v in verdicts),
                                       feasible=all(v.ok for v in verdicts) if verdicts else None))
    return out


def format_table(rows: Sequence[TrialRow]) -> str:
    """The trials as a terminal table: each config's label (its settings: `pipeline.records.labels`), outcome,
    throughput, speed-up (`TrialRow.speedup`: the finalist stage's figure where it exists, the search's beside it),
    accept length, TTFT p50; a failed trial's reason and broken limits below it. Column headers as the level table
    (`pipeline.decide.headline.level_table`) spells them."""
    from tabulate import tabulate

    cells = []
    for r in rows:
        marks = ["<- baseline"] if r.baseline else []
        marks += [f"re-measured ({r.search_note})"] if r.search_note else []
        marks += ["INFEASIBLE (SLA)"] if r.feasible is False else []
        cells.append([r.name, r.outcome_text, f"{r.tput_tok_s:.2f}" if r.tput_tok_s else "-",
                      f"{r.speedup:.2f}x" if r.speedup else "-", f"{r.accept_len:.2f}" if r.accept_len else "-",
                      f"{r.ttft_p50_ms:.0f}ms" if r.ttft_p50_ms else "-", "  ".join(marks)])
    table = tabulate(cells, headers=["config", "outcome", "tok/s", "speed-up", "accept", "ttft p50", ""],
                     tablefmt="plain", colalign=("left", "left", "right", "right", "right", "right", "left"),
                     disable_numparse=True).splitlines()
    lines = table[:1]
    for r, line in zip(rows, table[1:]):
        lines.append(line)
        if not r.complete and r.reason:
            lines.append(f"{'':<4}-> {r.reason[:160]}")
        for text in r.sla or ():
            if text.startswith("BROKEN"):
                lines.append(f"{'':<4}-> {text}")
    return "\n".join(lines)


def level_text(levels: LevelsDecision) -> str:
    """The per-level decision for a terminal: the level table with labels, then the policy and what no config could
    do (`pipeline.decide.headline`)."""
    lines = [level_table(levels), f"decision: {decision_sentence(levels)}"]
    lines += [f"not possible: {line}" for r in levels.levels for line in impossible_lines(levels, r)]
    lines.append(f"policy: {levels.policy.text}")
    return "\n".join(lines)


def format_rows(rows: Sequence[TrialRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([row.record() for row in rows], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        fields = ["name", "baseline", "algorithm", "outcome", *ROW_METRICS, "vs_baseline", "decided_vs_baseline",
                  "feasible", "sla",
                  "settings", "reason", "run_id"]
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row.record(), "settings": row.settings, "sla": "; ".join(row.sla or ())})
        return out.getvalue()
    return format_table(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("specdec-compare", "pipeline.compare"),
                                     description=__doc__.splitlines()[0])
    add_version(parser)
    parser.add_argument("--study", metavar="FILE", help="the study file the study was run with")
    parser.add_argument("--name", help="study name (default: from the study file, else 'default')")
    parser.add_argument("--output", help="output folder of the study (default: ./runs/<name>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: the study file's tracking.uri, else "
                                               "$MLFLOW_TRACKING_URI, else sqlite under the output folder)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--finalists", action="store_true", help="show the finalists' re-measurements instead")
    parser.add_argument("--levels", action="store_true", help="show only the per-concurrency decision (table or json)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per artifact read, on stdout

    overrides = {k: v for k, v in {"name": args.name, "output_dir": args.output,
                                   "tracking.uri": args.tracking_uri}.items() if v}
    try:
        study = load_study(args.study, overrides)
        uri = study.tracking.uri or default_tracking_uri(study.output_path())
        if uri.startswith("sqlite:///") and not study.output_path().joinpath("mlflow.db").exists() \
                and not study.tracking.uri:
            raise PipelineError(f"no study found at {study.output_path()} (no mlflow.db); pass --output or --name")
        tracker = Tracker(uri, study.tracking.experiment or study.name)
        if not tracker.experiment_exists():
            raise PipelineError(f"no study named {tracker.experiment!r} in this tracking store; pass the study's "
                                "--name (or --study / --output)")
        runs = tracker.all_runs()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    levels = study_levels(tracker, runs)
    if args.levels:
        if levels is None:
            print("error: this study has no per-concurrency decision (study/levels.json on its parent run)",
                  file=sys.stderr)
            return 1
        print(levels.model_dump_json(indent=2) if args.format == "json" else level_text(levels))
        return 0
    rows = rows_from_runs(runs, "finalist" if args.finalists else "trial")
    if not args.finalists:
        rows = mark_constraints(rows, study.objective.constraints, study.search_concurrency)
    print(format_rows(rows, args.format))
    if levels is not None and args.format == "table":
        print("\nPer-concurrency decision:\n" + level_text(levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
