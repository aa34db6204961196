"""The capture split (pipeline/loop/split.py) on rows written by the endpoint's own capture writer
(`serve.closed_loop.capture.Capture`): no measured answer in the corpus, a prompt in one split only, the workload file gives the
study exactly the split, and too small a capture is refused with the numbers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.loop.split import (guard_corpus, prompt_text, read_capture, row_time_ms, split_capture, workload_rows,
                                 write_workload)
from pipeline.workloads import load_workload
from serve.closed_loop.capture import Capture, CaptureSettings

TEMPLATED = "Thank you for your message. A member of our team will reply within one business day."


def captured(tmp_path: Path) -> list[dict]:
    """40 answered requests through the real capture: chat and completions, repeated questions, and a templated
    answer shared by many different prompts (the case a per-prompt split alone would leak)."""
    capture = Capture(CaptureSettings(dir=str(tmp_path / "parts"), sample_rate=1, flush_rows=7, seed=0), 64)
    for i in range(30):
        question = f"Where is my order number {i % 24}?"  # 6 questions asked twice
        answer = TEMPLATED if i % 3 == 0 else f"Order {i % 24} left the warehouse on day {i % 24 + 1}."
        capture.record("/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                                "max_tokens": 32}, answer)
    for i in range(10):
        capture.record("/v1/completions", {"prompt": f"def f{i}(x):\n    return", "max_tokens": 8}, f" x + {i}")
    capture.flush()
    return read_capture(tmp_path / "parts")


def test_no_measured_answer_reaches_the_corpus_and_a_prompt_sits_in_one_split(tmp_path):
    rows = captured(tmp_path)
    assert len(rows) == 40
    for seed in range(20):
        split = split_capture(rows, n_measure=8, n_warmup=4, seed=seed)
        measured = {prompt_text(r) for r in split.measure}
        answers = {str(r["output"]).strip() for r in rows if prompt_text(r) in measured}
        corpus_text = [prompt_text(r) + "\n" + str(r["output"]) for r in split.corpus]
        assert not [t for t in corpus_text for a in answers if a in t], seed
        assert set(split.measured_answers) == answers
        keys = [prompt_text(r) for r in (*split.measure, *split.warmup)]
        assert len(keys) == len(set(keys)) == 12
        assert not measured & {prompt_text(r) for r in split.corpus}
        assert split.report.measure == 8 and split.report.warmup == 4 and split.report.prompts == 34
        outside = sum(1 for r in rows if prompt_text(r) not in measured)
        assert split.report.corpus + split.report.corpus_dropped == outside
    # some seed measures a templated answer: every corpus row carrying it is dropped, and counted
    dropped = [split_capture(rows, n_measure=8, n_warmup=4, seed=s).report.corpus_dropped for s in range(20)]
    assert max(dropped) >= 5


def test_a_warm_up_prompt_never_quotes_a_measured_answer():
    rows = [{"id": f"chat:{1000 + i}:x{i}", "prompt": None, "max_new_tokens": 8, "output": f"answer {i} here",
             "messages": json.dumps([{"role": "user", "content": f"question {i}"}])} for i in range(6)]
    # a conversation continued: its earlier assistant turn is another row's answer
    rows += [{"id": f"chat:{2000 + i}:y{i}", "prompt": None, "max_new_tokens": 8, "output": "fine",
              "messages": json.dumps([{"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": f"answer {i} here"},
                                      {"role": "user", "content": "and then?"}])} for i in range(6)]
    for seed in range(10):
        split = split_capture(rows, n_measure=3, n_warmup=3, seed=seed)
        for row in split.warmup:
            assert not any(a in prompt_text(row) for a in split.measured_answers), seed


def test_only_rows_since_the_promotion_are_used():
    rows = [{"id": f"completions:{t}:ab", "prompt": f"p{t}", "messages": None, "max_new_tokens": 4, "output": "o"}
            for t in (100, 200, 300, 400)] + [{"id": "7", "prompt": "foreign", "messages": None,
                                               "max_new_tokens": 4, "output": "o"}]
    split = split_capture(rows, n_measure=1, n_warmup=1, seed=0, since_ms=250)
    assert {r["prompt"] for r in (*split.measure, *split.warmup)} == {"p300", "p400"}
    assert (split.report.older, split.report.untimed) == (2, 1)
    assert row_time_ms("chat:1712345678901:9f2c") == 1712345678901 and row_time_ms("free-text:3") is None


def test_too_small_a_capture_is_refused_with_the_counts_and_the_fix():
    rows = [{"id": f"completions:{t}:ab", "prompt": "same", "messages": None, "max_new_tokens": 4, "output": "o"}
            for t in range(5)]
    with pytest.raises(ValueError, match=r"1 distinct prompts since the last promotion, fewer than the 2 measured \+ "
                                         r"1 warm-up.*sample_rate"):
        split_capture(rows, n_measure=2, n_warmup=1, seed=0)


def test_the_workload_file_gives_the_study_exactly_this_split_and_no_answers(tmp_path):
    rows = captured(tmp_path)
    for seed in (0, 3, 11):
        split = split_capture(rows, n_measure=6, n_warmup=5, seed=seed)
        path = write_workload(workload_rows(split, seed), tmp_path / f"w{seed}.parquet")
        loaded = load_workload(path, seed=seed, n_warmup=5, n_measure=6)
        assert [p.id for p in loaded.measure] == [r["id"] for r in split.measure]
        assert [p.id for p in loaded.warmup] == [r["id"] for r in split.warmup]
        assert all(p.output is None for p in (*loaded.measure, *loaded.warmup))
        assert path.stat().st_mode & 0o777 == 0o600


def test_guard_corpus_drops_every_text_holding_an_answer():
    assert guard_corpus(["a b c", "x y", "the answer is 42!"], ["answer is 42", ""]) == ([0, 1], [2])


def test_capture_ids_carry_the_time_they_were_answered(tmp_path):
    before = int(time.time() * 1000)
    rows = captured(tmp_path)
    assert all(before <= (row_time_ms(r["id"]) or 0) <= int(time.time() * 1000) for r in rows)
