"""The simulate-first report plot: each launched config's predicted objective against what its trial measured, with
the median relative error (pipeline/search/simulate_first.py records the predictions as the Optuna trials' user
attribute `PREDICTION_ATTR`). Joins the study report through `write_report(extra_plots=...)`; absent (nothing
drawn) for a study without predictions."""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.records.plots import metric_axis
from pipeline.simulate.predict import PREDICTION_ATTR

__all__ = ["predicted_vs_measured", "prediction_plots"]


def predicted_vs_measured(ot_study: Any, metric: str) -> list[tuple[float, float]]:
    """(predicted, measured) of every completed trial that carries a prediction of `metric` (the first objective)."""
    if ot_study is None:
        return []
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    from optuna.trial import TrialState

    pairs = []
    for trial in ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        predicted = (trial.user_attrs.get(PREDICTION_ATTR) or {}).get(metric)
        measured = trial.values[0] if trial.values else None
        if isinstance(predicted, (int, float)) and isinstance(measured, (int, float)) and measured > 0:
            pairs.append((float(predicted), float(measured)))
    return pairs


def plot_predictions(ax: Any, pairs: list[tuple[float, float]], metric: str) -> bool:
    if not pairs:
        return False
    predicted, measured = zip(*pairs)
    low, high = min(*predicted, *measured) * 0.9, max(*predicted, *measured) * 1.1
    ax.plot([low, high], [low, high], color="#999999", linestyle="--", linewidth=1, label="predicted = measured")
    ax.scatter(predicted, measured, color="#1f77b4", zorder=3, label="launched configs")
    error = statistics.median(abs(p - m) / m for p, m in pairs)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel(f"predicted {metric_axis(metric)}")
    ax.set_ylabel(f"measured {metric_axis(metric)}")
    ax.set_title(f"simulate-first: median |predicted - measured| / measured = {error:.1%} ({len(pairs)} launch(es))",
                 fontsize=9)
    ax.legend(fontsize=8)
    return True


def prediction_plots(ot_study: Any, metric: str) -> list[tuple[str, str, Any]]:
    """`write_report`'s extra_plots entry for the prediction plot."""
    pairs = predicted_vs_measured(ot_study, metric)
    return [("predicted_vs_measured", f"simulate-first: predicted vs measured {metric} per launched config",
             lambda fig, ax: plot_predictions(ax, pairs, metric))]
