"""What makes a resume safe: the study it continues is the same study, and no trial is left hanging.

A study's outputs (the baseline's reference outputs, Optuna's history, the trial records) only mean something for
one search space, one workload, one model on one engine. `identity.json` in the output folder records those the
first time; `--resume` with any of them changed is refused with the names of what changed (a new study is the
honest answer: another `--name` or `--output`), rather than silently comparing new trials with old outputs.

The budget (`budget.max_trials`) and the promotion policy may change on resume: they decide how much more to run and
how to choose, not what a measurement means.

An interrupted study (Ctrl-C) is known from Tune's own checkpoint (`tune_unfinished`), and a trial that had already
reported when it was interrupted counts with that report on resume (`recorded_reports`) instead of being measured
again. Pure apart from `read_identity` / `write_identity` / `saved_tune_trials`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.atomic import write_text_atomic
from pipeline.config import StudyConfig
from pipeline.errors import PipelineError
from pipeline.vocabulary.report import TrialReport

IDENTITY_FILE = "identity.json"


def digest(value: Any) -> str:
    """A short, stable fingerprint of JSON-able data."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def workload_digest(prompts: Sequence[tuple[int, str, int]], temperature: float) -> str:
    """Fingerprint of exactly what the trials send: (index, text, max_new_tokens) of every warm-up and measured
    prompt, in order, and the temperature (greedy outputs are compared, sampled ones are not)."""
    return digest({"prompts": [list(p) for p in prompts], "temperature": temperature})


def study_identity(study: StudyConfig, space_dump: dict[str, Any], workload: str) -> dict[str, str]:
    """The parts of a study that give its measurements their meaning, as readable strings (shown when they differ)."""
    engine = study.engine
    return {
        "search space": f"{study.search_space} (sha256 {digest(space_dump)})",
        "workload": f"{study.workload.source} (sha256 {workload})",
        "model": json.dumps(study.model.model_dump(mode="json"), sort_keys=True),
        # weights only when set: "auto" (the default) leaves the identity of studies recorded before it existed
        "engine": json.dumps({"kind": engine.kind, "tp_size": engine.tp_size, "extra_flags": engine.extra_flags,
                              "env": sorted(engine.env),
                              **({"weights": engine.weights} if engine.weights != "auto" else {})}, sort_keys=True),
        "objective": json.dumps(study.objective.model_dump(mode="json"), sort_keys=True),
        "concurrency": str(study.concurrency[0]),
        # closed loop vs an arrival rate: trials measured under both would not compare
        "arrival": json.dumps(study.workload.arrival.model_dump(mode="json"), sort_keys=True),
    }


def identity_changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """One line per identity key that differs, naming the key, the recorded and the current value. Pure."""
    return [f"{key}: was {recorded.get(key, '(not recorded)')}, now {current[key]}"
            for key in current if key in recorded and recorded[key] != current[key]]


IDENTITY_ATTR = "specdec.identity"  # the same record on the Optuna study, for a new driver folder on a shared DB


def read_identity(out: Path) -> dict[str, Any] | None:
    path = out / IDENTITY_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: cannot read the recorded study identity ({exc}); it is written atomically, so "
                            "this file was edited or damaged by hand: restore it, or start a new study") from None


def write_identity(out: Path, identity: dict[str, str], max_trials: int) -> None:
    write_text_atomic(out / IDENTITY_FILE, json.dumps({"identity": identity, "max_trials": max_trials}, indent=2))


def check_resume(recorded: dict[str, Any] | None, identity: dict[str, str], where: object) -> None:
    """Refuse to continue a study (`where`: its folder or its Optuna study) whose meaning differs from this one;
    raises PipelineError naming every change."""
    if recorded is None:
        return  # a study from before identity.json: nothing to compare with (it is written now)
    changes = identity_changes(recorded.get("identity", {}), identity)
    if changes:
        raise PipelineError(
            f"--resume refused: {where} holds a study whose meaning differs from this one:\n"
            + "\n".join(f"  - {c}" for c in changes)
            + "\nIts baseline outputs and trial history belong to the recorded settings. Fix: resume with the "
              "recorded settings, or start a new study with another --name or --output.")


def budget_note(recorded: dict[str, Any] | None, max_trials: int) -> str | None:
    """A line telling the user the budget changed on resume (it is honoured), or None."""
    before = (recorded or {}).get("max_trials")
    if before is None or before == max_trials:
        return None
    return f"budget changed on resume: {before} -> {max_trials} trials (trials already finished count towards it)"


def settle_running(ot_study: Any) -> list[int]:
    """Fail every Optuna trial still RUNNING: its driver or Tune trial is gone and will never report it. Returns the
    trial numbers settled. Call only when no trial of this study is running (before Tune starts, or after it
    finished without being interrupted)."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    from optuna.trial import TrialState

    settled = []
    for trial in ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        ot_study.tell(trial.number, state=TrialState.FAIL)
        settled.append(trial.number)
    return settled


def finished_trials(ot_study: Any) -> int:
    """Trials that count towards the budget: every finished one (COMPLETE, PRUNED or FAIL)."""
    return sum(1 for t in ot_study.get_trials(deepcopy=False) if t.state.is_finished())


@dataclass(frozen=True)
class SavedTrial:
    """One trial as Tune's last experiment checkpoint holds it: what `Tuner.restore` would resume."""

    trial_id: str
    status: str  # Tune's: PENDING, RUNNING, PAUSED, TERMINATED or ERROR
    report: dict[str, Any]  # the trial's last `tune.report`, without the keys Tune adds itself ({} if none)


