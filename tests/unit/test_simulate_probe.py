"""The CPU engine's round table (serve/engines/cpu/probe.py `measure_round_cost`), measured on a tiny Llama built
here (no download): one cell per batch and width, the LM head per row count, the long-context step, cached with the
verify-cost curve, and readable by the pipeline's step-cost model. ~3 s."""

from __future__ import annotations

import pytest
import torch

from pipeline.simulate.cost import round_table
from serve.engines.cpu import probe
from serve.engines.cpu.runner import ModelRunner
from serve.engines.round_table import reproduces

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture()
def tiny_dir(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=1024))
    model.save_pretrained(tmp_path / "tiny")
    real = probe.measure_round_cost

    def steady(*args, **kwargs):
        # These tests are about the cache. The tiny model's cells take well under a millisecond, so a dip from this
        # machine's load (seen under a loaded test run) made a fresh table uncacheable and failed them: each cell is
        # raised to the largest narrower or smaller one (first_dip's own tests cover a dip).
        table = real(*args, **kwargs)
        ms = [list(row) for row in table["ms"]]
        for i, row in enumerate(ms):
            for j in range(len(row)):
                row[j] = max([row[j], *row[:j], *(ms[k][j] for k in range(i))])
        return {**table, "ms": ms}

    monkeypatch.setattr(probe, "measure_round_cost", steady)
    return tmp_path / "tiny"


def test_the_round_table_is_measured_once_per_key_and_the_cost_model_reads_it(tiny_dir, monkeypatch):
    monkeypatch.setattr(probe, "PROBE_WAIT_LIMIT", 1.0)  # the cache, not this machine's load, is under test here
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    curve = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))
    table = curve["round_cost"]
    assert table["batches"] == list(probe.ROUND_BATCHES) and table["widths"] == [1, 2, 4]
    assert [len(row) for row in table["ms"]] == [3] * len(probe.ROUND_BATCHES)
    assert all(ms > 0 for row in table["ms"] for ms in row) and len(table["lm_head_ms"]) == len(probe.LM_HEAD_ROWS)
    assert table["long_context_tokens"] == probe.LONG_CONTEXT_TOKENS and table["long_context_ms"] > 0
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))["round_cost"] == table  # cached
    model = round_table(curve)
    assert model is not None and model.verify_ms(3, 3, 5, 200) > 0


def busy_reading(before, after) -> dict:
    """Every probe waited for a core half its runnable time. (A tiny model's probe can run within one tick of the
    CPU-time counters, where the real reading is "unknown", never disturbed: a limit of -1 did not force it.)"""
    return {"wait_share": 0.5, "steal_share": 0.0}


def clean_table(ms):
    return {"disturbance": {"wait_share": 0.02, "steal_share": 0.0},
            "round_cost": {"batches": [1, 2], "widths": [1, 2, 3], "ms": ms}}


def test_a_table_measured_under_load_or_out_of_order_is_not_trusted():
    assert probe.table_problem(clean_table([[10.0, 11.0, 12.0], [12.0, 13.0, 14.0]])) is None
    assert probe.table_problem(clean_table([[10.0, 9.5, 12.0], [12.0, 13.0, 14.0]])) is None  # within the slack
    problem = probe.table_problem(clean_table([[10.0, 38.5, 31.3], [40.0, 41.0, 42.0]]))
    assert problem is not None and "width 3 measured 31.3 ms, below a narrower width's 38.5 ms" in problem
    problem = probe.table_problem(clean_table([[10.0, 11.0, 12.0], [6.0, 13.0, 14.0]]))
    assert problem is not None and "2 requests x width 1 measured 6.0 ms" in problem
    busy = {**clean_table([[10.0, 11.0, 12.0], [12.0, 13.0, 14.0]]), "disturbance": {"wait_share": 0.4}}
    assert "waited for a core 40%" in (probe.table_problem(busy) or "")
    unchecked = {"round_cost": clean_table([[1.0]])["round_cost"]}
    assert "no check" in (probe.table_problem(unchecked) or "")


