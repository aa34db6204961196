"""The study's up-front checks: everything `python -m pipeline.tune` can check before Ray starts or a file is written.

Run by the CLI for a real run and for `--dry-run` alike, after the study and its search space loaded. Each problem
is a `PipelineError` naming the setting, the value and the fix (the CLI prints one line and exits 2); nothing here
writes, creates or connects to anything:
- the output folder is a folder (or can be created), and writable;
- the tracking URI is one the study can use: SQLite whose file (or the folder it would be created in) is writable,
  or a server URL; MLflow 3's file store (`file://`, a bare path) is refused, since MLflow keeps it in maintenance
  mode and fails inside the study; the Optuna storage URL likewise when it is SQLite;
- the model (and the draft models of the search space's algorithms) exist, when given as local paths and the
  engines run on this machine; a model id the engine does not know is refused with the close match and the known
  ids; on this machine, a model too big for the CPU SGLang would run on, and an engine that is not installed, are
  refused with the install command (`pipeline/preflight_engine.py`);
- the workload loads (a missing, empty or malformed file is refused here, not after two failed trials) and no
  prompt is longer than `MAX_PROMPT_CHARS`.
So a study that starts can write its files; one that cannot leaves nothing behind (no identity.json, optuna.db or
study.yaml to refuse the corrected retry with "pass --resume").
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.config import StudyConfig
from pipeline.errors import PipelineError
from pipeline.preflight_engine import engine_problems
from pipeline.records.tracking import default_tracking_uri
from pipeline.workloads import load_workload, read_prompts
from serve.engines import engine_for

if TYPE_CHECKING:
    from pipeline.search.space import SearchSpace

__all__ = ["MAX_PROMPT_CHARS", "check_study", "check_output", "check_tracking_uri", "check_sqlite_url",
           "check_model", "check_workload"]

# No served context holds more (1,000,000 characters are ~250k tokens), and the production endpoint's default body
# limit is 1 MB: a longer workload prompt is a mistake in the file (a whole document pasted into one line).
MAX_PROMPT_CHARS = 1_000_000


def check_study(study: StudyConfig, space: SearchSpace | None = None, install: bool = True) -> None:
    """Every up-front check, in the order a user fixes them; raises PipelineError at the first problem. `space`: the
    study's search space (its algorithms say which draft models are used; None = all of them). `install`: check the
    engine's install here too (the dry run reports it with its other findings instead, `engine_problems`)."""
    out = study.output_path()
    check_output(out)

    check_tracking_uri(study.tracking.uri or default_tracking_uri(out), "tracking.uri (--tracking-uri)")
    if study.storage.url:
        check_sqlite_url(study.storage.url, "storage.url (--storage)")

    problems = engine_problems(study, install=install)  # model ids; on this machine: the CPU's size, the install
    if problems:
        raise PipelineError(problems[0])
    if study.ray.address is None:  # the engines run here: a path the model names must exist here
        check_model(study, None if space is None else space.algorithms)
    check_workload(study)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_folder(folder: Path, what: str) -> None:
    """`folder` exists as a writable folder, or could be created (its nearest existing ancestor is one)."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise PipelineError(f"{what}: {str(existing)!r} is a file, so {str(folder)!r} cannot be created as a "
                            "folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PipelineError(f"{what}: {str(existing)!r} is not writable by this user, so {str(folder)!r} cannot be "
                            "written; choose a folder you can write to")


def check_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise PipelineError(f"--output {str(out)!r} is a file, not a folder; give a folder (created if missing)")
    _writable_folder(out, f"--output {str(out)!r}")


def check_sqlite_url(url: str, what: str) -> None:
    """A `sqlite:///PATH` URL whose database can be opened for writing (others are not checked here)."""
    if not url.startswith("sqlite:"):
        return
    raw = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
    if not raw or raw == ":memory:":
        return
    path = Path(unquote(raw.split("?", 1)[0]))
    if path.exists():
        if not path.is_file():
            raise PipelineError(f"{what}: {str(path)!r} is not a file; give sqlite:///<folder>/<name>.db")
        if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
            raise PipelineError(f"{what}: {str(path)!r} (or its folder, where SQLite writes its journal) is not "
                                "writable by this user; fix its permissions or give another sqlite:/// path")
        return
    _writable_folder(path.parent, f"{what} ({url})")


def check_tracking_uri(uri: str, what: str = "tracking.uri") -> None:
    scheme = urlparse(uri).scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and uri[1:3] in (":\\", ":/")):  # a path, or C:\ on Windows
        raise PipelineError(f"{what}: {uri!r} is MLflow's file store, which MLflow 3 keeps in maintenance mode and "
                            "which fails inside a study; use sqlite:///<folder>/mlflow.db (the default: "
                            "sqlite under the output folder) or an http(s):// tracking server")
    check_sqlite_url(uri, what)


def check_model(study: StudyConfig, algorithms: Sequence[str] | None = None) -> None:
    """The target, and the draft of each of `algorithms` (None: every draft named): a draft model.drafts names for
    an algorithm the search space never proposes is not used, so not checked (an NGRAM-only study keeps the
    study file's EAGLE-3 path for another space)."""
    engine = engine_for(study.engine.kind)
    named = [("model.target (--model)", study.model.target),
             *((f"model.drafts.{algorithm}", path) for algorithm, path in sorted(study.model.drafts.items())
               if algorithms is None or algorithm in algorithms)]
    for where, model in named:
        problem = engine.model_problem(model, where)
        if problem:
            raise PipelineError(problem)


def check_workload(study: StudyConfig) -> None:
    """Bound each prompt's length (any line of the file), then load the workload as the study will (its split)."""
    settings = study.workload
    prompts, _ = read_prompts(settings.source, max_new_tokens=settings.max_new_tokens)
    for prompt in prompts:
        size = len(prompt.text) + sum(len(content) for _, content in prompt.messages or ())
        if size > MAX_PROMPT_CHARS:
            raise PipelineError(f"workload {settings.source!r}: prompt {prompt.id!r} has {size:,} characters, more "
                                f"than the {MAX_PROMPT_CHARS:,} any engine's context could hold; shorten or drop it")
    load_workload(settings.source, seed=study.seed, n_warmup=settings.warmup_prompts,
                  n_measure=settings.measure_prompts, max_new_tokens=settings.max_new_tokens)
