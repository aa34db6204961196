"""The study report's plots (matplotlib, Agg). Each `plot_*` draws on the axes it is given and returns whether it
drew anything: a plot whose data the study does not have (one level, no corpus searched, a single objective, one
trial) returns False and the report leaves it out instead of showing an empty frame. Configs are named by their
labels (`pipeline.records.labels`), as the rows carry them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from pipeline.decide.headline import speedup_spread
from pipeline.decide.pareto import pareto_front
from pipeline.records.corpus_table import corpus_comparison, corpus_label
from pipeline.vocabulary.row import TrialRow

ALGO_COLORS = {"none": "#555555", "ngram": "#1f77b4", "eagle": "#2ca02c", "eagle3": "#d62728",
               "standalone": "#9467bd"}
LLAMA_COLOR = "#8c564b"
SERVED_COLOR = "#ff7f0e"
UNITS = {"tput_tok_s": "output tok/s", "accept_len": "accepted tokens per verify step"}


def metric_axis(metric: str) -> str:
    """An objective's axis label with its unit (`*_ms` figures are milliseconds)."""
    return f"{metric} ({UNITS.get(metric) or ('ms' if metric.endswith('_ms') else 'as measured')})"


def color(algorithm: str) -> str:
    return ALGO_COLORS.get(algorithm, LLAMA_COLOR if algorithm.startswith("llama_") else "#999999")


def figure(rows: int = 0, width: float = 9.0) -> tuple[Any, Any]:
    """A figure sized for the page (900 px wide at dpi 100); `rows` > 0: the bars of a horizontal bar chart, whose
    height follows them."""
    # lazy: matplotlib only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")  # no display: CI, servers
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt

    height = 4.2 if rows <= 0 else min(max(2.4, 1.3 + 0.32 * rows), 16.0)
    return plt.subplots(figsize=(width, height), dpi=100)


def complete(rows: Sequence[TrialRow]) -> list[TrialRow]:
    return [r for r in rows if r.complete and r.tput_tok_s is not None]


def _tput(row: TrialRow) -> float:
    return row.tput_tok_s or 0.0  # every row `complete` keeps has one


def _baseline(rows: Sequence[TrialRow], metric: str = "tput_tok_s") -> float | None:
    return next((r.metric(metric) for r in complete(rows) if r.baseline), None)


def search_ratio(row: TrialRow, base: float | None) -> float | None:
    """A row's speed-up in the search (over the search's baseline measurement)."""
    return row.vs_baseline or (_tput(row) / base if base else None)


def plot_throughput(ax: Any, rows: Sequence[TrialRow]) -> bool:
    """Speed-up over the baseline per config, the figure every view shows (`TrialRow.speedup`): a finalist's from
    its re-measured runs paired with the baseline's (its search figure as a hollow marker beside it), the others'
    from the search's single measurement (with its 95% CI); fastest on top, the baseline at 1.0; a config that broke
    an SLA limit hatched. Needs two completed trials (one bar compares nothing)."""
    base = _baseline(rows)
    done = [(r, r.decided if r.decided is not None else search_ratio(r, base)) for r in complete(rows)]
    shown = sorted(((r, v) for r, v in done if v is not None), key=lambda p: p[1])
    if len(shown) < 2 or not base:
        return False
    values = [v for _, v in shown]
    low = [0.0 if r.decided is not None else max(0.0, v - (r.tput_ci_low or _tput(r)) / base) for r, v in shown]
    high = [0.0 if r.decided is not None else max(0.0, (r.tput_ci_high or _tput(r)) / base - v) for r, v in shown]
    bars = ax.barh(range(len(shown)), values, xerr=[low, high], capsize=3,
                   color=[color(r.algorithm) for r, _ in shown])
    for bar, (row, _) in zip(bars, shown):
        if row.decided is None and not row.baseline:
            bar.set_alpha(0.55)  # one search measurement: lighter than a figure the decision rests on
        if row.feasible is False:  # broke an SLA limit: fast, but not an answer
            bar.set_hatch("xx")
            bar.set_edgecolor("#d62728")
    searched = [(i, search_ratio(r, base)) for i, (r, _) in enumerate(shown) if r.decided is not None]
    if searched:
        ax.scatter([v for _, v in searched], [i for i, _ in searched], facecolors="none", edgecolors="black",
                   zorder=5, label="its search measurement")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label=f"baseline 1.0x ({base:.1f} tok/s)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(shown)), [r.name for r, _ in shown], fontsize=8)
    ax.set_xlabel("speed-up over the baseline (x): finalists from their re-measured runs, others from the search "
                  "(95% CI)")
    ax.set_title("Speed-up by config")
    return True