def test_a_poisoned_cache_entry_is_refused_and_measured_again(tiny_dir, monkeypatch):
    import json

    monkeypatch.setattr(probe, "PROBE_WAIT_LIMIT", 1.0)  # this test is about the cache, not this machine's load
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))
    assert first["source"] == "measured" and "not_cached" not in first
    (entry_path,) = (tiny_dir.parent / "cache" / "probe").glob("*.json")
    entry = json.loads(entry_path.read_text())
    # a table measured while something else ran: width 2 three times width 1, width 4 back at width 1
    entry["curve"]["round_cost"]["ms"][0][:3] = [10.0, 30.0, 10.0]
    entry_path.write_text(json.dumps(entry))
    again = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))
    assert again["source"] == "measured" and "not monotone" in again["refused_cache"]
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))["source"] == "cache"  # re-stored
    entry = json.loads(entry_path.read_text())
    del entry["curve"]["disturbance"]  # an entry written before the probe checked itself
    entry_path.write_text(json.dumps(entry))
    assert "no check" in probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4)).get("refused_cache", "")


def test_a_probe_measured_under_load_is_kept_only_until_a_quieter_one(tiny_dir, monkeypatch):
    monkeypatch.setattr(probe, "probe_disturbance", busy_reading)  # every measurement reads as disturbed
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    curve = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    assert curve["source"] == "measured" and "waited for a core" in curve["disturbed"]
    # the next start does not trust it: it measures once more (and keeps whichever waited less)
    again = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    assert "waited for a core" in again["disturbed"] and again["measured_at"] >= curve["measured_at"]
    monkeypatch.setattr(probe, "PROBE_WAIT_LIMIT", 1.0)  # a quiet machine: the kept table is clean now
    quiet = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    assert quiet["source"] == "cache" and "disturbed" not in quiet


def test_a_machine_that_stays_busy_stops_paying_a_probe_every_start(tiny_dir, monkeypatch):
    monkeypatch.setattr(probe, "probe_disturbance", busy_reading)  # every measurement reads as disturbed
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    assert first["source"] == "measured"
    tries = [probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
             for _ in range(probe.PROBE_LATER_ATTEMPTS + 2)]
    # each of the next PROBE_LATER_ATTEMPTS starts measured once more (a new time, or the old table kept as the
    # quieter); after them the kept table is used as it is, still flagged, and no start measures it again
    (entry_path,) = (tiny_dir.parent / "cache" / "probe").glob("*.json")
    import json

    assert json.loads(entry_path.read_text())["later_attempts"] == probe.PROBE_LATER_ATTEMPTS
    settled = tries[probe.PROBE_LATER_ATTEMPTS:]
    assert all(t["source"] == "cache" and "waited for a core" in t["disturbed"] for t in settled)
    assert settled[0]["measured_at"] == settled[1]["measured_at"]
    measured = [t for t in tries if t["source"] == "measured"]
    assert len(measured) <= probe.PROBE_LATER_ATTEMPTS
    # a forced refresh measures again
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2), refresh=True)["source"] == "measured"


def test_a_table_still_disturbed_after_the_later_attempts_is_tried_again_an_hour_after_the_last(tiny_dir, monkeypatch):
    import json

    monkeypatch.setattr(probe, "probe_disturbance", busy_reading)  # every measurement reads as disturbed
    monkeypatch.setattr(probe, "PROBE_LATER_ATTEMPTS", 1)
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))  # the one later attempt
    (entry_path,) = (tiny_dir.parent / "cache" / "probe").glob("*.json")
    entry = json.loads(entry_path.read_text())
    assert entry["later_attempts"] == 1 and entry["last_attempt_at"] > 0
    settled = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    assert settled["source"] == "cache" and json.loads(entry_path.read_text()) == entry  # within the hour: as it is
    entry["last_attempt_at"] -= probe.PROBE_RETRY_S + 1  # the last attempt, an hour and a second ago
    entry_path.write_text(json.dumps(entry))
    probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2))
    retried = json.loads(entry_path.read_text())
    assert retried["later_attempts"] == 2 and retried["last_attempt_at"] > entry["last_attempt_at"] + probe.PROBE_RETRY_S


