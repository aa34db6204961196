"""A measurement window's checks (pipeline/measure/window.py) and the /proc readings they rest on
(serve/replica/usage.py): parsing captured text, judging fixed snapshots, and one real reading of this process."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pipeline.measure.server_info import PlainSteps, ServerInfo
from pipeline.measure.summary import RequestRecord
from pipeline.measure.window import (STEP_LIMIT, WAIT_LIMIT, Window, flag, judge_window, request_spread, step_ratio,
                                     window_record)
from pipeline.simulate.cost import plain_step
from serve.replica.usage import NodeCpu, Usage, node_cpu, pid_stat, read_usage, schedstat_wait_ns

STAT = ("cpu  246567 125423 69346 86998 2189 0 1588 7451 0 0\n"
        "cpu0 115155 61565 29883 58040 769 0 469 3910 0 0\n")


def test_node_cpu_splits_busy_idle_and_steal():
    cpu = node_cpu(STAT)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert cpu.busy_s == pytest.approx((246567 + 125423 + 69346 + 0 + 1588) * tick)
    assert cpu.idle_s == pytest.approx((86998 + 2189) * tick)
    assert cpu.steal_s == pytest.approx(7451 * tick)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        node_cpu("cpu0 1 2 3 4\n")


def test_pid_stat_reads_past_a_command_name_with_spaces_and_parentheses():
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    text = "4242 (python -m (x) y) S 1 4240 4240 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 0 0"
    assert pid_stat(text) == (4240, pytest.approx(300 * tick))


def test_schedstat_wait_is_the_second_field():
    assert schedstat_wait_ns("425068805 207956149 414\n") == 207956149


def usage(at: float, cpu: float | None, wait: float | None, busy: float = 0.0, idle: float = 0.0,
          steal: float = 0.0) -> Usage:
    return Usage(at_s=at, cpus=2, engine_processes=1, engine_threads=2, engine_cpu_s=cpu, engine_wait_s=wait,
                 node=NodeCpu(busy_s=busy, idle_s=idle, steal_s=steal), load1=1.0, runnable=2)


def record(i: int, tokens: int, e2e: float) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=1, start_s=float(i),
                         ttft_s=0.01, e2e_s=e2e, prompt_tokens=5, completion_tokens=tokens, finish_reason="length")


RECORDS = [record(0, 10, 1.0), record(1, 10, 0.5), record(2, 10, 2.0)]


def test_a_quiet_window_is_clean_and_carries_its_spread():
    window = judge_window(usage(10.0, 5.0, 0.1, busy=100, idle=50), usage(12.0, 8.8, 0.2, busy=104, idle=50),
                          RECORDS)
    assert window.disturbed is False and window.reasons == ()
    assert window.wall_s == pytest.approx(2.0)
    assert window.engine_cores == pytest.approx(1.9)
    assert window.wait_share == pytest.approx(0.1 / 3.9)
    assert window.others_cores == pytest.approx((4 - 3.8) / 2.0)
    assert window.tput_median == pytest.approx(10.0) and window.tput_mad == pytest.approx(5.0)
    assert window.spread == pytest.approx(0.5)
    assert "clean" in window.line()


def test_an_engine_that_waited_for_its_cores_is_disturbed():
    window = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=0), usage(2.0, 2.0, 1.0, busy=4, idle=0), RECORDS)
    assert window.disturbed is True
    assert window.wait_share is not None
    assert window.wait_share == pytest.approx(1 / 3) and window.wait_share > WAIT_LIMIT
    assert "waited for a core 33%" in window.reasons[0] and "DISTURBED" in window.line()


def test_steal_disturbs_a_window_even_when_the_engine_never_waited():
    window = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=0, steal=0),
                          usage(2.0, 2.0, 0.0, busy=3.0, idle=0.5, steal=0.5), RECORDS)
    assert window.disturbed is True and window.steal_share == pytest.approx(0.125)
    assert "steal" in window.reasons[0]


def test_a_window_without_readings_is_unchecked_never_disturbed():
    assert judge_window(None, None, RECORDS).disturbed is None
    no_engine = judge_window(usage(0.0, None, None), usage(1.0, None, None, busy=1, idle=1), RECORDS)
    assert no_engine.disturbed is False  # the node's steal could be judged, the engine's wait could not
    assert no_engine.wait_share is None and no_engine.engine_cores is None


def test_flags_and_records_name_the_recorded_window():
    clean = Window(wall_s=1.0, disturbed=False, wait_share=0.01, tput_median=10.0, tput_mad=1.0)
    bad = Window(wall_s=1.0, disturbed=True, wait_share=0.5, reasons=("x",))
    unchecked = Window(wall_s=0.0)
    assert flag([clean]) == "clean" and flag([bad, clean]) == "re-measured" and flag([bad, bad]) == "disturbed"
    assert flag([unchecked]) == "unchecked" and flag([]) == "unchecked"
    metrics, tags, texts = window_record([bad, clean])
    assert metrics["window_remeasured"] == 1.0 and metrics["window_wait_share"] == 0.01
    assert metrics["tput_spread"] == pytest.approx(0.1)
    assert tags["measurement_flag"] == "re-measured" and tags["measurement_window"].startswith("clean")
    assert [w["disturbed"] for w in json.loads(texts["windows.json"])] == [True, False]
    assert window_record([]) == ({}, {}, {})


def test_request_spread_skips_failed_and_empty_requests():
    failed = RequestRecord(request_id="f", phase="measure", prompt_index=9, concurrency=1, start_s=0.0, ttft_s=None,
                           e2e_s=1.0, prompt_tokens=5, completion_tokens=0, finish_reason="error", error="boom")
    assert request_spread([failed]) == (None, None)
    assert request_spread([*RECORDS, failed]) == (10.0, 5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_read_usage_sees_a_process_group_burn_cpu():
    # A group of its own (ours holds the test workers, whose short-lived children take their CPU time with them)
    import subprocess

    code = ("import sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\nprint('done', flush=True)\nsys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        before = read_usage(child.pid)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        after = read_usage(child.pid)
    finally:
        child.kill()
        child.wait()
    assert after.engine_processes == 1 and after.engine_threads >= 1
    assert after.engine_cpu_s is not None and before.engine_cpu_s is not None
    assert after.engine_cpu_s - before.engine_cpu_s >= 0.25
    assert after.node is not None and after.at_s > before.at_s
    assert read_usage(None).engine_cpu_s is None


def test_an_engine_that_barely_ran_is_not_judged_by_its_wait():
    # a hung engine waits its few milliseconds of CPU out behind anything: no verdict from that
    window = judge_window(usage(0.0, 1.0, 0.0, busy=0, idle=0), usage(20.0, 1.05, 0.05, busy=20, idle=20), RECORDS)
    assert window.wait_share is None and window.disturbed is False  # the node's steal was still judged


# --- steps against the engine's own calibration -------------------------------------------------------------------

def counters(rounds: int, ms: float, context: int) -> PlainSteps | None:
    """The engine's counters as its `/server_info` reports them, read at the boundary."""
    state = {"solo_plain_rounds": rounds, "solo_plain_ms": ms, "solo_plain_context": context, "other": 1}
    return ServerInfo.parse({"internal_states": [state]}).plain_steps


