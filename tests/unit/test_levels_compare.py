"""The level table and SLA verdicts in `python -m pipeline.compare` (real MLflow on SQLite) and in the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.compare import format_rows, main, mark_constraints
from pipeline.config import SlaConstraint
from pipeline.decide.levels import LEVELS_ARTIFACT, Candidate, LevelInput, RunFigures, decide_levels
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.records.plots import plot_pareto
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import TrialRow
from tests.rows import trial_row


def rows() -> list[TrialRow]:
    return [
        trial_row("trial-0", "none", vs_baseline=1.0, tput_tok_s=10.0, ttft_p50_ms=50.0, ttft_p99_ms=90.0),
        trial_row("trial-1", vs_baseline=2.0, tput_tok_s=20.0, ttft_p50_ms=150.0, ttft_p99_ms=400.0),
        trial_row("trial-2", vs_baseline=1.5, tput_tok_s=15.0, ttft_p50_ms=60.0, ttft_p99_ms=120.0),
    ]


LIMIT = [SlaConstraint(metric="ttft_p99_ms", max_ms=200.0, concurrency=1)]


def test_compare_rows_mark_infeasible_trials_with_figure_and_limit() -> None:
    marked = mark_constraints(rows(), LIMIT, 1)
    assert [r.feasible for r in marked] == [True, False, True]
    text = format_rows(marked, "table")
    assert "INFEASIBLE (SLA)" in text.splitlines()[2]
    assert "BROKEN: ttft_p99_ms at concurrency 1: 400.0 ms > limit 200 ms" in text
    assert all(r.feasible is None for r in mark_constraints(rows(), LIMIT, 4))  # not checkable at level 4


def _levels_decision():
    def figs(t: float, ttft: float) -> tuple[RunFigures, ...]:
        return tuple(RunFigures(tput_tok_s=t, ttft_p99_ms=ttft) for _ in range(3))

    return decide_levels([
        LevelInput(level=1, baseline=figs(10, 90), candidates=(Candidate(id="trial-2", runs=figs(15, 120),
                                                                         equivalent=True, draft_tokens=4),)),
        LevelInput(level=4, baseline=figs(30, 150), candidates=(Candidate(id="trial-2", runs=figs(25, 160),
                                                                         equivalent=True, draft_tokens=4),)),
    ], constraints=LIMIT)


def test_compare_cli_prints_level_table_and_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    study_file = tmp_path / "study.yaml"
    study_file.write_text(f"name: lv\noutput_dir: {out}\nconcurrency: [1, 4]\nobjective:\n  constraints:\n"
                          "    - {metric: ttft_p99_ms, max_ms: 200, concurrency: 1}\n")
    tracker = Tracker(default_tracking_uri(out), "lv", out / "artifacts")
    parent = tracker.start_study("lv", "name: lv\n", resume=False)
    client = tracker.client()
    for row in rows():
        run = client.create_run(tracker.experiment_id(), run_name=row.name,
                                tags={"specdec.kind": "trial", "outcome": Outcome.COMPLETE.value})
        client.log_param(run.info.run_id, "spec.algorithm", row.algorithm)
        for key in ("tput_tok_s", "ttft_p50_ms", "ttft_p99_ms"):
            client.log_metric(run.info.run_id, key, row.figures[key])
    tracker.finish_study(parent, tags={}, metrics={}, texts={LEVELS_ARTIFACT: _levels_decision().model_dump_json()})

    assert main(["--study", str(study_file)]) == 0
    text = capsys.readouterr().out
    assert "INFEASIBLE (SLA)" in text and "400.0 ms > limit 200 ms" in text
    assert "Per-concurrency decision:" in text
    assert "policy: serve 'trial-2' up to concurrency 1; speculation off above 1" in text
    assert "decision: serve 'trial-2' up to 1 in flight (1.50x at 1), the baseline above 1" in text
    assert main(["--study", str(study_file), "--levels"]) == 0
    levels = capsys.readouterr().out
    assert "SERVED" in levels and "WINNER" not in levels
    assert "limits: ttft_p99_ms <= 200 ms at 1 in flight" in levels


def test_pareto_plot_marks_promoted_and_infeasible() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plot_pareto(ax, mark_constraints(rows(), LIMIT, 1), ["tput_tok_s", "ttft_p50_ms"], ["max", "min"], "trial-2")
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert "promoted: trial-2" in labels and "breaks an SLA limit" in labels
    front = [line for line in ax.get_lines() if line.get_label() == "Pareto front"][0]
    assert np.asarray(front.get_xdata()).tolist() == [10.0, 15.0]  # the infeasible 20 tok/s trial is kept off the front
