"""A bundled space whose every point simulate-first predicts (its grid within `search.simulate.points`) is predicted
in full after the baseline, on every bundled workload: as many configs predicted as the space has speculative
points, the time cap (`search.simulate.seconds`) never reached. A finite space past `points` (`ngram`, 409,860
points) is predicted whole, by replay class (pipeline/search/whole_space.py), not sampled by TPE. The count is what
is asserted, not a time (benchmarks/predict_space.py times it)."""

from __future__ import annotations

import pytest

from benchmarks.predict_space import predict_space
from pipeline.workloads import BUNDLED_WORKLOADS


@pytest.mark.parametrize("workload", BUNDLED_WORKLOADS)
def test_the_default_space_is_predicted_in_full(workload):
    row = predict_space("default", workload)
    assert (row.how, row.expected) == ("grid", 2112)
    assert row.predicted == row.expected and row.complete


def test_the_llama_cpp_ngram_simple_space_is_predicted_in_full():
    row = predict_space("llama-cpp-ngram-simple", "code-edit")
    assert (row.how, row.expected) == ("grid", 12 * 47)
    assert row.predicted == row.expected and row.complete
