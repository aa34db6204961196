"""A space's replays spread over worker processes are the replays the simulator computes by itself, and a worker
that cannot finish leaves its configs to be replayed on demand. Workers replay NGRAM configs only on the Python trie
(SPECDEC_NGRAM_TRIE=python here, inherited by the workers); with the compiled trie the caller replays them itself,
and its replays are the Python trie's."""

from __future__ import annotations

import itertools
import time

import pytest

from pipeline.config import TrialConfig
from pipeline.measure.load import LoadRequest
from pipeline.simulate import parallel
from pipeline.simulate.cost import CostModel
from pipeline.simulate.replay import Answer
from pipeline.simulate.simulator import Simulator
from serve.ngram import compiled
from serve.spec import NgramSpec

ANSWERS = {i: Answer((1, 2, i), tuple((i + k) % 7 for k in range(24))) for i in range(4)}
WARMUP = [LoadRequest(i, "", 24) for i in range(2)]
MEASURE = [LoadRequest(i, "", 24) for i in range(2, 4)]
COST = CostModel(shape="prior", k=20.0, p0_ms=30.0)


def space() -> list[TrialConfig]:
    points = itertools.product(range(2, 8), (1, 2), ("BFS", "PROB"), (2, 4, 6, 8))
    return [TrialConfig(spec=NgramSpec(num_draft_tokens=d, max_bfs_breadth=b, match_type=m, max_trie_depth=w,
                                       capacity=1000)) for d, b, m, w in points]


def simulator() -> Simulator:
    return Simulator(ANSWERS, WARMUP, MEASURE)


@pytest.fixture(autouse=True)
def python_trie(monkeypatch):
    monkeypatch.setenv(compiled.TRIE_ENV, "python")


def test_replays_made_in_workers_equal_the_simulators_own():
    trials = space()
    assert len(trials) >= parallel.MIN_PARALLEL
    alone, spread = simulator(), simulator()
    assert spread.prepare(trials, workers=2) == len(trials)
    for trial in trials:
        assert spread.replay(trial) == alone.replay(trial)
        assert spread.signature(trial) == alone.signature(trial)
        assert spread.predict(trial, COST) == alone.predict(trial, COST)
    assert spread.prepare(trials, workers=2) == 0  # all replayed already


def test_a_passed_deadline_leaves_every_config_to_be_replayed_on_demand():
    trials = space()
    late = simulator()
    assert late.prepare(trials, workers=2, deadline=time.monotonic() - 1) == 0
    assert late.predict(trials[5], COST) == simulator().predict(trials[5], COST)


def test_a_few_configs_or_one_core_replay_in_the_callers_process():
    trials = space()
    assert simulator().prepare(trials[:parallel.MIN_PARALLEL - 1], workers=2) == 0
    assert simulator().prepare(trials, workers=1) == 0


def test_a_worker_that_fails_returns_nothing_and_says_why(caplog):
    # a simulator the worker cannot build: its error reaches the caller's log, and no replay comes back
    assert parallel.replay_in_workers(Simulator, {"no_such_part": 1}, space()[:4], workers=2) == []
    assert "exited with 1" in caplog.text and "no_such_part" in caplog.text


def test_with_the_compiled_trie_the_caller_replays_what_the_python_trie_replays(monkeypatch):
    trials = space()
    python = simulator()
    want = [(python.replay(trial), python.predict(trial, COST)) for trial in trials]  # on the Python trie
    monkeypatch.delenv(compiled.TRIE_ENV)
    if not compiled.available():
        pytest.skip("the compiled trie does not build here")
    native = simulator()
    assert native.prepare(trials, workers=2) == 0  # nothing sent to workers
    assert [(native.replay(trial), native.predict(trial, COST)) for trial in trials] == want
