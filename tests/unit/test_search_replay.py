"""The search-efficiency replay (benchmarks/search_replay.py) on a synthetic surface: deterministic per seed, and
each method and metric does what the benchmark's table claims."""

import pytest

from benchmarks.search_replay import METHODS, Surface, key, promote, run_method, trials_to_reach
from pipeline.config import SEARCH_SPACES_DIR
from pipeline.space import grid_points, load_space

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