def calibrated_20ms(context: float) -> float:
    return 20.0 * (1 + (context - 100) / 1000)  # 20 ms at 100 tokens of context, 22 at 200


def test_the_step_ratio_is_the_windows_mean_step_over_the_calibrated_step_at_its_mean_context():
    # 10 steps between the snapshots, 240 ms in all, at a mean context of 200 tokens: 24 ms against 22
    assert step_ratio(counters(5, 100.0, 500), counters(15, 340.0, 2500), calibrated_20ms) == pytest.approx(24 / 22)
    assert step_ratio(counters(5, 100.0, 500), counters(12, 300.0, 1900), calibrated_20ms) is None  # 7 steps: too few
    assert step_ratio(None, counters(15, 340.0, 2500), calibrated_20ms) is None
    sglang = ServerInfo.parse({"internal_states": [{"num_finished_requests": 3}]})
    assert sglang.plain_steps is None and ServerInfo().plain_steps is None  # SGLang keeps no such counters


def test_steps_near_their_calibration_leave_the_window_clean_and_are_recorded():
    window = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=2), usage(2.0, 1.9, 0.01, busy=2, idle=2), RECORDS,
                          steps=1.1)
    assert window.disturbed is False and window.step_ratio == pytest.approx(1.1)
    assert "steps 1.10x calibrated" in window.line()
    metrics, _, _ = window_record([window])
    assert metrics["window_step_ratio"] == pytest.approx(1.1)


