"""The HTML report: the headline first, the level table as an HTML table, the speed-up chart only with several
levels, configs named by their labels, and a plot only where the study has data for it (no empty frames)."""

import re

import optuna
import pytest

from pipeline.config import SlaConstraint
from pipeline.decide.headline import Deploy, levels_headline, search_only_headline
from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels
from pipeline.records.plots import figure, plot_accept, plot_throughput
from pipeline.records.report import write_report
from pipeline.vocabulary.outcome import Outcome
from tests.rows import trial_row

NAME = "ngram BFS d4 b2 depth18 warm1"
ID = "ngram-BFS-d4-b2-depth18-warm1"


def row(name, algorithm, outcome, tput=None, accept=None, ttft=10.0, **params):
    return trial_row(name, algorithm, outcome, params={k.replace("__", "."): str(v) for k, v in params.items()},
                     tput_tok_s=tput, tput_ci_low=tput and tput * 0.9, tput_ci_high=tput and tput * 1.1,
                     accept_len=accept, ttft_p50_ms=ttft)


def finished_study(values):
    study = optuna.create_study(direction="maximize")
    for i, value in enumerate(values):
        trial = study.ask()
        trial.suggest_int("ngram.num_draft_tokens", 2, 12)
        trial.suggest_int("ngram.warmup_requests", 0, 16)
        study.tell(trial, value)
    return study


def images(page: str) -> list[str]:
    return re.findall(r"<figure id='fig-([a-z_]+)'>", page)


def check(files):
    names = {p.name for p in files}
    assert "report.html" in names
    for path in files:
        assert path.stat().st_size > 1000, path
    page = [p for p in files if p.name == "report.html"][0].read_text()
    assert sorted(images(page)) == sorted(p.stem for p in files if p.suffix == ".png")  # every PNG shown, no other
    assert page.index("id='headline'") < page.index("<h2>")  # the headline comes first
    return page


def runs(*tputs, ttft=100.0):
    return tuple(RunFigures(tput_tok_s=t, ttft_p99_ms=ttft) for t in tputs)


def two_levels():
    return decide_levels([
        LevelInput(level=1, baseline=runs(10, 10.2, 9.8), candidates=(
            Candidate(id=ID, runs=runs(12.4, 12.0, 12.9), equivalent=True, draft_tokens=3),)),
        LevelInput(level=4, baseline=runs(30, 31, 29, ttft=300), candidates=(
            Candidate(id=ID, runs=runs(27, 28, 29, ttft=350), equivalent=True, draft_tokens=3),)),
    ], constraints=[SlaConstraint(metric="ttft_p99_ms", max_ms=200, concurrency=4)], labels={ID: NAME})


def test_one_trial_shows_the_headline_and_no_plot_that_compares_nothing(tmp_path):
    headline = search_only_headline("keep baseline: promotion.finalists is 0", 20.0, 1, Deploy("/d/engine.sh"))
    page = check(write_report(tmp_path, title="one", rows=[row("none", "none", Outcome.COMPLETE, 20.0)],
                              headline=headline, ot_study=finished_study([20.0])))
    assert "keep baseline: promotion.finalists is 0." in page and "/d/engine.sh" in page
    assert images(page) == []  # one bar, one history point: nothing to compare
    assert "<table id='trials-table'>" in page and "Pareto" not in page and "no Pareto front" not in page


def test_all_trials_failed(tmp_path):
    rows = [row("none", "none", Outcome.LAUNCH_FAILED), row("ngram BFS d4 b1 depth18 warm0", "ngram", Outcome.INVALID)]
    page = check(write_report(tmp_path, title="failed", rows=rows, decision="no baseline",
                              ot_study=optuna.create_study()))
    assert "LAUNCH_FAILED" in page and images(page) == []


def test_no_rows_at_all(tmp_path):
    assert "No trials recorded." in check(write_report(tmp_path, title="empty", rows=[], decision="-"))


