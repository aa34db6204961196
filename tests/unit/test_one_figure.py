"""One speed-up per config in every view once the finalist stage measured it (console table, report, plot, MLflow),
the search's beside it and labelled; and the decision's caveat when other work disturbed the re-runs it rests on."""

from __future__ import annotations

import pytest

from pipeline.compare import format_table
from pipeline.decide.disturbance import CLEAN, DISTURBED, PARTLY, disturbance, withheld_sentence, withhold
from pipeline.decide.headline import Deploy, decision_sentence, levels_headline
from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels
from pipeline.records.plots import figure, plot_throughput
from pipeline.records.report import headline_html, trials_table_html, write_report
from pipeline.records.tracking import VS_BASELINE_DECIDED, VS_BASELINE_SEARCH, Tracker
from pipeline.records.trial_runs import child_rows, with_decided
from pipeline.vocabulary.outcome import Outcome
from tests.rows import trial_row

NAME = "ngram BFS d8 b1 depth10"
ID = "ngram-BFS-d8-b1-depth10"
DEPLOY = Deploy("/out/deploy/engine_command.sh")


def runs(tputs: tuple[float, ...], disturbed: bool | None = False) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=t, order=k, disturbed=disturbed) for k, t in enumerate(tputs))


def decision(base_disturbed: bool | None = False, cand_disturbed: bool | None = False):
    # paired: 18.4/10, 18.6/10.2, 18/9.8 -> median 1.84 (the search said 15.9 / 10 = 1.59)
    level = LevelInput(level=1, baseline=runs((10.0, 10.2, 9.8), base_disturbed), candidates=(
        Candidate(id=ID, runs=runs((18.4, 18.6, 18.0), cand_disturbed), equivalent=True, draft_tokens=8),))
    return decide_levels([level], labels={ID: NAME})


def search_rows():
    return [trial_row("none", "none", tput_tok_s=10.0, vs_baseline=1.0),
            trial_row(NAME, tput_tok_s=15.9, vs_baseline=1.59),
            trial_row("ngram BFS d2 b1 depth10", tput_tok_s=12.0, vs_baseline=1.2)]


def test_a_finalist_shows_the_decisions_figure_and_the_search_figure_labelled_beside_it(tmp_path):
    levels = decision()
    (speedup,) = [r.speedup for r in levels.levels[0].rows if r.id == ID]
    assert speedup == pytest.approx(1.8367, abs=1e-3)
    rows = with_decided(search_rows(), levels, {ID: NAME}, 1)
    finalist = next(r for r in rows if r.name == NAME)
    assert finalist.decided == speedup and finalist.speedup == speedup and finalist.search_note == "search 1.59x"
    other = next(r for r in rows if r.name.startswith("ngram BFS d2"))
    assert other.decided is None and other.speedup == 1.2 and other.search_note == ""
    headline = levels_headline(levels, DEPLOY)
    assert f"= {speedup:.2f}x" in headline.levels[0]

    table = format_table(rows)
    line = next(x for x in table.splitlines() if x.startswith(NAME))
    assert f"{speedup:.2f}x" in line and "re-measured (search 1.59x)" in line and "1.59x " not in line.split("(")[0]
    html = trials_table_html(rows, remeasured=True)
    assert f"<td class='num'>{speedup:.2f}x</td>" in html and "search 1.59x" in html
    assert "<td class='num'>1.59x</td>" not in html

    fig, ax = figure(3)
    assert plot_throughput(ax, rows)
    widths = {t.get_text(): bar.get_width() for t, bar in zip(ax.get_yticklabels(), ax.patches)}
    assert widths[NAME] == pytest.approx(speedup) and widths["none"] == pytest.approx(1.0)
    page = write_report(tmp_path, title="t", rows=rows, headline=headline, levels=levels)[-1].read_text()
    assert "search 1.59x" in page


def test_mlflow_shows_the_decisions_figure_as_vs_baseline_and_the_search_figure_beside_it(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "one-figure", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("one-figure", "name: one-figure\n", resume=False)
    ids = {}
    for name, algorithm, tput in (("none", "none", 10.0), (NAME, "ngram", 15.9)):
        ids[name] = tracker.log_trial(parent, study_name="one-figure", run_name=name, kind="trial",
                                      config={"spec": {"algorithm": algorithm}}, outcome=Outcome.COMPLETE,
                                      reason="", metrics={"tput_tok_s": tput}, requests=None, texts={})
    tracker.log_vs_baseline({ids["none"]: 1.0, ids[NAME]: 1.59}, decided={ids[NAME]: 1.84})
    metrics = tracker.client().get_run(ids[NAME]).data.metrics
    assert metrics["vs_baseline"] == 1.84 and metrics[VS_BASELINE_SEARCH] == 1.59
    assert metrics[VS_BASELINE_DECIDED] == 1.84
    assert tracker.client().get_run(ids["none"]).data.metrics["vs_baseline"] == 1.0
    rows = {r.name: r for r in child_rows(tracker, parent)}
    assert rows[NAME].decided == 1.84 and rows[NAME].speedup == 1.84 and rows[NAME].vs_baseline == 1.59


@pytest.mark.parametrize(("base", "cand", "measurement", "provisional"), [
    (False, False, CLEAN, False), (True, False, PARTLY, False), (True, True, DISTURBED, True),
    (None, None, CLEAN, False)])
def test_the_decision_says_when_it_rests_on_disturbed_runs(base, cand, measurement, provisional):
    levels = decision(base, cand)
    found = disturbance(levels)
    assert (found.measurement, found.provisional, found.total) == (measurement, provisional, 6)
    headline = levels_headline(levels, DEPLOY)
    assert headline.provisional is provisional
    first = headline.text().splitlines()[0]
    assert first.startswith("decision: PROMOTE (PROVISIONAL) -- " if provisional else "decision: PROMOTE -- ")
    html = headline_html(headline)
    if measurement == CLEAN:
        assert headline.caveat == "" and "Caveat" not in headline.text() and "id='caveat'" not in html
        return
    assert headline.text().splitlines()[1].startswith("  Caveat: ")
    assert ("all 6 re-runs" if provisional else "3 of the 6 re-runs") in headline.caveat
    assert "disturbed windows" in html and "id='caveat'" in html and ("PROVISIONAL" in html) is provisional
    assert headline.markdown().startswith(f"**Decision ({headline.label}):**")


def test_a_withheld_promotion_says_what_the_disturbed_runs_called_for():
    text = withheld_sentence(f"serve '{NAME}': faster than the baseline at 1 in flight (1.84x at 1).")
    assert text.startswith("keep the baseline: every re-run was disturbed and promotion.promote_when_disturbed is "
                           "false") and "1.84x at 1" in text


def test_a_study_that_does_not_promote_on_disturbed_runs_serves_the_baseline_and_says_why():
    levels = decision(True, True)
    kept = withhold(levels, decision_sentence(levels))
    assert kept.policy.config is None and kept.levels == levels.levels
    assert kept.policy.text.startswith("keep the baseline: every re-run was disturbed")
    assert f"serve '{NAME}'" in kept.policy.text
    headline = levels_headline(kept, DEPLOY)
    assert headline.kind == "keep_baseline" and headline.provisional
    assert headline.deploy == "run /out/deploy/engine_command.sh (the baseline)"