def plot_accept(ax: Any, rows: Sequence[TrialRow]) -> bool:
    """Mean accepted length per verify step of each speculative config (1.0 = nothing accepted)."""
    done = sorted((r for r in complete(rows) if not r.baseline and r.accept_len is not None),
                  key=lambda r: r.accept_len or 0.0)
    if not done:
        return False
    ax.barh(range(len(done)), [r.accept_len for r in done], color=[color(r.algorithm) for r in done])
    ax.axvline(1.0, color="black", linestyle=":", linewidth=1, label="1.0: no draft accepted")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(done)), [r.name for r in done], fontsize=8)
    ax.set_xlabel("accepted tokens per verify step")
    ax.set_title("Accept length by config")
    return True


def _versus_draft_tokens(ax: Any, rows: Sequence[TrialRow], metric: str, label: str) -> bool:
    points = [(r.algorithm, r.number("spec.num_draft_tokens"), r.metric(metric)) for r in complete(rows)]
    points = [p for p in points if p[1] is not None and p[2] is not None]
    if len({p[1] for p in points}) < 2:  # one draft length: nothing to read a trend from
        return False
    for algorithm in sorted({p[0] for p in points}):
        xs = [p[1] for p in points if p[0] == algorithm]
        ys = [p[2] for p in points if p[0] == algorithm]
        ax.scatter(xs, ys, label=algorithm, color=color(algorithm))
    base = _baseline(rows, metric)
    if base and metric == "tput_tok_s":
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label="baseline")
    ax.set_xlabel("num_draft_tokens (draft tokens per verify step)")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    ax.set_title(f"{label} vs num_draft_tokens")
    return True


def plot_tput_vs_draft(ax: Any, rows: Sequence[TrialRow]) -> bool:
    return _versus_draft_tokens(ax, rows, "tput_tok_s", "output tok/s")


def plot_accept_vs_draft(ax: Any, rows: Sequence[TrialRow]) -> bool:
    return _versus_draft_tokens(ax, rows, "accept_len", "accept length (tokens per verify step)")


def plot_warmup_vs_accept(ax: Any, rows: Sequence[TrialRow]) -> bool:
    """NGRAM: warm-up length vs accept length; needs two warm-up lengths."""
    points = [(r.number("trial.warmup_requests"), r.accept_len) for r in complete(rows) if r.algorithm == "ngram"]
    points = [p for p in points if p[0] is not None and p[1] is not None]
    if len({p[0] for p in points}) < 2:
        return False
    ax.scatter([p[0] for p in points], [p[1] for p in points], color=ALGO_COLORS["ngram"])
    ax.set_xlabel("warm-up requests (after flush)")
    ax.set_ylabel("accept length (tokens per verify step)")
    ax.set_title("NGRAM: warm-up length vs accept length")
    return True


