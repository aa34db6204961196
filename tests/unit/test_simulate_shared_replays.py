"""A space's prediction shares work without changing a prediction: a request decoding alone replays its remaining
steps in one call into the compiled trie (the same rounds and steps as stepping it round by round on the Python trie,
the specification), and NGRAM configs that differ only in a capacity their trie never came near share one replay.
And a bundled space is predicted in full: as many configs as it has points, with no time cap reached."""

from __future__ import annotations

import random

import pytest

from benchmarks.predict_space import predict_space, synthetic_baseline
from pipeline.config import TrialConfig, load_study
from pipeline.simulate.cost import CostModel
from pipeline.simulate.prefix import PrefixCache
from pipeline.simulate.replay import replay
from pipeline.simulate.simulator import Simulator
from pipeline.simulate.workload import answers_of, phases_for
from serve.ngram import compiled
from serve.spec import LlamaNgramSimpleSpec, NgramSpec, VllmNgramSpec

STUDY = load_study(None, {"workload.source": "code-edit", "workload.measure_prompts": 4,
                          "workload.warmup_prompts": 4})
WARMUP, MEASURE, RECORDS = synthetic_baseline(STUDY)
ANSWERS = answers_of(RECORDS)
COST = CostModel(shape="prior", k=20.0, p0_ms=30.0)


def configs(count: int, capacities: tuple[int, ...] = (40, 300, 100_000)) -> list[TrialConfig]:
    rng = random.Random(7)
    out = []
    for _ in range(count):
        breadth = rng.randint(1, 8)
        out.append(TrialConfig(spec=NgramSpec(
            num_draft_tokens=rng.randint(2, 16), max_bfs_breadth=breadth, min_bfs_breadth=rng.randint(1, breadth),
            match_type=rng.choice(["BFS", "PROB"]), max_trie_depth=rng.randint(2, 24), capacity=rng.choice(capacities)),
            warmup_requests=rng.choice([0, 4, 8]), concurrency=rng.choice([1, 1, 2])))
    return out


def replay_one(trial: TrialConfig, i: int):
    """The i-th of a list's replays: a lag of 1 round every other one, a prefix cache every third."""
    phases = phases_for(trial, WARMUP, MEASURE, ANSWERS, lag=i % 2)
    assert isinstance(trial.spec, (NgramSpec, LlamaNgramSimpleSpec, VllmNgramSpec))
    return replay(trial.spec, phases, max_running=trial.max_running_requests,
                  prefix=PrefixCache(page_size=1) if i % 3 == 0 else None)


def replays(trials: list[TrialConfig]) -> list:
    return [replay_one(trial, i) for i, trial in enumerate(trials)]


def test_requests_decoding_alone_replay_in_one_call_as_the_python_trie_steps_them(monkeypatch):
    if not compiled.available():
        pytest.skip("the compiled trie does not build here")
    trials = configs(16)
    fast = replays(trials)
    monkeypatch.setenv(compiled.TRIE_ENV, "python")
    assert replays(trials) == fast


def test_capacities_a_trie_never_came_near_share_one_replay_and_one_prediction():
    base = configs(1)[0]
    spec = base.spec.model_copy(update={"max_trie_depth": 6})
    at = {c: base.model_copy(update={"spec": spec.model_copy(update={"capacity": c})})
          for c in (30, 10**5, 10**6, 10**7)}
    shared = Simulator(ANSWERS, WARMUP, MEASURE)
    for trial in at.values():  # each as a simulator of its own replays it
        alone = Simulator(ANSWERS, WARMUP, MEASURE)
        assert shared.replay(trial) == alone.replay(trial)
        assert shared.predict(trial, COST) == alone.predict(trial, COST)
        assert shared.signature(trial) == alone.signature(trial)
    small = shared.replay(at[30])
    assert 0 <= small.trie_nodes < 30 and small.trie_nodes + 6 >= 30 - 1  # it came near its cap: its own replay
    assert shared.replay(at[10**5]) is shared.replay(at[10**7]) is not small


def test_chain_drafted_configs_that_differ_in_draft_length_search_each_history_once():
    from pipeline.simulate import chains as module

    for memo, trials in (
            (module._SIMPLE, [TrialConfig(spec=LlamaNgramSimpleSpec(size_n=n, size_m=m)) for n in (1, 2, 3)
                              for m in (2, 5, 16, 48)]),
            # vLLM's ngram: one search per prompt_lookup_max, whatever K and prompt_lookup_min
            (module._VLLM, [TrialConfig(spec=VllmNgramSpec(num_speculative_tokens=k, prompt_lookup_min=low,
                                                           prompt_lookup_max=3))
                            for k in (1, 4, 8) for low in (1, 3)])):
        memo.clear()
        shared = replays(trials)  # the matches of one setting are searched once and reused for every other
        assert len(memo) < sum(len(r.rounds) for r in shared)
        alone = []
        for i, trial in enumerate(trials):  # each with nothing remembered
            memo.clear()
            alone.append(replay_one(trial, i))
        assert alone == shared


def test_a_bundled_space_is_predicted_in_full():
    row = predict_space("grid-small", "templated")
    assert row.how == "grid" and row.expected == 30  # the space's 31 points less the baseline
    assert row.predicted == row.expected and row.complete