def dipped_table(scale: float):
    """A round table whose width-3 cell costs more than width 4 (torch's fp32 GEMM on 3 rows can), times `scale`."""
    def measure(runner, widths, *args, **kwargs):
        ms = [[scale * (10.0 * w if w != 3 else 60.0) for w in widths] for _ in probe.ROUND_BATCHES]
        for i, row in enumerate(ms):
            ms[i] = [cell * (1 + i) for cell in row]
        return {"batches": list(probe.ROUND_BATCHES), "widths": list(widths), "ms": ms, "lm_head_rows": [1],
                "lm_head_ms": [0.0], "context_tokens": 128, "long_context_tokens": 512, "short_context_ms": 10.0,
                "long_context_ms": 12.0}
    return measure


def test_a_dip_measured_alike_twice_on_a_quiet_machine_is_kept_as_measured(tiny_dir, monkeypatch):
    monkeypatch.setattr(probe, "probe_disturbance", lambda before, after: {"wait_share": 0.0, "steal_share": 0.0})
    tables = iter([dipped_table(1.0), dipped_table(1.05)])
    monkeypatch.setattr(probe, "measure_round_cost", lambda *a, **k: next(tables)(*a, **k))
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))
    assert first["source"] == "measured" and "not_cached" not in first
    assert first["round_cost"]["as_measured"] and "width 4" in first["reproduced_dip"]
    again = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))  # no third table to measure
    assert again["source"] == "cache" and again["round_cost"] == first["round_cost"]
    model = round_table(again)
    assert model is not None and model.verify_ms(1, 3, 1, 128) > model.verify_ms(1, 4, 1, 128)  # read as measured


def test_dips_that_do_not_reproduce_are_used_once_and_never_kept(tiny_dir, monkeypatch):
    monkeypatch.setattr(probe, "probe_disturbance", lambda before, after: {"wait_share": 0.0, "steal_share": 0.0})
    tables = iter([dipped_table(1.0), dipped_table(1.5)])  # the second reads 50% slower: not the same table
    monkeypatch.setattr(probe, "measure_round_cost", lambda *a, **k: next(tables)(*a, **k))
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    result = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))
    assert "not monotone" in result["not_cached"] and not result["round_cost"].get("as_measured")
    assert not list((tiny_dir.parent / "cache" / "probe").glob("*.json"))
    first = dipped_table(1.0)(None, (1, 2, 3, 4))
    assert reproduces(first, dipped_table(1.1)(None, (1, 2, 3, 4)))
    assert not reproduces(first, dipped_table(1.0)(None, (1, 2, 4, 3)))  # another shape


def test_a_dip_measured_alike_under_load_is_kept_until_a_quieter_measurement_of_it(tiny_dir, monkeypatch):
    readings = iter([0.3, 0.25, 0.05])  # two busy attempts at the first start, a quiet one at the next
    monkeypatch.setattr(probe, "probe_disturbance", lambda before, after: {"wait_share": next(readings),
                                                                           "steal_share": 0.0})
    tables = iter([dipped_table(1.0), dipped_table(1.05), dipped_table(0.97)])
    monkeypatch.setattr(probe, "measure_round_cost", lambda *a, **k: next(tables)(*a, **k))
    runner = ModelRunner.from_dir(tiny_dir, "float32", "fp32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))
    assert first["round_cost"]["as_measured"] and "waited for a core 25%" in first["disturbed"]
    second = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))  # one more attempt, quiet
    assert second["source"] == "measured" and "disturbed" not in second and second["round_cost"]["as_measured"]
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 3, 4))["source"] == "cache"