def plot_corpus_vs_accept(ax: Any, rows: Sequence[TrialRow]) -> bool:
    """NGRAM with and without an external corpus: mean accept length (bars) and mean tok/s (labels) per corpus;
    only for a study that searched a corpus (`pipeline.records.corpus_table.corpus_comparison`)."""
    if not corpus_comparison(rows):
        return False
    done = [r for r in complete(rows) if r.algorithm == "ngram" and r.accept_len is not None]
    groups: dict[str, list[TrialRow]] = {}
    for r in done:
        groups.setdefault(corpus_label(r.params.get("spec.external_corpus")), []).append(r)
    names = sorted(groups, key=lambda n: (n != "none", n))
    accept = [sum(r.accept_len or 0.0 for r in groups[n]) / len(groups[n]) for n in names]
    tput = [sum(_tput(r) for r in groups[n]) / len(groups[n]) for n in names]
    bars = ax.bar(range(len(names)), accept, color=["#999999" if n == "none" else ALGO_COLORS["ngram"]
                                                    for n in names])
    for bar, t, n in zip(bars, tput, names):
        ax.annotate(f"{t:.1f} tok/s\n{len(groups[n])} trial(s)", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("mean accept length (tokens per verify step)")
    ax.set_title("NGRAM: external corpus vs none")
    return True


IMPORTANCE_TRIALS = 5  # fewer completed trials: each parameter's "importance" is an artefact of a handful of points


def plot_optuna(fig: Any, study: Any, kind: str) -> Any:
    """Optuna's own matplotlib plot (`history` or `importance`) as a new figure, or False when the study cannot
    give a meaningful one (under 2 completed trials for the history, IMPORTANCE_TRIALS for the importance, or
    parameters with one value). The report draws the history with `run_plots.plot_history` (integer trial axis,
    the objective's unit)."""
    if study is None:
        return False
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna

    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if len(done) < (2 if kind == "history" else IMPORTANCE_TRIALS):
        return False
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
            if kind == "history":
                axes = optuna.visualization.matplotlib.plot_optimization_history(
                    study, target=target, target_name="objective 0" if target else "Objective Value")
            else:
                axes = optuna.visualization.matplotlib.plot_param_importances(study, target=target)
    except (ValueError, RuntimeError, ZeroDivisionError):  # e.g. importance with one distinct value
        return False
    plt.close(fig)
    return axes.figure


def plot_pareto(ax: Any, rows: Sequence[TrialRow], metrics: list[str], modes: list[str],
                promoted: str | None = None) -> bool:
    """Trials in the plane of the first two objectives; the front (pipeline.decide.pareto, feasible trials only)
    joined; infeasible trials (row `feasible` False) as red crosses; the promoted trial (row `name`) as a star.
    Only for a study with several objectives."""
    if len(metrics) < 2:
        return False
    done = [r for r in complete(rows) if all(r.metric(m) is not None for m in metrics[:2])]
    if len(done) < 2:  # one point has no front to show
        return False
    mx, my = metrics[:2]
    feasible = [r for r in done if r.feasible is not False]
    infeasible = [r for r in done if r.feasible is False]
    front = pareto_front(feasible, metrics[:2], modes[:2])
    ax.scatter([r.figures[mx] for r in feasible], [r.figures[my] for r in feasible], color="#bbbbbb", label="trials")
    if infeasible:
        ax.scatter([r.figures[mx] for r in infeasible], [r.figures[my] for r in infeasible], marker="x",
                   color="#d62728", label="breaks an SLA limit")
    front = sorted(front, key=lambda r: r.figures[mx])
    ax.plot([r.figures[mx] for r in front], [r.figures[my] for r in front], "o-", color="#1f77b4",
            label="Pareto front")
    star = [r for r in done if promoted is not None and r.name == promoted]
    if star:
        ax.scatter([star[0].figures[mx]], [star[0].figures[my]], marker="*", s=260, color=SERVED_COLOR,
                   edgecolor="black", zorder=5, label=f"promoted: {promoted}")
    ax.set_xlabel(metric_axis(mx))
    ax.set_ylabel(metric_axis(my))
    ax.legend(fontsize=8)
    ax.set_title("Pareto front")
    return True


def plot_speedup_levels(ax: Any, levels: Any) -> bool:
    """Speed-up over the baseline at each concurrency level (a `LevelsDecision` with two levels or more): the
    baseline at 1.0 with its runs' spread, each finalist's median with its runs' range, the served config drawn
    bold, and the switch level marked where the policy changes config."""
    if levels is None or len(levels.levels) < 2:
        return False
    results = list(levels.levels)
    xs = list(range(len(results)))
    base_low = [speedup_spread(r, r.rows[0]) for r in results]
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="baseline (1.0)")
    if all(b is not None for b in base_low):
        ax.fill_between(xs, [b[0] for b in base_low if b], [b[1] for b in base_low if b], color="#cccccc",
                        alpha=0.6, label="baseline's run range")
    served = levels.policy.config
    ids = [row.id for row in results[0].rows if row.id != "baseline"]
    for config_id in ids:
        rows = [next((row for row in r.rows if row.id == config_id), None) for r in results]
        ys = [row.speedup if row is not None and row.speedup is not None else float("nan") for row in rows]
        spreads = [speedup_spread(r, row) if row is not None else None for r, row in zip(results, rows)]
        err = [[max(0.0, y - s[0]) if s else 0.0 for y, s in zip(ys, spreads)],
               [max(0.0, s[1] - y) if s else 0.0 for y, s in zip(ys, spreads)]]
        main = config_id == served
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, linewidth=2.5 if main else 1.2,
                    color=SERVED_COLOR if main else "#1f77b4", alpha=1.0 if main else 0.6,
                    label=levels.labels.get(config_id, config_id) + (" (served)" if main else ""))
    up_to = levels.policy.up_to
    if served and up_to is not None:
        at = next(i for i, r in enumerate(results) if r.level == up_to) + 0.5
        above = levels.labels.get(levels.policy.above, levels.policy.above) if levels.policy.above else "baseline"
        ax.axvline(at, color="#d62728", linestyle=":", linewidth=1.5)
        ax.annotate(f"switch: above {up_to} in flight\n-> {above}", (at, 1.0), xytext=(4, 8),
                    textcoords="offset points", fontsize=8, color="#d62728")
    ax.set_xticks(xs, [str(r.level) for r in results])
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("speed-up over the baseline (median, run range)")
    ax.set_title("Speed-up by concurrency")
    ax.legend(fontsize=8, loc="best")
    return True
