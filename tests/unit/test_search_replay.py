"""The search-efficiency replay (benchmarks/search_replay.py) on a synthetic surface: deterministic per seed, and
each method and metric does what the benchmark's table claims."""

import pytest

from benchmarks.search_replay import (METHODS, EarlyStop, Surface, engine_seconds, key, promote, run_method,
                                      stop_rates, trials_to_reach)
from pipeline.config import SEARCH_SPACES_DIR
from pipeline.search.space import grid_points, load_space

SPACE = load_space(SEARCH_SPACES_DIR / "grid-small.yaml")
POINTS = grid_points(SPACE)


def surface(value, sigma=0.05, failed=()):
    """value(params) -> mean tok/s; the baseline is 10 tok/s."""
    mean = {key(p): 10.0 if p["algorithm"] == "none" else value(p) for p in POINTS}
    return Surface(SPACE, mean, {k: k not in {key(p) for p in failed} for k in mean},
                   {key(p): p.get("ngram.num_draft_tokens", 0) for p in POINTS}, sigma)


def peaked(p):  # best at draft 6, breadth 1, warm-up 8: 18 tok/s; separable, so one knob at a time can find it
    return 18.0 - abs(p["ngram.num_draft_tokens"] - 6) - 2 * (p["ngram.max_bfs_breadth"] == 4) \
        - (8 - p["ngram.warmup_requests"]) / 4


@pytest.mark.parametrize("method", METHODS)
def test_a_seed_replays_identically_and_the_baseline_comes_first(method):
    s = surface(peaked)
    first, again = run_method(s, method, 7, 20), run_method(s, method, 7, 20)
    assert first.trials == again.trials
    assert first.trials[0][0] == s.baseline
    assert 1 <= len(first.trials) <= 20
    if method != "grid":  # the grid's order does not depend on the seed; its noise does
        assert run_method(s, method, 8, 20).trials != first.trials


def test_noise_free_grid_reaches_the_best_at_its_position_in_file_order():
    s = surface(peaked, sigma=0.0)
    best = max(POINTS[1:], key=peaked)
    position = POINTS.index(best) + 1
    run = run_method(s, "grid", 0, len(POINTS))
    within = [i + 1 for i, p in enumerate(POINTS) if p["algorithm"] != "none" and peaked(p) >= 0.98 * 18.0]
    assert trials_to_reach(s, run) == min(within) <= position
    assert trials_to_reach(s, run_method(s, "grid", 0, 3)) is None  # the best is not among the first 3 points


def test_tier_search_climbs_a_separable_surface_and_never_repeats_a_point():
    s = surface(peaked, sigma=0.0)
    run = run_method(s, "tier", 0, len(POINTS))
    points = [p for p, _ in run.trials]
    assert len(points) == len(set(points)) < len(POINTS)  # converged before enumerating everything
    assert trials_to_reach(s, run) is not None


def test_promotion_keeps_the_baseline_when_every_config_is_slower():
    s = surface(lambda p: 9.0, sigma=0.02)
    for method in METHODS:
        run = run_method(s, method, 3, 8)
        chosen = promote(s, run, 8, 3)
        assert chosen.noise_aware == s.baseline


def test_promotion_deploys_a_clear_winner_and_never_a_failed_point():
    best = {"algorithm": "ngram", "ngram.num_draft_tokens": 2, "ngram.max_bfs_breadth": 1, "ngram.warmup_requests": 0}
    s = surface(lambda p: 30.0 if p == best else 12.0, sigma=0.0, failed=[best])
    run = run_method(s, "grid", 0, 8)
    assert promote(s, run, 8, 0).noise_aware not in (s.baseline, key(best))  # 12 tok/s points beat 10 by > 3%


# Early stopping and engine-seconds (the per-request model of search_replay's docstring).
SLOW_OR_BEST = {"algorithm": "ngram", "ngram.num_draft_tokens": 6, "ngram.max_bfs_breadth": 1,
                "ngram.warmup_requests": 8}


def two_level(p):  # one clear winner, everything else at half the baseline's speed
    return 20.0 if p == SLOW_OR_BEST else 5.0


def long_trials(enabled=True):
    return EarlyStop(enabled=enabled, requests=16, tokens=24, request_sigma=0.15, start_s=10.0)


@pytest.mark.parametrize("method", METHODS)
def test_early_stopping_replays_identically_per_seed_and_leaves_the_values_of_a_run_without_it(method):
    s = surface(two_level)
    first, again = (run_method(s, method, 4, 20, early=long_trials()) for _ in range(2))
    assert first == again
    assert len(first.stopped) == len(first.costs) == len(first.trials)
    plain, costed = run_method(s, method, 4, 20), run_method(s, method, 4, 20, early=long_trials(enabled=False))
    assert costed.trials == plain.trials and not any(costed.stopped) and plain.costs == ()


def test_clearly_slow_points_are_stopped_the_winner_is_not_and_engine_seconds_drop():
    s = surface(two_level)
    on, off = run_method(s, "grid", 0, len(POINTS), early=long_trials()), \
        run_method(s, "grid", 0, len(POINTS), early=long_trials(enabled=False))
    flags = dict(zip((p for p, _ in on.trials), on.stopped))
    assert flags[key(SLOW_OR_BEST)] == 0 and flags[s.baseline] == 0
    assert sum(1 for k in on.stopped if k) >= len(POINTS) // 2  # most of the 5 tok/s points
    assert all(0 < k < 16 for k in on.stopped if k)
    reached_on, reached_off = trials_to_reach(s, on), trials_to_reach(s, off)
    assert reached_on == reached_off == POINTS.index(SLOW_OR_BEST) + 1
    seconds_on, seconds_off = engine_seconds(on, reached_on), engine_seconds(off, reached_off)
    assert seconds_on is not None and seconds_off is not None and seconds_on < seconds_off
    assert engine_seconds(off, None) is None
    with pytest.raises(ValueError, match="no costs"):
        engine_seconds(run_method(s, "grid", 0, 3), 3)
    assert promote(s, on, len(POINTS), 0).noise_aware == key(SLOW_OR_BEST)


def test_optuna_sees_stopped_trials_as_pruned_and_still_finds_the_winner():
    s = surface(two_level)
    run = run_method(s, "optuna", 1, len(POINTS), max_trials=len(POINTS), early=long_trials())
    assert any(run.stopped)
    assert trials_to_reach(s, run) is not None


def test_stop_rates_are_deterministic_and_never_stop_the_near_best_points():
    s = surface(peaked, sigma=0.03)
    first = stop_rates(s, long_trials(), repeats=10, seed=3)
    assert first == stop_rates(s, long_trials(), repeats=10, seed=3)
    assert first.near_best[1] > 0 and first.near_best[0] == 0 and first.faster[0] == 0
    slow = stop_rates(surface(two_level), long_trials(), repeats=10, seed=3)
    assert slow.slower[0] > slow.slower[1] // 2 and 0 < slow.requests_saved < 1