def test_steps_slower_than_the_limit_disturb_a_window_that_neither_waited_nor_lost_cpu_to_steal():
    window = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=2), usage(2.0, 1.9, 0.01, busy=2, idle=2), RECORDS,
                          steps=1.85)
    assert window.wait_share is not None and window.wait_share < WAIT_LIMIT and window.steal_share == 0
    assert window.disturbed is True and window.step_ratio is not None and window.step_ratio > STEP_LIMIT
    assert "plain steps took 1.85x its own calibrated step" in window.reasons[0]
    assert flag([window]) == "disturbed"
    assert judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=2), usage(2.0, 1.9, 0.01, busy=2, idle=2), RECORDS,
                        steps=1.85, step_limit=2.0).disturbed is False  # workload.step_limit


def test_the_step_check_judges_a_window_whose_node_could_not_be_read():
    assert judge_window(None, None, RECORDS, steps=2.0).disturbed is True
    assert judge_window(None, None, RECORDS, steps=1.0).disturbed is False
    assert judge_window(None, None, RECORDS).disturbed is None  # nothing to judge it by


def test_the_calibrated_plain_step_is_the_round_tables_width_one_cell_at_its_context():
    table = {"round_cost": {"batches": [1, 2], "widths": [1, 4], "ms": [[20.0, 30.0], [28.0, 50.0]],
                            "lm_head_rows": [1, 2, 4], "lm_head_ms": [5.0, 6.0, 8.0], "context_tokens": 128,
                            "long_context_tokens": 512, "short_context_ms": 20.0, "long_context_ms": 24.0}}
    step = plain_step(table)
    assert step is not None
    assert step(1, 128) == pytest.approx(20.0) and step(2, 128) == pytest.approx(28.0)
    assert step(1, 512) == pytest.approx(24.0)  # the table's longer-context step
    assert plain_step({"relative": [1.0]}) is None  # a curve without a round table: no calibration


def test_an_engine_that_waits_for_its_own_threads_is_not_disturbed_by_that_wait():
    """vLLM's baseline on a 2-core AMD EPYC, quiet: its processes ran 1.74 cores and waited 47% of their runnable
    time beside 0.25 cores of other work -- 3.25 core-seconds asked a second of 2 cores, so 1.25 of the 1.51 waited
    would have been waited with nothing else running. Only the wait beyond the engine's own demand is judged."""
    wall, cpu, wait = 5.472, 1.738 * 5.472, 0.465 / 0.535 * 1.738 * 5.472
    window = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=0), usage(wall, cpu, wait, busy=cpu + 0.252 * wall, idle=0),
                          RECORDS)
    own = (cpu + wait - 2 * wall) / (cpu + wait)
    assert window.wait_share == pytest.approx(0.465) and window.own_wait_share == pytest.approx(own)
    assert window.wait_share is not None and window.wait_share - own < WAIT_LIMIT and window.disturbed is False
    assert "for its own threads" in window.line()
    # the same engine beside a busy core: it ran 1 core, and what it waited beyond its own demand disturbs the window
    busy = judge_window(usage(0.0, 0.0, 0.0, busy=0, idle=0),
                        usage(wall, 1.0 * wall, 2.25 * wall, busy=2 * wall, idle=0), RECORDS)
    assert busy.disturbed is True and "beyond its own threads' demand" in busy.reasons[0]
