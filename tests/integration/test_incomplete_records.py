"""A study's end when a record cannot be written: the finalize stage of a study whose trials are in a real MLflow
store (SQLite) and a real Optuna study, with the report's page on a device that refuses every write as a full disk
does (/dev/full: ENOSPC from the kernel). The study still decides and registers, says which record is missing and
why, names what is intact, and ends with exit code 3, the measured runs untouched. No Ray or engine: the finalize
stage with `promotion.finalists: 0` measures nothing. And a store the OS refuses to grow (RLIMIT_FSIZE in a child
process): the study run's end is said one line per record, with no SQL store traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.records.gaps import GAPS, INCOMPLETE_EXIT, conclude
from pipeline.records.registry import load_serving_config
from pipeline.records.tracking import Tracker, default_tracking_uri
from pipeline.study.finalize import finalize_study
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.outcome import Outcome

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full (Linux) answers writes with ENOSPC")]

SPACE = "algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 2, high: 4}\n"


def measured_study(tmp_path: Path) -> tuple[TrialContext, optuna.Study]:
    """A search that measured the baseline and one n-gram trial, as the trials log them."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "space.yaml").write_text(SPACE)
    study = load_study(None, {"name": "it-full", "output_dir": str(out), "search_space": str(tmp_path / "space.yaml"),
                              "budget.max_trials": 2, "promotion.finalists": 0})
    tracker = Tracker(default_tracking_uri(out), study.name, artifact_dir=out / "mlartifacts")
    parent = tracker.start_study(study.name, "name: it-full\n", resume=False)
    for trial_id, config, tput in (("t0", TrialConfig(), 10.0),
                                   ("t1", TrialConfig.model_validate({"spec": {"algorithm": "ngram"}}), 12.0)):
        tracker.log_trial(parent, study_name=study.name, run_name=config.spec.algorithm, kind="trial",
                          trial_id=trial_id, config=config.model_dump(mode="json"), outcome=Outcome.COMPLETE,
                          reason="", metrics={"tput_tok_s": tput}, requests=None, texts={})
    ot_study = optuna.create_study(study_name=study.name, storage=f"sqlite:///{out / 'optuna.db'}")
    ctx = TrialContext(study=study, output_dir=str(out), serve_url="http://127.0.0.1:9", tracker=tracker,
                       parent_run_id=parent, warmup=(), measure=())
    return ctx, ot_study


def test_a_report_the_disk_refuses_ends_the_study_with_3_naming_it_and_what_is_intact(tmp_path, capsys):
    ctx, ot_study = measured_study(tmp_path)
    out = Path(ctx.output_dir)
    (out / "report").mkdir()
    (out / "report" / "report.html").symlink_to("/dev/full")  # every write to it: "No space left on device"
    GAPS.clear()

    code = conclude(finalize_study(ctx, ot_study), out, ctx.tracker, ctx.parent_run_id)  # as the driver ends

    printed = capsys.readouterr().out
    assert code == INCOMPLETE_EXIT == 3, printed[-4000:]
    assert "Traceback" not in printed
    block = printed[printed.index("the study's records are INCOMPLETE"):]
    assert f"  - the study report ({out / 'report' / 'report.html'} and its copy in MLflow): No space left on " \
           f"device" in block, block
    assert "2 measured trial and finalist run(s) in MLflow" in block and f"the deploy files in {out / 'deploy'}" in block
    assert "registered specdec-it-full version 1" in block and "exit code 3" in block
    # nothing measured was lost, and the decision was acted on as in a whole study
    runs = ctx.tracker.trial_runs(ctx.parent_run_id)
    assert sorted(r.data.metrics["tput_tok_s"] for r in runs) == [10.0, 12.0]
    served = load_serving_config(ctx.tracker.tracking_uri, "models:/specdec-it-full@production")
    assert served.replica.spec.algorithm == "none"
    parent = ctx.tracker.client().get_run(ctx.parent_run_id)
    assert parent.data.tags["decision"] == "keep_baseline" and parent.info.status == "FINISHED"


# A child process whose files may not grow past 4 kB (SIGXFSZ ignored: the write fails with EFBIG instead of the
# process dying), as a full disk refuses them: every write to the MLflow store and its artifacts is refused by the OS.
CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from pipeline.records.gaps import conclude, quiet_store_tracebacks
    from pipeline.records.tracking import Tracker
    from pipeline.vocabulary.outcome import Outcome

    out = Path(sys.argv[1])
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", "full", artifact_dir=out / "artifacts")
    parent = tracker.start_study("full", "name: full\\n", resume=False)
    tracker.log_trial(parent, study_name="full", run_name="none", kind="trial", trial_id="t0",
                      config={"spec": {"algorithm": "none"}}, outcome=Outcome.COMPLETE, reason="",
                      metrics={"tput_tok_s": 10.0}, requests=None, texts={})
    quiet_store_tracebacks()  # as `python -m pipeline.tune` sets it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    tracker.finish_study(parent, tags={"decision": "keep_baseline"}, metrics={"bar": 1.0},
                         texts={"decision.txt": "keep the baseline " * 1000})
    sys.exit(conclude(0, out, tracker, parent))
""")


def test_a_store_that_refuses_writes_ends_the_study_run_with_3_and_no_traceback(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    printed = done.stdout + done.stderr
    assert done.returncode == 3, printed[-4000:]
    assert "Traceback" not in printed, printed[-4000:]
    block = done.stdout[done.stdout.index("the study's records are INCOMPLETE"):]
    assert "  - the study run's tags (decision, mlflow.note.content)" not in block  # no description was given
    # each cause is the OS's or the database's own line: SQLite's write refused, a file refused past the limit
    assert "  - the study run's tags (decision): MlflowException: (sqlite3.OperationalError) disk I/O error" in block
    assert "  - the study run's artifact decision.txt: File too large" in block
    assert "  - the study run's end status (FINISHED): MlflowException: (sqlite3.OperationalError) " in block
    assert "1 measured trial and finalist run(s) in MLflow" in block
    # the measured run is intact in the store once the limit is gone
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "full")
    (run,) = [r for r in tracker.all_runs() if r.data.tags.get("specdec.kind") == "trial"]
    assert run.data.metrics["tput_tok_s"] == 10.0
