"""pipeline.workloads: bundled workloads, user files, and the seeded warm-up / measurement splits."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.workloads import (
    BUNDLED_WORKLOADS, Prompt, WorkloadError, load_workload, read_prompts, split_prompts,
)

# Prompts must stay under ~400 tokens (the CPU engine's small models). Measured once with the SmolLM2-135M tokenizer:
# 3.0 (templated JSON/YAML) to 4.4 (free text) characters per token, longest prompt 341 tokens (code-edit, 1256
# characters). 1300 characters at the densest 3.0 characters per token stays near 430 tokens.
MAX_PROMPT_CHARS = 1300


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def indices(prompts) -> list[int]:
    return [p.index for p in prompts]


# --- bundled ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUNDLED_WORKLOADS)
def test_bundled_names_resolve_to_enough_small_prompts(name):
    prompts, notes = read_prompts(name, max_new_tokens=96)
    assert notes == []  # on this Python every code-edit function has source
    assert len(prompts) >= 40
    assert indices(prompts) == list(range(len(prompts)))
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.text for p in prompts}) == len(prompts)
    assert all(p.max_new_tokens == 96 for p in prompts)
    assert max(len(p.text) for p in prompts) <= MAX_PROMPT_CHARS


def test_bundled_names_cover_the_four_workloads():
    assert set(BUNDLED_WORKLOADS) == {"code-edit", "free-text", "templated", "reasoning"}


def test_code_edit_prompt_holds_the_stdlib_source_and_a_rename():
    prompts, _ = read_prompts("code-edit")
    first = next(p for p in prompts if p.id.startswith("textwrap.indent:"))
    source = textwrap.dedent(inspect.getsource(textwrap.indent))
    assert source in first.text
    old = first.id.split(":")[1]
    assert f"with `{old}` renamed to `new_{old}`:\n```python\n" in first.text
    assert first.text.endswith("```python\n")
    assert f"`{old}`" in first.text and old in source


def test_code_edit_is_rebuilt_identically():
    assert read_prompts("code-edit")[0] == read_prompts("code-edit")[0]


def test_templated_prompts_reuse_the_same_documents():
    prompts, _ = read_prompts("templated")
    docs = {p.id.split("#")[0] for p in prompts}
    assert len(docs) == 5 and len(prompts) == 40
    # Any 10 consecutive prompts already edit every document twice: the answers repeat across requests.
    assert {p.id.split("#")[0] for p in prompts[:10]} == docs


def test_free_text_prompts_do_not_contain_code_or_documents():
    prompts, _ = read_prompts("free-text")
    assert all("```" not in p.text and len(p.text) < 200 for p in prompts)


def test_unknown_name_suggests_the_closest_bundled_one():
    with pytest.raises(WorkloadError, match="did you mean 'code-edit'"):
        load_workload("code_edit", seed=0, n_warmup=1, n_measure=1)


# --- splits -----------------------------------------------------------------------------------------------------

def test_splits_are_deterministic_and_disjoint():
    a = load_workload("code-edit", seed=11, n_warmup=20, n_measure=16)
    b = load_workload("code-edit", seed=11, n_warmup=20, n_measure=16)
    assert a == b
    assert len(a.warmup) == 20 and len(a.measure) == 16
    assert not set(indices(a.warmup)) & set(indices(a.measure))
    assert not a.cycled and a.notes == ()


def test_another_seed_gives_another_split():
    a = load_workload("free-text", seed=0, n_warmup=8, n_measure=8)
    b = load_workload("free-text", seed=1, n_warmup=8, n_measure=8)
    assert indices(a.measure) != indices(b.measure)
    assert a.digest == b.digest  # same data, different split


def test_measurement_split_does_not_depend_on_warmup_length():
    cold = load_workload("templated", seed=3, n_warmup=0, n_measure=8)
    warm = load_workload("templated", seed=3, n_warmup=24, n_measure=8)
    assert cold.measure == warm.measure
    assert cold.warmup == ()
    # a longer warm-up extends a shorter one
    assert load_workload("templated", seed=3, n_warmup=10, n_measure=8).warmup == warm.warmup[:10]


def test_short_workload_cycles_deterministically_and_says_so(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    w = load_workload(path, seed=0, n_warmup=3, n_measure=6)
    # reserve min(3, max(1, 4 // 4)) = 1 prompt for warm-up; measurement keeps the other 3, each used twice.
    assert len(set(indices(w.measure))) == 3 and len(w.measure) == 6
    assert w.measure[:3] == w.measure[3:]
    assert len(set(indices(w.warmup))) == 1 and len(w.warmup) == 3
    assert not set(indices(w.warmup)) & set(indices(w.measure))
    assert w.cycled and "only 4 prompts" in w.notes[0] and "flatters n-gram" in w.notes[0]
    assert load_workload(path, seed=0, n_warmup=3, n_measure=6) == w


def test_split_needs_two_prompts_for_two_disjoint_parts():
    one = [Prompt(0, "a", "text", 8)]
    with pytest.raises(WorkloadError, match="cannot give disjoint warm-up and measurement splits"):
        split_prompts(one, seed=0, n_warmup=1, n_measure=1)
    warm, measure, notes = split_prompts(one, seed=0, n_warmup=0, n_measure=3)
    assert warm == () and measure == tuple(one * 3) and notes


@pytest.mark.parametrize(("kw", "message"), [
    ({"n_warmup": -1, "n_measure": 4}, "n_warmup must be an integer >= 0, got n_warmup=-1"),
    ({"n_warmup": 0, "n_measure": 0}, "n_measure must be an integer >= 1, got n_measure=0"),
])
def test_bad_split_sizes(kw, message):
    with pytest.raises(WorkloadError, match=message):
        load_workload("free-text", seed=0, **kw)


# --- user files -------------------------------------------------------------------------------------------------

def test_jsonl_file_with_ids_and_max_new_tokens(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"prompt": "Hello", "id": "greet", "max_new_tokens": 8},
        "",
        {"prompt": "World", "id": 7},
        {"prompt": "Again"},
    ])
    prompts, _ = read_prompts(path, max_new_tokens=32)
    assert [(p.index, p.id, p.text, p.max_new_tokens) for p in prompts] == [
        (0, "greet", "Hello", 8), (1, "7", "World", 32), (2, "mine:4", "Again", 32)]


def test_parquet_file(tmp_path):
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "max_new_tokens": [4.0, None, 6.0]}), path)
    prompts, _ = read_prompts(path, max_new_tokens=9)
    assert [(p.id, p.max_new_tokens) for p in prompts] == [("mine:1", 4), ("mine:2", 9), ("mine:3", 6)]


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "ok"}, {"text": "hi"}], r"bad.jsonl:2: unknown field\(s\) \['text'\]"),
    ([{"prompt": "ok"}, {"id": "x"}], r"bad.jsonl:2: field 'prompt' must be a non-empty string, got prompt=None"),
    ([{"prompt": "  "}], r"bad.jsonl:1: field 'prompt' must be a non-empty string"),
    ([{"prompt": 5}], r"bad.jsonl:1: field 'prompt' must be a non-empty string, got prompt=5"),
    ([{"prompt": "a", "max_new_tokens": 0}], r"bad.jsonl:1: field 'max_new_tokens' must be an integer >= 1"),
    ([{"prompt": "a", "max_new_tokens": True}], r"bad.jsonl:1: field 'max_new_tokens' must be an integer >= 1"),
    ([{"prompt": "a", "max_new_token": 3}], r"unknown field\(s\) \['max_new_token'\]"),
    ([{"prompt": "a", "id": ["x"]}], r"bad.jsonl:1: field 'id' must be a non-empty string or an integer"),
    ([{"prompt": "a", "id": "x"}, {"prompt": "b", "id": "x"}], r"bad.jsonl:2: field 'id' must be unique.*bad.jsonl:1"),
    (['{"prompt": "a"', ], r"bad.jsonl:1: not valid JSON"),
    (['["a"]'], r"bad.jsonl:1: each row must be an object"),
    ([""], r"contains no prompts"),
])
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(WorkloadError, match=message):
        load_workload(path, seed=0, n_warmup=0, n_measure=1)


def test_bad_parquet_files(tmp_path):
    no_prompt = tmp_path / "noprompt.parquet"
    pq.write_table(pa.table({"text": ["a"]}), no_prompt)
    with pytest.raises(WorkloadError, match=r"noprompt.parquet: column 'prompt' is required"):
        read_prompts(no_prompt)
    bad_row = tmp_path / "badrow.parquet"
    pq.write_table(pa.table({"prompt": ["a", None]}), bad_row)
    with pytest.raises(WorkloadError, match=r"badrow.parquet: row 2: field 'prompt' must be a non-empty string"):
        read_prompts(bad_row)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(WorkloadError, match=r"garbage.parquet: not a readable Parquet file"):
        read_prompts(garbage)


def test_missing_file_and_unsupported_suffix(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(WorkloadError, match=r"files must end in \.jsonl or \.parquet"):
        read_prompts(csv)


def test_non_utf8_jsonl(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(WorkloadError, match="not UTF-8 text"):
        read_prompts(path)
