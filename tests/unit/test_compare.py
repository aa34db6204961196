"""The compare table: ordering, baseline marking, ratios, CSV and JSON formats."""

import csv
import io
import json
from types import SimpleNamespace

from pipeline.compare import format_rows
from pipeline.records.trial_runs import rows_from_runs
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import ROW_METRICS


def run(name, algorithm, outcome, tput=None, kind="trial", reason="", **params):
    metrics = {} if tput is None else {"tput_tok_s": tput, "accept_len": 2.0 if algorithm != "none" else None}
    return SimpleNamespace(
        info=SimpleNamespace(run_id=f"id-{name}", run_name=name),
        data=SimpleNamespace(tags={"specdec.kind": kind, "outcome": outcome.value, "reason": reason},
                             params={"spec.algorithm": algorithm, "trial.concurrency": "1", **params},
                             metrics={k: v for k, v in metrics.items() if v is not None}))


RUNS = [
    run("trial-c", "ngram", Outcome.COMPLETE, 30.0, **{"spec.num_draft_tokens": "8"}),
    run("trial-x", "ngram", Outcome.INVALID, reason="ngram: min_bfs_breadth <= max_bfs_breadth must hold"),
    run("trial-a", "none", Outcome.COMPLETE, 20.0),
    run("trial-b", "ngram", Outcome.COMPLETE, 40.0, **{"spec.num_draft_tokens": "4"}),
    run("final-0", "ngram", Outcome.COMPLETE, 39.0, kind="finalist"),
]


def test_baseline_first_then_by_throughput_then_failures():
    rows = rows_from_runs(RUNS)
    assert [r.name for r in rows] == ["trial-a", "trial-b", "trial-c", "trial-x"]
    assert [r.baseline for r in rows] == [True, False, False, False]
    assert [r.vs_baseline for r in rows] == [1.0, 2.0, 1.5, None]


def test_other_kinds_are_filtered():
    assert [r.name for r in rows_from_runs(RUNS, "finalist")] == ["final-0"]


def test_table_marks_baseline_and_shows_reasons():
    text = format_rows(rows_from_runs(RUNS), "table")
    lines = text.splitlines()
    assert lines[1].startswith("trial-a") and lines[1].endswith("<- baseline")
    assert lines[2].startswith("trial-b") and "2.00x" in lines[2]
    assert "-> ngram: min_bfs_breadth" in text
    assert "num_draft_tokens=4" in format_rows(rows_from_runs(RUNS), "csv")  # the settings, in full


def test_trials_of_one_config_are_told_apart_by_their_trial_ids():
    """Run names are config labels, which a config sampled twice shares: the slower record gets its trial id."""
    label = "ngram BFS d4 b1 depth18 warm1"
    runs = [run(label, "ngram", Outcome.COMPLETE, 30.0), run(label, "ngram", Outcome.COMPLETE, 32.0),
            run("none", "none", Outcome.COMPLETE, 20.0)]
    runs[0].data.tags["trial_id"], runs[1].data.tags["trial_id"] = "aaa111", "bbb222"
    rows = rows_from_runs(runs)
    assert [r.name for r in rows] == ["none", label, f"{label} #aaa111"]
    assert [r.trial_id for r in rows] == [None, "bbb222", "aaa111"]
    lines = format_rows(rows, "table").splitlines()
    assert lines[2].startswith(f"{label}  ") and lines[3].startswith(f"{label} #aaa111  ")


def test_csv_and_json():
    rows = rows_from_runs(RUNS)
    parsed = list(csv.DictReader(io.StringIO(format_rows(rows, "csv"))))
    assert [p["name"] for p in parsed] == ["trial-a", "trial-b", "trial-c", "trial-x"]
    assert parsed[0]["baseline"] == "True" and parsed[1]["vs_baseline"] == "2.0"
    data = json.loads(format_rows(rows, "json"))
    assert data[1]["params"]["spec.num_draft_tokens"] == "4" and data[3]["outcome"] == Outcome.INVALID.value
    # the JSON rows keep their keys, in the order `python -m pipeline.compare` always wrote them
    assert list(data[0]) == ["run_id", "name", "trial_id", "outcome", "reason", "algorithm", "params", *ROW_METRICS,
                             "baseline", "vs_baseline"]


def test_an_objective_outside_the_table_figures_still_picks_finalists():
    """A row carries every figure of its run: an objective the tables do not show (req_per_s) is still read."""
    from pipeline.decide.pareto import choose_finalists

    runs = [run("a", "ngram", Outcome.COMPLETE, 30.0), run("b", "ngram", Outcome.COMPLETE, 20.0)]
    runs[0].data.metrics["req_per_s"], runs[1].data.metrics["req_per_s"] = 1.0, 2.0
    assert choose_finalists(rows_from_runs(runs), ["req_per_s"], ["max"], 1).names == ("b",)


def test_no_baseline_means_no_ratios():
    rows = rows_from_runs([run("t1", "ngram", Outcome.COMPLETE, 10.0), run("t0", "none", Outcome.LAUNCH_FAILED)])
    assert all(r.vs_baseline is None for r in rows)
    assert rows[0].name == "t0"  # the baseline is still listed first, failed or not


def test_a_config_sampled_twice_is_one_finalist():
    from pipeline.study.finalize import distinct_configs

    rows = rows_from_runs([*RUNS, run("trial-d", "ngram", Outcome.COMPLETE, 35.0, **{"spec.num_draft_tokens": "4"})])
    names = [r.name for r in distinct_configs([r for r in rows if r.algorithm == "ngram"])]
    assert names == ["trial-b", "trial-c", "trial-x"]  # trial-d repeats trial-b's config at a lower throughput
