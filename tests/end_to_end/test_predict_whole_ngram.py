"""The largest bundled space, `ngram` (409,860 points), predicted in full by replay class (pipeline/search/
whole_space.py): ~25-50 CPU s on 2 cores, so it runs with the full tiers, not the default one."""

from __future__ import annotations

from benchmarks.predict_space import predict_space


def test_the_ngram_space_is_predicted_whole():
    # the count, not the time: a cap far past this machine's ~25-50 CPU s (docs/benchmarks.md "Predict"), so that a
    # loaded machine cannot make it fail
    row = predict_space("ngram", "reasoning", seconds=900.0)
    # 15 draft lengths x (BFS: 36 breadth pairs + PROB: 8) x 23 depths x 3 capacities x 9 warm-up counts
    assert (row.how, row.expected) == ("grid, by replay class", 15 * (36 + 8) * 23 * 3 * 9)
    assert row.predicted == row.expected and row.complete
