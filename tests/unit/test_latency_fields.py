"""The latency figures are named once (`serve.latency.LATENCY_FIELDS`): a trial's summary, production's live figures,
the trial table, the simulator's predictions and the SLA limits all report exactly those names."""

import numpy as np

from pipeline.config.policy import SLA_METRICS
from pipeline.measure.summary import Summary
from pipeline.simulate.predict import PREDICTABLE_METRICS
from pipeline.vocabulary.row import ROW_METRICS
from serve.closed_loop.live import LiveFigures
from serve.latency import LATENCY_FIELDS, latency_percentiles_ms, percentile_ms


def latency_names(names):
    return [n for n in names if n.split("_")[0] in ("ttft", "itl", "e2e") and n.endswith("_ms")]


def test_every_view_reports_the_same_latency_fields():
    assert len(LATENCY_FIELDS) == 9
    for names in (list(Summary.model_fields), list(LiveFigures.model_fields), PREDICTABLE_METRICS, SLA_METRICS):
        assert latency_names(names) == list(LATENCY_FIELDS)
    assert sorted(latency_names(ROW_METRICS)) == sorted(LATENCY_FIELDS)


def test_percentiles_in_ms_with_none_for_a_figure_without_samples():
    figures = latency_percentiles_ms([0.010, 0.030], [], [1.0])
    assert figures["ttft_p50_ms"] == percentile_ms([0.010, 0.030], 50) == 20.0
    assert figures["ttft_p90_ms"] == float(np.percentile([10.0, 30.0], 90))
    assert figures["itl_p99_ms"] is None and figures["e2e_p99_ms"] == 1000.0
    assert list(figures) == list(LATENCY_FIELDS)
