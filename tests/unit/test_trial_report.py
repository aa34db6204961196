"""The trial's report to Tune is one typed record: what the driver writes is what the console, the searchers and
resume read back (pipeline/vocabulary/report.py)."""

from pipeline.vocabulary.outcome import MEASURING, NO_REPORT, Outcome
from pipeline.vocabulary.report import TrialReport


def test_a_measured_trial_crosses_tune_and_comes_back_the_same():
    report = TrialReport(said=Outcome.COMPLETE.value, run_id="r1", label="ngram d=8", reason="",
                         metrics={"tput_tok_s": 31.5}, accept_len=2.25, tput_noise=0.03, measurement_flag="clean",
                         window_remeasured=1, tput_spread=0.02, sla={"sla.ttft_p95_ms": 120.0})
    flat = report.to_tune()
    assert flat == {"outcome": "COMPLETE", "mlflow_run_id": "r1", "label": "ngram d=8", "reason": "",
                    "tput_tok_s": 31.5, "accept_len": 2.25, "tput_noise": 0.03, "tput_spread": 0.02,
                    "measurement_flag": "clean", "window_remeasured": 1, "sla.ttft_p95_ms": 120.0}
    back = TrialReport.from_tune({**flat, "time_total_s": 12.5})  # Tune adds its own keys
    assert back == TrialReport(**{**report.__dict__, "seconds": 12.5})
    assert back.outcome is Outcome.COMPLETE and back.metric("tput_tok_s") == 31.5


def test_a_failed_trial_keeps_only_what_it_has():
    flat = TrialReport(said=Outcome.LAUNCH_FAILED.value, reason="out of memory", load_failure="oom",
                       metrics={"tput_tok_s": 0.0}).to_tune()
    assert flat == {"outcome": "LAUNCH_FAILED", "mlflow_run_id": "", "label": "", "reason": "out of memory",
                    "load_failure": "oom", "tput_tok_s": 0.0}
    assert TrialReport.from_tune(flat).load_failure == "oom"


def test_an_intermediate_report_and_no_report_are_told_apart_from_an_ending():
    chunk = TrialReport.from_tune({"outcome": MEASURING, "measured_requests": 4, "tput_tok_s": 20.0})
    assert chunk.intermediate and chunk.outcome is None
    nothing = TrialReport.from_tune(None)
    assert nothing.said == NO_REPORT and nothing.outcome is None and not nothing.intermediate
