"""A traffic capture -> the re-tune's warm-up and measurement prompts and its corpus, with no measured answer in the
corpus. Pure, apart from `read_capture` (Parquet parts) and `write_workload` (one Parquet file).

A capture (`serve/closed_loop/capture.py`) is rows of the workload schema: `id` = `<route>:<unix ms>:<random>`, `prompt` or
`messages`, `max_new_tokens`, `output` (the answer production gave). The split:
1. rows answered since `since_ms` (the last promotion) are kept; older rows, and rows whose id carries no time, are
   counted and left out;
2. rows are grouped by prompt (the same text, or the same messages, asked again is one prompt): a prompt belongs to
   one split only, so a repeated question cannot be measured while its earlier answer sits in the corpus or warmed
   the engine;
3. the groups are shuffled with `seed`; the first `n_measure` are the measurement split, the next `n_warmup` that do
   not quote a measured answer the warm-up split; every row of the other groups, warm-up ones included, is corpus
   material;
4. leak guard: a corpus row whose prompt or answer contains any measured answer verbatim (any answer ever captured
   for a measured prompt, stripped, non-empty) is dropped and counted: a templated answer shared by many prompts is
   measured, never also handed to the engine in the corpus.
Measured answers never reach the workload file either: it holds prompts only (`write_workload`); what a config
answers is compared with the baseline's answers of the same run, never with the captured ones.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from pipeline.workloads import Prompt, split_prompts
from serve.closed_loop.files import open_regular
from serve.spec import FrozenModel

__all__ = ["CaptureRow", "SplitReport", "CaptureSplit", "row_time_ms", "prompt_key", "select_since", "split_capture",
           "guard_corpus", "read_capture", "workload_rows", "write_workload"]

CaptureRow = Mapping[str, Any]
WORKLOAD_COLUMNS = ("id", "prompt", "messages", "max_new_tokens")


class SplitReport(FrozenModel):
    since_ms: int | None
    rows: int = Field(description="rows in the capture")
    older: int = Field(description="rows answered before since_ms")
    untimed: int = Field(description="rows whose id holds no time")
    prompts: int = Field(description="distinct prompts since since_ms")
    measure: int
    warmup: int
    corpus: int = Field(description="corpus rows kept")
    corpus_dropped: int = Field(description="corpus rows dropped because they contain a measured answer")

    @property
    def text(self) -> str:
        since = "all time" if self.since_ms is None else f"since {self.since_ms} ms"
        return (f"capture: {self.rows} rows, {self.rows - self.older - self.untimed} {since} "
                f"({self.prompts} distinct prompts; {self.older} older, {self.untimed} without a time left out) -> "
                f"{self.measure} measured, {self.warmup} warm-up, {self.corpus} corpus rows ({self.corpus_dropped} "
                "dropped: they contain a measured answer)")


class CaptureSplit(FrozenModel):
    measure: tuple[dict[str, Any], ...]
    warmup: tuple[dict[str, Any], ...]
    corpus: tuple[dict[str, Any], ...]
    measured_answers: tuple[str, ...]
    report: SplitReport


def row_time_ms(row_id: Any) -> int | None:
    """The unix ms in a capture id `<route>:<ms>:<random>`; None for any other id."""
    parts = str(row_id).split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def prompt_key(row: CaptureRow) -> str:
    """What makes two rows the same prompt: the messages (JSON, whitespace-normalised) or the prompt text."""
    messages = row.get("messages")
    if messages:
        parsed = json.loads(messages) if isinstance(messages, str) else messages
        return "chat:" + json.dumps(parsed, sort_keys=True, ensure_ascii=False)
    return "text:" + str(row.get("prompt") or "")


def prompt_text(row: CaptureRow) -> str:
    """The prompt's text as a reader sees it (chat: the messages' contents in order)."""
    messages = row.get("messages")
    if messages:
        parsed = json.loads(messages) if isinstance(messages, str) else messages
        return "\n".join(str(m.get("content", "")) for m in parsed if isinstance(m, dict))
    return str(row.get("prompt") or "")


def select_since(rows: Iterable[CaptureRow], since_ms: int | None) -> tuple[list[CaptureRow], int, int]:
    """(rows answered at or after `since_ms`, how many were older, how many had no time). None = every timed row."""
    kept, older, untimed = [], 0, 0
    for row in rows:
        at = row_time_ms(row.get("id"))
        if at is None:
            untimed += 1
        elif since_ms is not None and at < since_ms:
            older += 1
        else:
            kept.append(row)
    return kept, older, untimed


def guard_corpus(texts: Sequence[str], measured_answers: Sequence[str]) -> tuple[list[int], list[int]]:
    """(indices of texts kept, indices dropped): a text containing any measured answer verbatim is dropped."""
    answers = [a for a in measured_answers if a]
    kept: list[int] = []
    dropped: list[int] = []
    for i, text in enumerate(texts):
        (dropped if any(a in text for a in answers) else kept).append(i)
    return kept, dropped


def split_capture(rows: Iterable[CaptureRow], *, n_measure: int, n_warmup: int, seed: int,
                  since_ms: int | None = None) -> CaptureSplit:
    """The split of the module docstring. Raises ValueError when there are fewer distinct prompts than
    n_measure + n_warmup (the message says how many there are and how to get more). Pure."""
    for name, value, low in (("n_measure", n_measure, 1), ("n_warmup", n_warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {name}={value!r}")
    everything = list(rows)
    recent, older, untimed = select_since(everything, since_ms)
    groups: dict[str, list[CaptureRow]] = {}
    for row in sorted(recent, key=lambda r: row_time_ms(r.get("id")) or 0):
        groups.setdefault(prompt_key(row), []).append(row)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    if len(keys) < n_measure + n_warmup:
        raise ValueError(
            f"capture: {len(keys)} distinct prompts since the last promotion, fewer than the {n_measure} measured + "
            f"{n_warmup} warm-up prompts the re-tune needs. Fix: wait for more traffic, raise the capture's "
            "sample_rate, or measure fewer prompts (--measure-prompts / --warmup-prompts)")
    measure_keys = keys[:n_measure]
    answers = sorted({str(r.get("output") or "").strip() for k in measure_keys for r in groups[k]} - {""})
    # A warm-up prompt that quotes a measured answer (a conversation continued) would show it to the engine.
    clean = [k for k in keys[n_measure:] if not guard_corpus([prompt_text(groups[k][-1])], answers)[1]]
    warmup_keys = clean[:n_warmup]
    if len(warmup_keys) < n_warmup:
        raise ValueError(
            f"capture: only {len(warmup_keys)} prompts outside the measurement split do not quote a measured answer; "
            f"the re-tune needs {n_warmup} warm-up prompts. Fix: wait for more traffic or lower --warmup-prompts")
    material = [r for k in keys[n_measure:] for r in groups[k]]
    kept, dropped = guard_corpus([prompt_text(r) + "\n" + str(r.get("output") or "") for r in material], answers)

    def newest(key: str) -> dict[str, Any]:  # a repeated prompt is replayed once, as it was last asked
        return dict(groups[key][-1])

    report = SplitReport(since_ms=since_ms, rows=len(everything), older=older, untimed=untimed, prompts=len(keys),
                         measure=len(measure_keys), warmup=len(warmup_keys), corpus=len(kept),
                         corpus_dropped=len(dropped))
    return CaptureSplit(measure=tuple(newest(k) for k in measure_keys), warmup=tuple(newest(k) for k in warmup_keys),
                        corpus=tuple(dict(material[i]) for i in kept), measured_answers=tuple(answers), report=report)


def workload_rows(split: CaptureSplit, seed: int) -> list[dict[str, Any]]:
    """The measurement and warm-up rows in the file order that makes `pipeline.workloads.load_workload(file,
    seed=seed, n_warmup=len(warmup), n_measure=len(measure))` give back exactly this split (its own seeded split is
    asked where each position lands). Prompts only: no `output` column."""
    n = len(split.measure) + len(split.warmup)
    slots = [Prompt(index=i, id=str(i), text=str(i), max_new_tokens=1) for i in range(n)]
    warm_slots, measure_slots, notes = split_prompts(slots, seed=seed, n_warmup=len(split.warmup),
                                                     n_measure=len(split.measure))
    if notes:  # cannot happen with n == n_warmup + n_measure; a changed split rule must not go unnoticed
        raise RuntimeError(f"workload split cycled a capture split of {n} prompts: {notes}")
    ordered: list[dict[str, Any] | None] = [None] * n
    for slot, row in zip(measure_slots, split.measure):
        ordered[slot.index] = row
    for slot, row in zip(warm_slots, split.warmup):
        ordered[slot.index] = row
    return [{c: r.get(c) for c in WORKLOAD_COLUMNS} for r in ordered if r is not None]


def write_workload(rows: Sequence[Mapping[str, Any]], path: str | Path, with_output: bool = False) -> Path:
    """The rows as a Parquet workload file (the capture's schema; `output` only when asked), 0600 from its first
    byte like the capture it comes from (`serve.closed_loop.capture.write_private`)."""
    # lazy: pyarrow only where Parquet is read or written, not for a command's --help
    import pyarrow as pa
    import pyarrow.parquet as pq

    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI)
    from serve.closed_loop.capture import write_private

    columns = WORKLOAD_COLUMNS + (("output",) if with_output else ())
    types = {"id": pa.string(), "prompt": pa.string(), "messages": pa.string(), "max_new_tokens": pa.int64(),
             "output": pa.string()}
    table = pa.table({c: [r.get(c) for r in rows] for c in columns}, schema=pa.schema([(c, types[c]) for c in columns]))
    target = Path(path)
    write_private(lambda handle: pq.write_table(table, handle), target)
    return target


def read_capture(directory_or_file: str | Path) -> list[dict[str, Any]]:
    """Every row of a capture directory's parts (`part-*.parquet`, regular files only: a FIFO or a link named like a
    part is skipped, never opened) or of one merged capture file."""
    # lazy: pyarrow only where Parquet is read or written, not for a command's --help
    import pyarrow.parquet as pq

    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI)
    from serve.closed_loop.capture import part_files

    path = Path(directory_or_file)
    parts = part_files(path) if path.is_dir() else [path] if path.is_file() else []
    if not parts:
        raise ValueError(f"capture: no part-*.parquet files in {str(path)!r} (is capture on, and has the endpoint "
                         "answered sampled requests?)")
    rows: list[dict[str, Any]] = []
    for part in parts:
        with os.fdopen(open_regular(part), "rb") as handle:
            rows.extend(pq.read_table(handle).to_pylist())
    return rows