def test_a_two_level_study_gets_its_level_table_as_html_and_the_speed_up_chart_first(tmp_path):
    decision = two_levels()
    headline = levels_headline(decision, Deploy("/out/deploy/engine_command.sh", "/out/deploy/high.sh", 1))
    rows = [row("none", "none", Outcome.COMPLETE, 10.0), row(NAME, "ngram", Outcome.COMPLETE, 12.0, 1.8)]
    page = check(write_report(tmp_path, title="levels", rows=rows, headline=headline, levels=decision))
    assert images(page)[0] == "speedup_by_concurrency"
    assert page.index("id='headline'") < page.index("fig-speedup_by_concurrency") < page.index("id='level-table'")
    table = page.split("<table id='level-table'>", 1)[1].split("</table>", 1)[0]
    assert table.count("<tr") == 5 and NAME in table and ID not in table  # header + 2 configs x 2 levels
    assert "SERVED (fallback)" in table and "breaks ttft_p99_ms &lt;= 200 ms (300 ms)" in table
    assert "WINNER" not in page and "BROKEN" not in page
    assert "no config meets ttft_p99_ms &lt;= 200 ms at 4 in flight" in page.split("id='headline'", 1)[1]
    assert "12.4" in table and "1.24x" in table and "1.20-1.29x" in table  # rounded, with the runs' range


def test_one_level_has_no_speed_up_chart(tmp_path):
    one = decide_levels([LevelInput(level=1, baseline=runs(10, 10, 10), candidates=(
        Candidate(id=ID, runs=runs(12, 12, 12), equivalent=True, draft_tokens=3),))], labels={ID: NAME})
    page = check(write_report(tmp_path, title="one level", rows=[], headline=levels_headline(one, Deploy("/x")),
                              levels=one))
    assert "speedup_by_concurrency" not in images(page) and "<table id='level-table'>" in page


@pytest.mark.parametrize("objectives", [(["tput_tok_s"], ["max"]), (["tput_tok_s", "ttft_p50_ms"], ["max", "min"])])
def test_many_trials(tmp_path, objectives):
    rows = [row("none", "none", Outcome.COMPLETE, 20.0)]
    for i in range(1, 30):
        rows.append(row(f"ngram BFS d{2 + i % 10} b1 depth18 warm{4 * (i % 5)} #{i}", "ngram",
                        Outcome.COMPLETE if i % 7 else Outcome.NOT_EQUIVALENT, 15.0 + i, 1.0 + i / 10,
                        100.0 - i, spec__num_draft_tokens=2 + i % 10, trial__warmup_requests=4 * (i % 5)))
    metrics, modes = objectives
    page = check(write_report(tmp_path, title="many", rows=rows, decision="promote",
                              ot_study=finished_study([float(i) for i in range(29)]), metrics=metrics, modes=modes))
    shown = set(images(page))
    assert {"throughput", "accept_length", "tput_vs_draft_tokens", "accept_vs_draft_tokens", "warmup_vs_accept",
            "optimization_history", "param_importance"} <= shown
    assert ("pareto_front" in shown) == (len(metrics) > 1)
    assert "corpus_vs_accept" not in shown  # no corpus was searched


def test_bars_are_named_by_the_config_labels():
    rows = [row("none", "none", Outcome.COMPLETE, 10.0), row(NAME, "ngram", Outcome.COMPLETE, 12.0, 1.8),
            row("ngram PROB d8 b1 depth12 warm8", "ngram", Outcome.COMPLETE, 11.0, 1.5)]
    fig, ax = figure(3)
    assert plot_throughput(ax, rows)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["none", "ngram PROB d8 b1 depth12 warm8", NAME]
    fig, ax = figure(2)
    assert plot_accept(ax, rows)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ngram PROB d8 b1 depth12 warm8", NAME]


def test_a_second_report_in_the_same_folder_drops_the_plots_it_no_longer_has(tmp_path):
    rows = [row("none", "none", Outcome.COMPLETE, 10.0), row(NAME, "ngram", Outcome.COMPLETE, 12.0, 1.8)]
    write_report(tmp_path, title="t", rows=rows, decision="d")
    assert (tmp_path / "throughput.png").exists()
    files = write_report(tmp_path, title="t", rows=rows[:1], decision="d")
    assert not (tmp_path / "throughput.png").exists() and [p.name for p in files] == ["report.html"]


def test_another_stage_adds_its_plot_through_the_hook(tmp_path):
    """The predicted-vs-measured plot's way in: a draw function that returns False is left out."""
    def predicted(fig, ax):
        ax.plot([1, 2], [1, 2])
        return True

    page = check(write_report(tmp_path, title="t", rows=[], decision="d",
                              extra_plots=[("predicted_vs_measured", "Predicted vs measured", predicted),
                                           ("nothing", "No data", lambda f, a: False)]))
    assert images(page) == ["predicted_vs_measured"]
