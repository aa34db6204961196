"""The latency figures a measurement reports, named once: a trial's (`pipeline.measure.summary.Summary`), production's
live figures (`serve.closed_loop.live.LiveFigures`), the trial table's columns (`pipeline.vocabulary.row`), the
simulator's predictions and the SLA limits a study may set all use these names. Percentiles by linear
interpolation, of seconds, reported in milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LATENCY_FIELDS", "LATENCY_FIGURES", "LATENCY_PERCENTILES", "latency_percentiles_ms", "percentile_ms"]

# time to first token, gaps between streamed chunks after the first, whole request
LATENCY_FIGURES = ("ttft", "itl", "e2e")
LATENCY_PERCENTILES = (50, 90, 99)
# `ttft_p50_ms`, `ttft_p90_ms`, ... `e2e_p99_ms`: figure by figure, each at every percentile
LATENCY_FIELDS: tuple[str, ...] = tuple(f"{figure}_p{q}_ms" for figure in LATENCY_FIGURES for q in LATENCY_PERCENTILES)


def percentile_ms(values_s: Sequence[float], q: float) -> float | None:
    """The q-th percentile of seconds, in ms; None if empty. Pure."""
    if not values_s:
        return None
    return float(np.percentile(np.asarray(values_s, dtype=np.float64) * 1000.0, q))


def latency_percentiles_ms(ttft_s: Sequence[float], itl_s: Sequence[float],
                           e2e_s: Sequence[float]) -> dict[str, float | None]:
    """Every `LATENCY_FIELDS` figure of these samples (seconds), None where a figure has no sample. Pure."""
    samples = dict(zip(LATENCY_FIGURES, (ttft_s, itl_s, e2e_s)))
    return {f"{figure}_p{q}_ms": percentile_ms(samples[figure], q)
            for figure in LATENCY_FIGURES for q in LATENCY_PERCENTILES}
