"""Workloads: the prompts a trial replays, split into a warm-up part and a measurement part.

A workload is a bundled name (`code-edit`, `free-text`, `templated`) or a user file of prompts:
- JSONL: one JSON object per line; Parquet: one row per prompt. Fields: `prompt` (non-empty string) or `messages`
  (OpenAI chat messages, the last one the user's: see `chat`), exactly one of them; `id` (string or integer,
  optional, unique), `max_new_tokens` (integer >= 1, optional), `output` (string, optional: a recorded answer, used
  only to build a corpus). Any other field is an error (a misspelt `max_new_token` would otherwise be silently
  ignored). Blank JSONL lines are skipped.
- JSON (`.json`): ShareGPT-style conversations (`chat.read_sharegpt`). A traffic capture (`serve/closed_loop/capture.py`) is a
  Parquet file of this schema, so `--workload captured.parquet` replays production traffic.

Chat prompts are sent so the engine applies the model's chat template exactly as production does
(`pipeline/measure/load.py`); `Prompt.text` of a chat prompt is only a readable view.

Splits (`split_prompts`, pure): the prompt list is shuffled once with `random.Random(seed)`; the measurement split
is the first `n_measure` prompts of that order and the warm-up split the next `n_warmup`. So the measurement split
depends only on the workload, the seed and `n_measure`: trials that differ in warm-up length measure the same
prompts, which keeps their numbers and their equivalence checks comparable. The two splits never share a prompt.
If the workload is too small, the splits are cycled deterministically and `Workload.notes` says so.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.workloads._bundled import BUILDERS
from pipeline.workloads.chat import Messages, check_messages, read_sharegpt, readable

BUNDLED_WORKLOADS: tuple[str, ...] = tuple(BUILDERS)
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".parquet", ".json")
ROW_FIELDS: tuple[str, ...] = ("prompt", "messages", "id", "max_new_tokens", "output")
DEFAULT_MAX_NEW_TOKENS = 24  # = WorkloadSettings.max_new_tokens (a unit test holds them equal); callers pass theirs


class WorkloadError(PipelineError, ValueError):
    """A workload name or file is wrong; the message names the file, the line (or row) and the field."""


@dataclass(frozen=True)
class Prompt:
    """One prompt. `index` is its position in the whole workload (stable across splits and seeds)."""

    index: int
    id: str
    text: str
    max_new_tokens: int
    messages: Messages | None = None  # a chat prompt: sent through the chat template (see pipeline/measure/load.py)
    output: str | None = None  # a recorded answer (captures, ShareGPT): corpus material, never sent


@dataclass(frozen=True)
class Workload:
    """A resolved workload. `digest` (sha1 of every prompt's id, text and max_new_tokens) identifies the exact data,
    e.g. the code-edit text of this Python version; `cycled` is True when a split repeats prompts."""

    name: str
    seed: int
    n_available: int
    warmup: tuple[Prompt, ...]
    measure: tuple[Prompt, ...]
    cycled: bool
    notes: tuple[str, ...]
    digest: str


def load_workload(
    name_or_path: str | Path, *, seed: int, n_warmup: int, n_measure: int,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> Workload:
    """Resolve a bundled name or a JSONL/Parquet file and split it (module docstring). Deterministic for a seed.

    `max_new_tokens` applies to prompts whose row does not set its own.
    """
    prompts, notes = read_prompts(name_or_path, max_new_tokens=max_new_tokens)
    warmup, measure, split_notes = split_prompts(prompts, seed=seed, n_warmup=n_warmup, n_measure=n_measure)
    digest = hashlib.sha1(
        json.dumps([[p.id, p.text, p.max_new_tokens] + ([p.messages] if p.messages else []) for p in prompts],
                   ensure_ascii=False).encode("utf-8")
    ).hexdigest()
    return Workload(
        name=str(name_or_path), seed=seed, n_available=len(prompts), warmup=warmup, measure=measure,
        cycled=bool(split_notes), notes=tuple(notes + split_notes), digest=digest)


def read_prompts(
    name_or_path: str | Path, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> tuple[list[Prompt], list[str]]:
    """Every prompt of a workload in its fixed order, plus notes (e.g. skipped code-edit functions)."""
    _check_count("max_new_tokens", max_new_tokens, 1)
    name = str(name_or_path)
    if name in BUILDERS:
        pairs, notes = BUILDERS[name]()
        return [Prompt(i, pid, text, max_new_tokens) for i, (pid, text) in enumerate(pairs)], notes
    path = Path(name_or_path)
    if path.suffix not in FILE_SUFFIXES:
        close = difflib.get_close_matches(name, BUNDLED_WORKLOADS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise WorkloadError(
            f"workload {name!r} is neither a bundled workload nor a prompt file: {hint}bundled workloads are "
            f"{', '.join(BUNDLED_WORKLOADS)}; files must end in {' or '.join(FILE_SUFFIXES)}")
    if not path.is_file():
        raise WorkloadError(f"workload file {str(path)!r} does not exist (a path relative to {Path.cwd()} or absolute)")
    if path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".json":
        rows = read_sharegpt(path, WorkloadError)
    else:
        rows = _parquet_rows(path)
    prompts: list[Prompt] = []
    where_of: dict[str, str] = {}
    for where, default_id, row in rows:
        prompt = _prompt_from_row(row, where, len(prompts), default_id, max_new_tokens)
        if prompt.id in where_of:
            raise WorkloadError(
                f"{where}: field 'id' must be unique, but {prompt.id!r} is also used at {where_of[prompt.id]}")
        where_of[prompt.id] = where
        prompts.append(prompt)
    if not prompts:
        raise WorkloadError(f"workload file {str(path)!r} contains no prompts")
    return prompts, []


def split_prompts(
    prompts: Sequence[Prompt], *, seed: int, n_warmup: int, n_measure: int,
) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...], list[str]]:
    """(warm-up, measurement, notes): disjoint seeded splits, cycled if there are too few prompts. Pure.

    When the workload is short, the measurement split keeps as many distinct prompts as it can while leaving the
    warm-up at least min(n_warmup, max(1, n // 4)) prompts of its own; then each split repeats its prompts in order.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise WorkloadError(f"seed must be an integer, got seed={seed!r}")
    _check_count("n_warmup", n_warmup, 0)
    _check_count("n_measure", n_measure, 1)
    n = len(prompts)
    if n == 0 or (n_warmup and n < 2):
        raise WorkloadError(
            f"a workload of {n} prompt(s) cannot give disjoint warm-up and measurement splits "
            f"(workload.warmup_prompts={n_warmup}, workload.measure_prompts={n_measure}); add prompts or set "
            "workload.warmup_prompts: 0 (--set workload.warmup_prompts=0)")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    shuffled = [prompts[i] for i in order]
    if n >= n_warmup + n_measure:
        return tuple(shuffled[n_measure:n_measure + n_warmup]), tuple(shuffled[:n_measure]), []
    reserve = min(n_warmup, max(1, n // 4))
    m = min(n_measure, n - reserve)
    w = min(n_warmup, n - m)
    measure, warmup = _cycle(shuffled[:m], n_measure), _cycle(shuffled[m:m + w], n_warmup)
    note = (f"only {n} prompts for {n_warmup} warm-up + {n_measure} measurement requests: the measurement split "
            f"uses {m} distinct prompts and the warm-up split {w}, each cycled in order")
    if m < n_measure:
        note += ("; repeated measurement prompts can be answered from a warm n-gram trie, which flatters n-gram "
                 "speculation, so use a larger workload for numbers you report")
    return warmup, measure, [note]


def _cycle(pool: Sequence[Prompt], k: int) -> tuple[Prompt, ...]:
    return tuple(pool[i % len(pool)] for i in range(k)) if pool else ()


def _check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise WorkloadError(f"{name} must be an integer >= {low}, got {name}={value!r}")


def _jsonl_rows(path: Path) -> list[tuple[str, str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); JSONL files must be UTF-8") from exc
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                "each line must be one object such as {\"prompt\": \"...\"}") from exc
        rows.append((where, f"{path.stem}:{lineno}", row))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, str, object]]:
    import pyarrow.parquet as pq  # only file workloads need it

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged or foreign file
        raise WorkloadError(f"{path}: not a readable Parquet file ({exc})") from exc
    if "prompt" not in table.column_names and "messages" not in table.column_names:
        raise WorkloadError(f"{path}: column 'prompt' is required (a non-empty string), or 'messages' for chat "
                            f"prompts; columns are {table.column_names}")
    # A column present in the file is present in every row; a row's null means "not set" (e.g. a capture holding
    # both plain and chat requests).
    return [(f"{path}: row {i}", f"{path.stem}:{i}", {k: v for k, v in row.items() if v is not None})
            for i, row in enumerate(table.to_pylist(), start=1)]


def unencodable(value: object, field: str = "") -> tuple[str, str] | None:
    """(the field's path, the first lone surrogate as U+XXXX) for the first string in a row that UTF-8 cannot
    encode, else None. `json.loads` accepts an unpaired `\\ud83d` escape; the engine's request and the workload's
    digest cannot encode it. Pure."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return field, f"U+{ord(value[exc.start]):04X} at character {exc.start}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = unencodable(item, f"{field}.{key}" if field else str(key))
        if found is not None:
            return found
    return None


def _prompt_from_row(row: object, where: str, index: int, default_id: str, default_max_new_tokens: int) -> Prompt:
    if not isinstance(row, dict):
        raise WorkloadError(f"{where}: each row must be an object with a 'prompt' field, got {type(row).__name__}")
    unknown = sorted(set(row) - set(ROW_FIELDS))
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {unknown}; allowed fields are {list(ROW_FIELDS)} "
                            "(remove the others)")
    bad_text = unencodable(row)
    if bad_text is not None:
        field, char = bad_text
        raise WorkloadError(f"{where}: field {field!r} holds a lone surrogate ({char}), which is not text: no "
                            "request can carry it as UTF-8 (a JSON escape such as \\ud83d without its pair). "
                            "Fix: repair or drop the row")
    messages: Messages | None = None
    if "prompt" in row and "messages" in row:
        raise WorkloadError(f"{where}: give either 'prompt' (plain text) or 'messages' (chat), not both")
    if "messages" in row:
        messages = check_messages(row["messages"], where, WorkloadError)
        text = readable(messages)
    else:
        given = row.get("prompt")
        if not isinstance(given, str) or not given.strip():
            raise WorkloadError(f"{where}: field 'prompt' must be a non-empty string, got prompt={given!r}")
        text = given
    output = row.get("output")
    if output is not None and not isinstance(output, str):
        raise WorkloadError(f"{where}: field 'output' must be a string, got {type(output).__name__}")
    pid = row.get("id")
    if pid is None:
        pid = default_id
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)) or (isinstance(pid, str) and not pid.strip()):
        raise WorkloadError(f"{where}: field 'id' must be a non-empty string or an integer, got id={pid!r}")
    limit = row.get("max_new_tokens")
    if limit is None:
        limit = default_max_new_tokens
    else:
        # Parquet written from pandas turns an integer column with gaps into floats; 64.0 is still 64.
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise WorkloadError(
                f"{where}: field 'max_new_tokens' must be an integer >= 1, got max_new_tokens={limit!r}")
    return Prompt(index=index, id=str(pid), text=text, max_new_tokens=limit, messages=messages, output=output)