TUNE_FINISHED = ("TERMINATED", "ERROR")


def saved_tune_trials(tune_path: Path) -> list[SavedTrial]:
    """The trials of Tune's newest experiment checkpoint in `tune_path` (written by `fit()` before it returns)."""
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray.tune import ExperimentAnalysis
    from ray.tune.result import AUTO_RESULT_KEYS

    added = {*AUTO_RESULT_KEYS, "done", "trial_id", "experiment_tag"}  # Tune's bookkeeping, not the trial's report
    return [SavedTrial(t.trial_id, str(t.status), {k: v for k, v in (t.last_result or {}).items() if k not in added})
            for t in ExperimentAnalysis(str(tune_path)).trials]


def tune_unfinished(saved: Sequence[SavedTrial]) -> list[str]:
    """Trials Tune's checkpoint holds neither TERMINATED nor ERROR: only an interrupt (Ctrl-C) leaves those, and a
    restore runs them again. Read from the checkpoint, not from the ResultGrid `fit()` returns: on Ctrl-C Tune
    checkpoints first and then stops the running trials, which marks them TERMINATED in that grid (Ray 2.60,
    `tune.run`), so the grid hides the interrupt. A time budget stops trials before the checkpoint: TERMINATED."""
    return [t.trial_id for t in saved if t.status not in TUNE_FINISHED]


def recorded_reports(saved: Sequence[SavedTrial]) -> dict[str, dict[str, Any]]:
    """{trial id: final report} of the unfinished trials whose final report Tune already holds (Ctrl-C came after
    the trial reported but before Tune told Optuna). A restore must count that report, not measure the trial again.
    An intermediate report (outcome MEASURING, early stopping) is not a result: that trial is run again."""
    return {t.trial_id: dict(t.report) for t in saved
            if t.status not in TUNE_FINISHED and t.report.get("outcome") is not None
            and not TrialReport.from_tune(t.report).intermediate}


PROMOTED_FILE = "promoted.yaml"  # written by the promotion (pipeline/study/finalize.py): the study decided
REPORT_PAGE = Path("report") / "report.html"  # written at the end of every finished study, decided or not
STUDY_FILE = "study.yaml"


def finished_evidence(out: Path) -> str | None:
    """What in `out` says its study finished (decided, its records written), in words; None when nothing does."""
    promoted = out / PROMOTED_FILE
    if promoted.is_file():
        try:
            data = yaml.safe_load(promoted.read_text()) or {}
            provenance = data.get("provenance") or {}
            what = f"decision {provenance.get('decision', '?')}, serving {provenance.get('source', '?')}"
        except (OSError, ValueError, AttributeError, ImportError):
            what = "unreadable"
        return f"{promoted} ({what})"
    if (out / REPORT_PAGE).is_file():
        return f"{out / REPORT_PAGE} (the study's final report)"
    return None


def start_problem(out: Path, resume: bool, finished: str | None, recorded_trials: int | None, max_trials: int,
                  in_storage: bool | None) -> str | None:
    """Why this command must not start on `out` (None: it may). `finished`: `finished_evidence(out)`;
    `recorded_trials`: the budget `identity.json` records; `in_storage`: whether the shared Optuna storage holds
    the study (None: no shared storage). A finished study is continued only to search more (a larger budget). Pure."""
    if finished is not None and (not resume or recorded_trials is None or max_trials <= recorded_trials):
        verb = "--resume refused" if resume else "refused"
        done = f"its {recorded_trials} trials are done and decided" if recorded_trials else "it is decided"
        return (f"{verb}: {out} holds a finished study ({done}): {finished}. Running it again would measure its "
                "finalists again and replace its records. Fix: start a new study with another --name or --output, "
                f"or search more with --resume --trials N (N > {recorded_trials or 'its budget'})")
    if resume and not (out / STUDY_FILE).is_file() and not (out / IDENTITY_FILE).is_file() and not in_storage:
        where = f"{out} has no {STUDY_FILE}" + ("" if out.exists() else " (the folder does not exist)")
        shared = "" if in_storage is None else " and the shared storage.url holds no study of this name"
        return (f"--resume refused: nothing to resume: {where}{shared}. Fix: drop --resume to start the study, or "
                "give the --name/--output of the study to continue")
    return None


def stored_study_exists(storage_url: str, name: str) -> bool:
    """Whether an Optuna storage holds a study `name` (a new driver folder on a shared database continues it). A
    SQLite file that does not exist holds none (and is not created by asking)."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna

    if storage_url.startswith("sqlite:///") and not Path(storage_url[len("sqlite:///"):].split("?", 1)[0]).exists():
        return False
    return name in optuna.study.get_all_study_names(storage=storage_url)


def check_start(out: Path, resume: bool, name: str, max_trials: int, storage_url: str | None) -> None:
    """Refuse a finished study (unless resumed with a larger budget), and a `--resume` of one that does not exist,
    naming what was found."""
    finished = finished_evidence(out)
    recorded = read_identity(out) if finished is not None else None
    recorded_trials = (recorded or {}).get("max_trials")
    in_storage = None
    if resume and finished is None and not (out / STUDY_FILE).is_file() and storage_url:
        in_storage = stored_study_exists(storage_url, name)
    problem = start_problem(out, resume, finished, recorded_trials if isinstance(recorded_trials, int) else None,
                            max_trials, in_storage)
    if problem:
        raise PipelineError(problem)
