"""A space predicted whole (pipeline/search/whole_space.py: each replay class once, NGRAM at concurrency 1 replayed in
bulk by pipeline/simulate/solo.py) predicts every point exactly as `Simulator.predict` does, figure for figure, to
the bit: with the prior and with a measured round table, a client gap, a prefix cache, a closed loop's lag, tries
small enough to evict (the bulk replay's undo log cannot take an eviction back: it replays the warm-up again), and
capacities that share a replay or not. And a finite space past `search.simulate.points` is predicted in full instead
of sampled by TPE."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.predict_space import synthetic_baseline
from pipeline.config import load_study
from pipeline.search.simulated import explore
from pipeline.search.space import load_space, resolve
from pipeline.search.whole_space import WholeSpace, _points, explore_whole
from pipeline.simulate.cost import CostModel, RoundTable
from pipeline.simulate.prefix import PrefixCache
from pipeline.simulate.simulator import Simulator
from pipeline.simulate.workload import answers_of
from serve.ngram import compiled

SPACE = """
name: whole-test
description: a small NGRAM space with capacities that evict
algorithms: [none, ngram]
common:
  warmup_requests: {type: fixed, value: 2}
branches:
  ngram:
    num_draft_tokens: {type: int, low: 2, high: 6, step: 2}
    max_bfs_breadth: {type: int, low: 1, high: 3}
    match_type: {type: categorical, choices: [BFS, PROB]}
    min_bfs_breadth: {type: int, low: 1, high: max_bfs_breadth, when: {match_type: [BFS]}}
    max_trie_depth: {type: int, low: 3, high: 7, step: 4}
    capacity: {type: categorical, choices: [12, 100000, 1000000]}
    warmup_requests: {type: int, low: 0, high: 6, step: 3}
"""

TABLE = RoundTable(batches=[1, 4], widths=[1, 4, 16], ms=[[20.0, 23.0, 31.0], [24.0, 30.0, 52.0]],
                   lm_head_rows=[1, 8, 64], lm_head_ms=[2.0, 5.0, 21.0], context_tokens=100,
                   long_context_tokens=2000, short_context_ms=20.0, long_context_ms=27.0)
COSTS = {"prior": CostModel(shape="prior", k=20.0, p0_ms=30.0, p1_ms=0.1, gap_s=0.003),
         "table": CostModel(shape="measured", table=TABLE, k=1.1, o_ms=0.7, p0_ms=12.0, p1_ms=0.37, gap_s=0.0021)}


def setup(tmp_path: Path, workload: str = "code-edit"):
    path = tmp_path / "whole-test.yaml"
    path.write_text(SPACE)
    study = load_study(None, {"workload.source": workload, "workload.measure_prompts": 3,
                              "workload.warmup_prompts": 4, "workload.max_new_tokens": 20})
    warmup, measure, records = synthetic_baseline(study)
    return load_space(path), study, warmup, measure, answers_of(records)


@pytest.mark.skipif(not compiled.available(), reason="the compiled trie does not build here")
@pytest.mark.parametrize(("cost", "prefix", "lag", "workload", "warm"), [
    ("prior", False, 0, "code-edit", True), ("table", True, 1, "code-edit", True),
    ("table", False, 0, "templated", True), ("table", True, 0, "free-text", False)])
def test_every_point_is_predicted_as_the_simulator_predicts_it(tmp_path, cost, prefix, lag, workload, warm):
    space, study, warmup, measure, answers = setup(tmp_path, workload)
    if not warm:  # a study without a warm-up split: every config sends its measurement alone
        warmup = ()
    model = COSTS[cost]
    simulator = Simulator(answers, warmup, measure, lag=lag, prefix=PrefixCache(page_size=1) if prefix else None)
    reference = Simulator(answers, warmup, measure, lag=lag, prefix=PrefixCache(page_size=1) if prefix else None)
    whole = WholeSpace(space, study, simulator, lambda config: simulator.predict(config, model))
    whole.replay(float("inf"))
    predicted = whole.predictions(model)
    assert all(row.solo is not None for row in whole.rows)  # every class on the bulk path
    checked = 0
    for params, values in _points(space, "ngram"):
        resolution = resolve(space, params, study)
        row = whole.row_of("ngram", values)
        if not resolution.valid:
            assert row is None
            continue
        assert resolution.config is not None and row is not None
        assert predicted[row].figures == reference.predict(resolution.config, model), params
        checked += 1
    assert checked == whole.points == sum(r.members for r in whole.rows)
    # small capacities filled: some classes keep a replay per capacity, the large ones share
    assert len(whole.rows) > len(whole.classes)
    assert any(r.members > 1 for r in whole.rows)
    # a refit re-prices the same replays
    again = whole.predictions(COSTS["prior" if cost == "table" else "table"])
    assert [p.params for p in again] == [p.params for p in predicted]


@pytest.mark.skipif(not compiled.available(), reason="the compiled trie does not build here")
def test_a_finite_space_past_the_points_setting_is_predicted_whole_not_sampled(tmp_path):
    space, study, warmup, measure, answers = setup(tmp_path)
    simulator = Simulator(answers, warmup, measure)
    model = COSTS["prior"]

    def predict(config):
        return simulator.predict(config, model)

    explored = explore(space, study, predict, points=50, seconds=60.0,
                       whole=lambda started, seconds: explore_whole(space, study, simulator, model, predict, started,
                                                                    seconds))
    assert explored.method == "every point, by replay class" and explored.complete
    assert explored.whole is not None and explored.evaluated == explored.whole.points > 50
    # without it, TPE samples the predictions (what a study did before)
    sampled = explore(space, study, predict, points=50, seconds=60.0)
    assert sampled.method == "TPE over the predictions"


@pytest.mark.skipif(not compiled.available(), reason="the compiled trie does not build here")
def test_the_time_cap_still_stops_a_whole_prediction(tmp_path):
    space, study, warmup, measure, answers = setup(tmp_path)
    simulator = Simulator(answers, warmup, measure)
    model = COSTS["prior"]
    explored = explore_whole(space, study, simulator, model, lambda c: simulator.predict(c, model), 0.0, 1e-9)
    assert not explored.complete and explored.evaluated < explored.whole.points


@pytest.mark.skipif(not compiled.available(), reason="the compiled trie does not build here")
def test_a_whole_prediction_ranks_picks_one_config_per_replay_and_reprices(tmp_path):
    from pipeline.search.simulated import pick, point_key, rank

    space, study, warmup, measure, answers = setup(tmp_path)
    simulator = Simulator(answers, warmup, measure)
    model = COSTS["table"]
    explored = explore_whole(space, study, simulator, model, lambda c: simulator.predict(c, model), 0.0, 1e9)
    assert explored.whole is not None
    ranked = rank(explored.predicted, study)
    signatures = explored.whole.signatures()
    assert len(signatures) == len(explored.predicted)  # every row has one (each priced once)
    chosen = pick(ranked, 5, 0, same=lambda params: signatures.get(point_key(params), point_key(params)))
    assert len({signatures[point_key(p.params)] for p in chosen}) == len(chosen) == 5
    # a refit re-prices the kept replays: the same rows, other figures
    again = explored.whole.predictions(COSTS["prior"])
    assert [p.params for p in again] == [p.params for p in explored.predicted]
    assert [p.figures for p in again] != [p.figures for p in explored.predicted]
