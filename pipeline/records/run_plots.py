"""The report's plots of what the decision rests on (`pipeline.records.report_data`): per level, the latency
distributions of each config's runs (TTFT, inter-token gaps, end to end, pooled over its runs) and a timeline of every
request of every run (start to last token, the first token marked); the simulated space of a simulate-first study
(every config's predicted throughput, the launched ones marked with what they measured); and the search's history
on an integer trial axis. Each returns a new figure, or False when it has nothing to show (no requests, one point).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.records.plots import SERVED_COLOR, metric_axis
from pipeline.records.report_data import RunRecord, SpacePoint

__all__ = ["levels_of", "plot_history", "plot_latency", "plot_space", "plot_timeline"]

CONFIG_COLORS = ("#555555", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def levels_of(runs: Sequence[RunRecord]) -> list[int]:
    return sorted({r.level for r in runs})


def _configs(runs: Sequence[RunRecord]) -> list[str]:
    names = list(dict.fromkeys(r.config for r in runs))
    return sorted(names, key=lambda n: (n != "baseline", names.index(n)))


def plot_latency(runs: Sequence[RunRecord], level: int) -> Any:
    """Three box plots side by side (TTFT, inter-token gap, end-to-end latency, ms) with a box per config at `level`,
    each pooling its counted runs' measured requests (a replaced run is not one); False when none measured a
    request."""
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt

    here = [r for r in runs if r.level == level and r.e2es_s and r.counted]
    if not here:
        return False
    configs = _configs(here)
    fig, axes = plt.subplots(1, 3, figsize=(9.0, 1.6 + 0.45 * len(configs)), dpi=100, sharey=True)
    series = (("TTFT", lambda r: [t for t in r.ttfts_s if t is not None]), ("inter-token gap", lambda r: r.itls_s),
              ("end to end", lambda r: r.e2es_s))
    for ax, (title, values) in zip(axes, series):
        data = [[v * 1000 for r in here if r.config == c for v in values(r)] for c in configs]
        shown = [(i, d) for i, d in enumerate(data) if d]
        if shown:
            ax.boxplot([d for _, d in shown], positions=[i for i, _ in shown], vert=False, widths=0.6,
                       showfliers=True, flierprops={"markersize": 3})
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(configs)), configs, fontsize=8)
    n_runs = len({r.name for r in here})
    fig.suptitle(f"Latency at {level} in flight ({n_runs} run(s), measured requests pooled per config)", fontsize=10)
    return fig


def plot_timeline(runs: Sequence[RunRecord], level: int) -> Any:
    """Every measured request of every run at `level`: a line from its start to its last token (seconds since the
    run's window opened), its first token a dot; one lane per request, counted runs in their measuring order. False
    when none measured a request."""
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt

    here = [r for r in runs if r.level == level and r.starts_s and r.counted]
    if not here:
        return False
    colors = {c: CONFIG_COLORS[i % len(CONFIG_COLORS)] for i, c in enumerate(_configs(here))}
    lanes = sum(len(r.starts_s) for r in here)
    fig, ax = plt.subplots(figsize=(9.0, min(max(2.6, 1.4 + 0.06 * lanes + 0.25 * len(here)), 14.0)), dpi=100)
    y, ticks, names, seen = 0, [], [], set()
    for run in here:
        top = y
        for start, ttft, e2e in zip(run.starts_s, run.ttfts_s, run.e2es_s):
            label = run.config if run.config not in seen else "_nolegend_"
            seen.add(run.config)
            ax.hlines(y, start, start + e2e, color=colors[run.config], linewidth=2, label=label)
            if ttft is not None:
                ax.plot([start + ttft], [y], "o", color="black", markersize=2.5)
            y += 1
        ticks.append((top + y - 1) / 2)
        names.append(f"{run.name}" + (f" (#{run.order})" if run.order is not None else ""))
        ax.axhline(y - 0.5, color="#dddddd", linewidth=0.8)
        y += 1
    ax.set_yticks(ticks, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's measurement window opened (dot: first token)")
    # above the axes, where the title would be (the report's caption says it): inside, it hides a run's lanes
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=min(3, len(colors)), frameon=False)
    return fig


def plot_space(points: Sequence[SpacePoint], metric: str) -> Any:
    """Every simulated config's predicted `metric`, best first (rank on the x axis); the launched configs marked,
    with what they measured. False with under two points."""
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if len(points) < 2:
        return False
    ranked = sorted(points, key=lambda p: -p.predicted)
    fig, ax = plt.subplots(figsize=(9.0, 4.0), dpi=100)
    ax.plot(range(1, len(ranked) + 1), [p.predicted for p in ranked], ".", color="#999999", markersize=3,
            label=f"predicted ({len(ranked)} configs)")
    launched = [(i + 1, p) for i, p in enumerate(ranked) if p.launched]
    if launched:
        ax.plot([i for i, _ in launched], [p.predicted for _, p in launched], "o", color="#1f77b4",
                label="launched: predicted")
        measured = [(i, p.measured) for i, p in launched if p.measured is not None]
        if measured:
            ax.plot([i for i, _ in measured], [m for _, m in measured], "*", color=SERVED_COLOR, markersize=10,
                    markeredgecolor="black", label="launched: measured")
    if len(ranked) > 50:
        ax.set_xscale("log")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("config rank by prediction (1 = best predicted)")
    ax.set_ylabel(metric_axis(metric))
    ax.set_title("The simulated space: every config's prediction, the launched ones marked", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_history(study: Any, metric: str) -> Any:
    """Each completed trial's first objective by trial number (an integer axis) and the best so far; False under
    two completed trials (one point shows no history)."""
    if study is None:
        return False
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt
    import optuna
    from matplotlib.ticker import MaxNLocator

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if t.values]
    if len(done) < 2:
        return False
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    xs = [t.number for t in done]
    ys = [t.values[0] for t in done]
    best, running = [], None
    for value in ys:
        running = value if running is None else (max(running, value) if maximize else min(running, value))
        best.append(running)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.plot(xs, ys, "o", color="#1f77b4", label="trial")
    ax.step(xs, best, where="post", color=SERVED_COLOR, label="best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial number (Optuna's, in the order trials were asked for)")
    ax.set_ylabel(metric_axis(metric))
    ax.set_title("Search history", fontsize=10)
    ax.legend(fontsize=8)
    return fig
