"""Resume on the real stack (local Ray, CPU engine, MLflow and Optuna on SQLite), from a copy of the session's
finished study: a changed study is refused, a trial left RUNNING in Optuna never wedges `--resume` on Tune's restore
path, and a new budget is honoured (issue #15 item 13)."""

from __future__ import annotations

import shutil

import optuna
import pytest
from optuna.trial import TrialState

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.search.space import load_space
from pipeline.study.driver import run_study

pytestmark = pytest.mark.integration


def copy_of(finished_study, tmp_path, **overrides):
    study, out, code = finished_study
    assert code == 0
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    data = {**study.model_dump(mode="json"), "output_dir": str(copy)}
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return load_study(None, data), copy


def optuna_study(study, folder):
    return optuna.load_study(study_name=study.name, storage=f"sqlite:///{folder / 'optuna.db'}")


def test_resume_with_a_changed_workload_is_refused_naming_it(finished_study, tmp_path):
    study, folder = copy_of(finished_study, tmp_path, **{"workload.max_new_tokens": 16})
    before = len(optuna_study(study, folder).trials)
    with pytest.raises(PipelineError) as err:
        run_study(study, load_space(study.search_space_path()), resume=True)
    assert "--resume refused" in str(err.value) and "workload:" in str(err.value)
    assert len(optuna_study(study, folder).trials) == before


def test_a_trial_left_running_in_optuna_does_not_wedge_the_restore_path(finished_study, tmp_path, capsys):
    study, folder = copy_of(finished_study, tmp_path)
    orphan = optuna_study(study, folder).ask()  # asked after Tune's last checkpoint, never reported
    code = run_study(study, load_space(study.search_space_path()), resume=True)
    assert code == 0, capsys.readouterr().out[-3000:]  # before: 130 on every --resume, forever
    assert optuna_study(study, folder).trials[orphan.number].state is TrialState.FAIL
    assert f"trial(s) [{orphan.number}] were never checkpointed by Tune" in capsys.readouterr().out


def test_a_new_budget_on_resume_is_honoured(finished_study, tmp_path, capsys):
    study, folder = copy_of(finished_study, tmp_path, **{"budget.max_trials": 4})
    assert run_study(study, load_space(study.search_space_path()), resume=True) == 0
    out = capsys.readouterr().out
    assert "budget changed on resume: 3 -> 4 trials" in out
    finished = [t for t in optuna_study(study, folder).trials if t.state.is_finished()]
    assert len(finished) == 4
