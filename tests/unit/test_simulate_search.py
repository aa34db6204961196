"""simulate-first's decisions without an engine: which studies it applies to (and why not), the search over
predictions (every point of a small space, ranked, diverse picks), when predictions miss, and how the baseline's
records become the simulator's answers."""

from __future__ import annotations

from typing import Literal

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import RequestRecord
from pipeline.search.simulated import Predicted, distance, explore, misses, pick, rank
from pipeline.search.space import load_space
from pipeline.search.strategy import resolve_strategy
from pipeline.simulate.workload import Unsimulable, answers_of, phases_for
from serve.spec import NgramSpec

SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 0}\nbranches:\n  ngram:\n"
         "    num_draft_tokens: {type: int, low: 2, high: 6, step: 2}\n"
         "    max_bfs_breadth: {type: int, low: 1, high: 2}\n    warmup_requests: {type: categorical, choices: [0, 4]}\n")


@pytest.fixture()
def space(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return load_space(path)


def test_auto_is_simulate_first_for_a_greedy_ngram_space_and_says_why_not_otherwise(space, tmp_path):
    assert resolve_strategy(load_study(None, {}), space).name == "simulate-first"
    eagle = tmp_path / "eagle.yaml"
    eagle.write_text("algorithms: [none, eagle3]\n")
    cases = {
        "eagle3": (load_study(None, {"model.drafts": {"eagle3": "d"}}), load_space(eagle)),
        "temperature": (load_study(None, {"workload.temperature": 0.7}), space),
        "n_errors": (load_study(None, {"objective.metrics": ["n_errors"], "objective.modes": ["min"]}), space),
        "is tpe": (load_study(None, {"search.strategy": "tpe"}), space),
        "baseline only": (load_study(None, {"budget.max_trials": 1}), space),
    }
    for words, (study, sp) in cases.items():
        strategy = resolve_strategy(study, sp)
        assert strategy.name == "tpe" and words in strategy.reason, strategy.reason
    explicit = resolve_strategy(load_study(None, {"search.strategy": "simulate-first",
                                                  "workload.temperature": 0.5}), space)
    assert explicit.name == "tpe" and explicit.reason.startswith("falls back to tpe")
    later = resolve_strategy(load_study(None, {}), space).fall_back("no tokenizer here")
    assert (later.name, later.simulated) == ("tpe", False) and later.reason.endswith("no tokenizer here")


def fake_predict(config: TrialConfig) -> dict[str, float]:
    spec = config.spec
    assert isinstance(spec, NgramSpec), f"this space only has NGRAM configs, got {spec!r}"
    # a surface with its best at 4 draft tokens, breadth 1, warm-up 4
    value = 10.0 - abs(spec.num_draft_tokens - 4) - (spec.max_bfs_breadth - 1) + config.warmup_requests / 4
    return {"tput_tok_s": value, "ttft_p99_ms": 100.0 * spec.max_bfs_breadth}


def test_a_small_space_is_simulated_point_by_point_then_ranked_and_picked_apart(space):
    study = load_study(None, {})
    explored = explore(space, study, fake_predict, points=100, seconds=60)
    assert (explored.method, explored.complete, explored.evaluated) == ("every point", True, 12)
    ranked = rank(explored.predicted, study)
    best = ranked[0].params
    assert (best["ngram.num_draft_tokens"], best["ngram.max_bfs_breadth"], best["ngram.warmup_requests"]) == (4, 1, 4)
    values = [p.figures["tput_tok_s"] for p in ranked]
    assert values == sorted(values, reverse=True)
    two = pick(ranked, 2, min_distance=2)
    assert two[0].params == best and distance(two[0].params, two[1].params) >= 2
    # a neighbour one parameter away would have been next without the distance rule
    assert distance(best, ranked[1].params) == 1
    # an SLA limit at the search level puts the points predicted to break it last
    limited = load_study(None, {"objective.constraints": [{"metric": "ttft_p99_ms", "max_ms": 150}]})
    assert all(isinstance(p.config.spec, NgramSpec) and p.config.spec.max_bfs_breadth == 1
               for p in rank(explored.predicted, limited)[:6])
    # capped by points: a TPE search over the predictions instead
    capped = explore(space, study, fake_predict, points=5, seconds=60)
    assert capped.method == "TPE over the predictions" and 1 <= capped.evaluated <= 5


def test_pick_relaxes_the_distance_when_too_few_points_are_far_enough(space):
    study = load_study(None, {})
    ranked = rank(explore(space, study, fake_predict, points=100, seconds=60).predicted, study)
    taken = [ranked[0].params]
    chosen = pick(ranked, 11, min_distance=3, taken=taken)
    assert len(chosen) == 11 and all(p.params != taken[0] for p in chosen)


def test_misses_is_the_median_error_against_the_threshold():
    assert misses([0.05, None, 0.30, 0.20], 0.10) == (pytest.approx(0.20), True)
    assert misses([0.02, 0.04], 0.10) == (pytest.approx(0.03), False)
    assert misses([None], 0.10) == (None, False)


def rec(i: int, phase: Literal["warmup", "measure", "reference"], prompt, output, prompt_tokens=None,
        error=None) -> RequestRecord:
    return RequestRecord(request_id=f"{phase}-{i}", phase=phase, prompt_index=i, concurrency=1, start_s=0.0,
                         ttft_s=0.01, e2e_s=0.1, prompt_tokens=len(prompt) if prompt_tokens is None else prompt_tokens,
                         completion_tokens=len(output), finish_reason="length", output_ids=output, prompt_ids=prompt,
                         error=error)


def test_the_baseline_records_become_answers_and_a_missing_one_is_named():
    answers = answers_of([rec(0, "warmup", (1, 2), (3, 4)), rec(1, "reference", (5,), (6,)),
                          rec(2, "measure", (7,), (8, 9)), rec(3, "measure", (7,), (), error="boom")])
    assert sorted(answers) == [0, 1, 2]
    trial = TrialConfig(warmup_requests=3)
    warm, meas = [LoadRequest(0, "", 2), LoadRequest(1, "", 2)], [LoadRequest(2, "", 2)]
    phases = phases_for(trial, warm, meas, answers)
    assert [p.name for p in phases] == ["warmup", "measure"]
    assert [a.prompt_ids for a in phases[0].answers] == [(1, 2), (5,), (1, 2)]  # the split cycled, as a trial does
    with pytest.raises(Unsimulable, match="warm-up prompt 9"):
        phases_for(trial, [LoadRequest(9, "", 2)], meas, answers)
    with pytest.raises(Unsimulable, match="differ from the engine's prompt_tokens"):
        answers_of([rec(0, "measure", (1, 2), (3,), prompt_tokens=3)])
    with pytest.raises(Unsimulable, match="answered twice"):
        answers_of([rec(0, "measure", (1,), (3,)), rec(0, "warmup", (1,), (4,))])


def test_predicted_points_carry_their_key():
    p = Predicted({"algorithm": "ngram", "ngram.num_draft_tokens": 4}, TrialConfig(), {})
    assert p.key == '{"algorithm": "ngram", "ngram.num_draft_tokens": 4}'


def test_fronts_match_peeling_the_non_dominated_points_one_front_at_a_time():
    import random

    from pipeline.search.simulated import fronts

    def peeled(scores):
        left, out, level = set(range(len(scores))), [0] * len(scores), 0
        while left:
            front = {i for i in left if not any(all(x >= y for x, y in zip(scores[j], scores[i]))
                                                 and scores[j] != scores[i] for j in left)}
            for i in front:
                out[i] = level
            left -= front
            level += 1
        return out

    rng = random.Random(0)
    for dims in (1, 2, 3):
        for _ in range(30):
            scores = [tuple(float(rng.randint(0, 5)) for _ in range(dims)) for _ in range(rng.randint(0, 25))]
            assert fronts(scores) == peeled(scores), scores
