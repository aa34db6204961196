"""The HTML report renders for a study with one trial, with every trial failed, and with many trials."""

import optuna
import pytest

from pipeline.records.report import write_report


def row(name, algorithm, outcome, tput=None, accept=None, **params):
    return {"name": name, "algorithm": algorithm, "outcome": outcome, "reason": "", "tput_tok_s": tput,
            "tput_ci_low": tput and tput * 0.9, "tput_ci_high": tput and tput * 1.1, "accept_len": accept,
            "ttft_p50_ms": 10.0, "params": {k.replace("__", "."): str(v) for k, v in params.items()},
            "baseline": algorithm == "none", "vs_baseline": None}


def finished_study(values):
    study = optuna.create_study(direction="maximize")
    for i, value in enumerate(values):
        trial = study.ask()
        trial.suggest_int("ngram.num_draft_tokens", 2, 12)
        trial.suggest_int("ngram.warmup_requests", 0, 16)
        study.tell(trial, value)
    return study


def check(files):
    names = {p.name for p in files}
    assert "report.html" in names and "throughput.png" in names and "pareto_front.png" in names
    for path in files:
        assert path.stat().st_size > 1000, path
    page = [p for p in files if p.name == "report.html"][0].read_text()
    assert page.count("<img") == len(files) - 1
    return page


def test_one_trial(tmp_path):
    page = check(write_report(tmp_path, title="one", rows=[row("trial-0", "none", "COMPLETE", 20.0)],
                              decision="keep baseline", ot_study=finished_study([20.0])))
    assert "keep baseline" in page and "trial-0" in page


def test_all_trials_failed(tmp_path):
    rows = [row("trial-0", "none", "LAUNCH_FAILED"), row("trial-1", "ngram", "INVALID")]
    study = optuna.create_study()
    page = check(write_report(tmp_path, title="failed", rows=rows, decision="no baseline", ot_study=study))
    assert "LAUNCH_FAILED" in page


def test_no_rows_at_all(tmp_path):
    assert "(no trials recorded)" in check(write_report(tmp_path, title="empty", rows=[], decision="-"))


@pytest.mark.parametrize("objectives", [(["tput_tok_s"], ["max"]), (["tput_tok_s", "ttft_p50_ms"], ["max", "min"])])
def test_many_trials(tmp_path, objectives):
    rows = [row("trial-0", "none", "COMPLETE", 20.0)]
    for i in range(1, 30):
        rows.append(row(f"trial-{i}", "ngram", "COMPLETE" if i % 7 else "NOT_EQUIVALENT", 15.0 + i, 1.0 + i / 10,
                        spec__num_draft_tokens=2 + i % 10, trial__warmup_requests=4 * (i % 5)))
        rows[-1]["ttft_p50_ms"] = 100.0 - i
    metrics, modes = objectives
    check(write_report(tmp_path, title="many", rows=rows, decision="promote trial-29",
                       ot_study=finished_study([float(i) for i in range(29)]), metrics=metrics, modes=modes))
