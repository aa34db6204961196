"""The report shows what the decision rests on: the study's details, each run the decision was taken on (its figure,
slot in the measuring order, flags), latency distributions and request timelines per level, and the simulated space
with the launched configs marked; every value is escaped; a history of two trials has an integer trial axis and one
trial draws none."""

import re

import optuna
from matplotlib.ticker import MaxNLocator

from pipeline.measure.summary import RequestRecord
from pipeline.records.report import write_report
from pipeline.records.report_data import ReportInputs, SpacePoint, StudyDetails, point_label, run_record
from pipeline.records.run_plots import plot_history, plot_space, plot_timeline
from tests.rows import trial_row

HOSTILE = "<script>alert(1)</script>"


def requests(level: int, n: int = 4, ttft: float = 0.05) -> list[RequestRecord]:
    return [RequestRecord(request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=level, start_s=0.1 * i,
                          ttft_s=ttft, e2e_s=0.4 + 0.01 * i, itl_s=(0.02, 0.03), prompt_tokens=20,
                          completion_tokens=8, finish_reason="length")
            for i in range(n)] + [RequestRecord(request_id="w", phase="warmup", prompt_index=9, concurrency=level,
                                                start_s=0.0, ttft_s=9.0, e2e_s=9.0, prompt_tokens=20,
                                                completion_tokens=8, finish_reason="length")]


def inputs(space: tuple[SpacePoint, ...] = ()) -> ReportInputs:
    runs = []
    for level in (1, 4):
        for k, (config, tput) in enumerate([("baseline", 10.0), ("ngram BFS d4", 13.0)] * 2):
            flags = ["window disturbed"] if (level, k) == (4, 3) else []
            runs.append(run_record(f"{config}-c{level}-run{k // 2 + 1}", config, level, k + 1, "COMPLETE",
                                   tput + k * 0.1, flags, requests(level)))
    details = StudyDetails(items=(("model", "smollm2-135m"), ("engine", "cpu specdec-cpu-engine 0.1"),
                                  ("hardware (the baseline engine's node)", "AMD EPYC, 2 CPUs"),
                                  ("project commit", HOSTILE)))
    return ReportInputs(details=details, runs=tuple(runs), finalist_stage=True, space=space)


def figure_ids(page: str) -> list[str]:
    return re.findall(r"<figure id='fig-([a-z_0-9]+)'>", page)


def test_the_page_shows_the_details_the_runs_and_a_latency_and_timeline_plot_per_level(tmp_path):
    rows = [trial_row("none", "none", tput_tok_s=10.0), trial_row("ngram BFS d4", tput_tok_s=13.0)]
    files = write_report(tmp_path, title="t", rows=rows, inputs=inputs())
    page = (tmp_path / "report.html").read_text()
    ids = figure_ids(page)
    assert {"latency_c1", "latency_c4", "timeline_c1", "timeline_c4"} <= set(ids)
    assert sorted(ids) == sorted(p.stem for p in files if p.suffix == ".png")  # every PNG shown, no other
    details = page[page.index('id="details-table"'):page.index("</table>", page.index('id="details-table"'))]
    assert "smollm2-135m" in details and "cpu specdec-cpu-engine 0.1" in details and "AMD EPYC" in details
    assert HOSTILE not in page and "&lt;script&gt;" in page  # a value is text, never markup
    table = page[page.index('id="runs-table"'):page.index("</table>", page.index('id="runs-table"'))]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)]
    cells = [c for c in cells if c]
    assert len(cells) == 8  # 2 configs x 2 runs x 2 levels
    assert [c[1] for c in cells[:4]] == ["1", "2", "3", "4"]  # the measuring order
    assert cells[0][5] == "10.0" and cells[0][6] == "4"  # its figure, and the measured requests only
    assert cells[-1][-1] == "window disturbed"
    assert page.index("id='headline'") < page.index('id="study-details"') < page.index('id="decision-runs"') \
        < page.index("fig-latency_c1") < page.index("fig-timeline_c1")


def test_a_search_only_study_says_its_runs_are_the_searchs(tmp_path):
    only = inputs().model_copy(update={"finalist_stage": False})
    write_report(tmp_path, title="t", rows=[], inputs=only)
    assert "The search's runs" in (tmp_path / "report.html").read_text()


def test_the_simulated_space_marks_the_launched_configs_with_what_they_measured(tmp_path):
    space = tuple(SpacePoint(label=f"p{i}", predicted=20.0 - i * 0.1, launched=i in (0, 5),
                             measured=18.0 if i == 0 else None) for i in range(120))
    fig = plot_space(space, "tput_tok_s")
    ax = fig.axes[0]
    by_label = {line.get_label(): line for line in ax.get_lines()}
    assert len(by_label["predicted (120 configs)"].get_xdata()) == 120
    assert list(by_label["launched: predicted"].get_xdata()) == [1, 6]
    assert list(by_label["launched: measured"].get_ydata()) == [18.0]
    assert "output tok/s" in ax.get_ylabel()
    write_report(tmp_path, title="t", rows=[], inputs=inputs(space))
    page = (tmp_path / "report.html").read_text()
    assert "fig-simulated_space" in page and "120 configs" in page and "launched 2 of them" in page
    assert plot_space(space[:1], "tput_tok_s") is False  # one point: nothing to rank


def test_a_timeline_draws_one_lane_per_measured_request_and_a_first_token_dot_each():
    runs = inputs().runs
    fig = plot_timeline(runs, 1)
    ax = fig.axes[0]
    assert len(ax.collections) == 16  # 4 runs x 4 measured requests (the warm-up request is not one)
    assert len([line for line in ax.get_lines() if line.get_marker() == "o"]) == 16
    assert plot_timeline(runs, 2) is False  # no run at that level


def test_two_trials_have_an_integer_history_axis_with_units_and_one_trial_none():
    study = optuna.create_study(direction="maximize")
    for value in (10.0, 12.5):
        study.tell(study.ask(), value)
    fig = plot_history(study, "tput_tok_s")
    ax = fig.axes[0]
    assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert "output tok/s" in ax.get_ylabel()
    one = optuna.create_study(direction="maximize")
    one.tell(one.ask(), 10.0)
    assert plot_history(one, "tput_tok_s") is False


def test_a_simulated_point_is_named_by_its_algorithm_and_values():
    assert point_label({"algorithm": "ngram", "ngram.num_draft_tokens": 8}) == "ngram num_draft_tokens=8"


def test_a_replaced_run_is_listed_but_left_out_of_the_latency_and_timeline_plots(tmp_path):
    kept = inputs().runs
    replaced = run_record("baseline-c1-run1-replaced", "baseline", 1, 1, "COMPLETE", 5.0,
                          ["not counted, replaced by baseline-c1-run3"], requests(1, n=3, ttft=9.0), counted=False)
    fig = plot_timeline([*kept, replaced], 1)
    assert len(fig.axes[0].collections) == 16  # the replaced run's 3 requests are not drawn
    write_report(tmp_path, title="t", rows=[], inputs=inputs().model_copy(update={"runs": (replaced, *kept)}))
    page = (tmp_path / "report.html").read_text()
    assert "baseline-c1-run1-replaced" in page and "not counted, replaced by baseline-c1-run3" in page
