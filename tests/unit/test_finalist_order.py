"""The finalist stage's measuring order and the paired ratio (pipeline/decide/spread.py, pipeline/decide/levels.py),
and the `drift-steps` fault that slows successive engines (serve/engines/cpu/faults.py). Pure."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from pipeline.config import PromotionPolicy
from pipeline.decide.headline import speedup_spread, speedup_text
from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels
from pipeline.decide.spread import paired_ratios, run_order
from serve.engines.cpu.faults import FaultSpecError, count_start, install, parse_fault
from serve.spec import NoSpec


def test_interleaved_rounds_alternate_and_the_baseline_leads():
    assert run_order(3, 3) == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1), (0, 2), (1, 2), (2, 2)]
    assert run_order(2, 2, "sequential") == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for order in ("interleaved", "sequential"):
        plan = run_order(3, 4, order)  # type: ignore[arg-type]
        assert plan[0] == (0, 0) and sorted(plan) == [(c, k) for c in range(3) for k in range(4)]
        for c in range(3):  # each config's runs come in their own order
            assert [k for cc, k in plan if cc == c] == list(range(4))


def test_in_the_interleaved_order_run_k_sits_next_to_the_baselines_run_k():
    plan = run_order(4, 5)
    slot = {entry: i for i, entry in enumerate(plan)}
    for (c, k), at in slot.items():
        base_slots = [slot[(0, j)] for j in range(5)]
        nearest = min(range(5), key=lambda j: (abs(base_slots[j] - at), j))
        assert nearest == k and abs(slot[(0, k)] - at) <= 3  # at most the finalists' count of slots away


@pytest.mark.parametrize("bad, message", [((0, 3), "configs >= 1"), ((2, 0), "runs >= 1")])
def test_a_bad_order_request_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        run_order(*bad)
    with pytest.raises(ValueError, match="is not one of"):
        run_order(2, 2, "random")  # type: ignore[arg-type]


def drifted(order: str, configs: int, runs: int, step: float) -> list[list[float]]:
    """Each config's runs (true speed 1) when the n-th engine of the stage runs 1 + step x n times as long."""
    out: list[list[float]] = [[] for _ in range(configs)]
    for n, (c, _) in enumerate(run_order(configs, runs, order)):  # type: ignore[arg-type]
        out[c].append(1 / (1 + step * n))
    return out


@pytest.mark.parametrize("runs", [2, 3, 4, 5])
def test_a_drift_moves_the_sequential_ratio_by_the_stage_and_the_interleaved_by_a_round_at_most(runs):
    step = 0.1  # per engine, as a baseline that rose ~25% over a 5-run stage
    seq = drifted("sequential", 2, runs, step)
    inter = drifted("interleaved", 2, runs, step)
    moved_seq = abs(statistics.median(paired_ratios(seq[0], seq[1])) - 1)
    moved_inter = abs(statistics.median(paired_ratios(inter[0], inter[1])) - 1)
    assert moved_inter <= step + 1e-9  # one slot's drift at most
    assert moved_seq > (runs - 1) * step / (1 + step * 2 * runs) and moved_seq > 2 * moved_inter


def test_paired_ratios_skip_failed_runs():
    assert paired_ratios([10.0, 0.0, 20.0], [15.0, 30.0, 0.0]) == [1.5]
    assert paired_ratios([10.0, 12.0], [11.0]) == [1.1]


def runs(tputs: list[float], first_slot: int | None = 0, step: int = 2) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=t, order=None if first_slot is None else first_slot + step * i)
                 for i, t in enumerate(tputs))


def level(base: tuple[RunFigures, ...], cand: tuple[RunFigures, ...]) -> LevelInput:
    return LevelInput(level=1, baseline=base, candidates=(Candidate(id="a", runs=cand, equivalent=True,
                                                                    spec=NoSpec()),))


def test_paired_runs_give_the_speed_up_and_its_spread():
    # a baseline that drifts up over the stage, and a finalist measured beside each of its runs
    decision = decide_levels([level(runs([10.0, 12.0, 14.0]), runs([15.0, 18.0, 21.7], first_slot=1))],
                             PromotionPolicy())
    result = decision.levels[0]
    row = result.rows[1]
    assert row.run_ratios == pytest.approx((1.5, 1.5, 1.55))
    assert row.speedup == pytest.approx(1.5)  # the median pair, not 18 / 12 by chance
    assert speedup_spread(result, row) == pytest.approx((1.5, 1.55))
    assert speedup_text(result, row) == "1.50x (runs 1.50x-1.55x)"
    # the rule itself still reads the runs' medians and MADs
    assert result.decision.baseline.median == 12.0 and result.decision.candidates[0].median == 18.0


def test_runs_without_a_recorded_order_keep_the_ratio_of_medians():
    result = decide_levels([level(runs([10.0, 12.0, 14.0], None), runs([15.0, 18.0, 21.7], None))]).levels[0]
    row = result.rows[1]
    assert row.run_ratios == () and row.speedup == pytest.approx(18.0 / 12.0)
    assert speedup_spread(result, row) == pytest.approx((15.0 / 12.0, 21.7 / 12.0))
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        RunFigures(tput_tok_s=1.0, order=-1)


def test_drift_steps_parses_and_counts_every_scope_together(tmp_path):
    fault = parse_fault("drift-steps=0.5")
    assert fault.kind == "drift-steps" and fault.value == 0.5 and str(fault) == "drift-steps=0.5"
    with pytest.raises(FaultSpecError, match="drift-steps needs a slow-down step per start > 0"):
        parse_fault("drift-steps=0")
    assert [count_start(fault, speculative, str(tmp_path)) for speculative in (False, True, False)] == [0, 1, 2]


def test_drift_steps_slows_each_start_more_than_the_one_before(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_TEST_FAULT_STATE", str(tmp_path))
    ticks = iter(range(1000))
    monkeypatch.setattr("serve.engines.cpu.faults.time.perf_counter", lambda: float(next(ticks)))
    slept: list[float] = []
    monkeypatch.setattr("serve.engines.cpu.faults.time.sleep", slept.append)

    class Inner:
        def step_many(self, reqs):
            return list(reqs)

    for speculative in (False, True, False):
        engine = SimpleNamespace(config=SimpleNamespace(test_faults=(parse_fault("drift-steps=0.5"),), spec=NoSpec()),
                                 speculative=speculative, scheduler=SimpleNamespace(decoder=Inner()))
        install(None, engine)  # type: ignore[arg-type]
        engine.scheduler.decoder.step_many([])  # one round of 1 s on this clock
    assert slept == [0.5, 1.0]  # the first start runs at full speed, then 1.5x and 2x as long
