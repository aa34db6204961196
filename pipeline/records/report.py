"""The study report: PNG plots (shown by MLflow's artifact viewer) and one self-contained HTML page.

Plots: throughput per trial vs the baseline (with bootstrap CIs), throughput and accept length vs num_draft_tokens
per algorithm, warm-up length vs accept length for NGRAM, NGRAM with an external corpus vs without, Optuna's optimization history and parameter importance,
and the Pareto front when the study has several objectives (the promoted trial starred, trials that broke an SLA
limit drawn as crosses and kept off the front). Every plot has an empty state (a study with one trial, or with every
trial failed, still gets a complete report). With a per-level decision the page shows its level table; when NGRAM
trials searched an external corpus, the corpus-vs-none table at equal draft tokens (`pipeline.trial.corpus`).
"""

from __future__ import annotations

import base64
import html
import warnings
from pathlib import Path
from typing import Any, Callable

from pipeline.compare import format_table
from pipeline.trial.corpus import corpus_comparison, corpus_label, format_corpus_table

ALGO_COLORS = {"none": "#555555", "ngram": "#1f77b4", "eagle": "#2ca02c", "eagle3": "#d62728",
               "standalone": "#9467bd"}


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display: CI, servers
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7.5, 4.2), dpi=100)


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="#777777", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _complete(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["outcome"] == "COMPLETE" and r.get("tput_tok_s") is not None]


def _num(row: dict[str, Any], key: str) -> float | None:
    value = row["params"].get(key)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def plot_throughput(ax: Any, rows: list[dict[str, Any]]) -> None:
    done = _complete(rows)
    if not done:
        _empty(ax, "no trial completed: nothing to plot")
        return
    names = [r["name"].replace("trial-", "") for r in done]
    values = [r["tput_tok_s"] for r in done]
    low = [max(0.0, v - (r.get("tput_ci_low") or v)) for v, r in zip(values, done)]
    high = [max(0.0, (r.get("tput_ci_high") or v) - v) for v, r in zip(values, done)]
    colors = [ALGO_COLORS.get(r["algorithm"], "#999999") for r in done]
    bars = ax.bar(range(len(done)), values, yerr=[low, high], color=colors, capsize=3)
    for bar, row in zip(bars, done):
        if row.get("feasible") is False:  # broke an SLA limit: fast, but not an answer
            bar.set_hatch("xx")
            bar.set_edgecolor("#d62728")
    base = next((r["tput_tok_s"] for r in done if r["algorithm"] == "none"), None)
    if base:
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label=f"baseline {base:.1f} tok/s")
        ax.legend(loc="best", fontsize=8)
    ax.set_xticks(range(len(done)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("output tok/s (95% CI)")
    ax.set_title("Throughput per trial")


def _versus_draft_tokens(ax: Any, rows: list[dict[str, Any]], metric: str, label: str) -> None:
    points = [(r["algorithm"], _num(r, "spec.num_draft_tokens"), r.get(metric)) for r in _complete(rows)]
    points = [p for p in points if p[1] is not None and p[2] is not None]
    if not points:
        _empty(ax, f"no completed speculative trial with {label}")
        return
    for algorithm in sorted({p[0] for p in points}):
        xs = [p[1] for p in points if p[0] == algorithm]
        ys = [p[2] for p in points if p[0] == algorithm]
        ax.scatter(xs, ys, label=algorithm, color=ALGO_COLORS.get(algorithm, "#999999"))
    base = next((r.get(metric) for r in _complete(rows) if r["algorithm"] == "none"), None)
    if base and metric == "tput_tok_s":
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label="baseline")
    ax.set_xlabel("num_draft_tokens")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    ax.set_title(f"{label} vs num_draft_tokens")


def plot_tput_vs_draft(ax: Any, rows: list[dict[str, Any]]) -> None:
    _versus_draft_tokens(ax, rows, "tput_tok_s", "output tok/s")


def plot_accept_vs_draft(ax: Any, rows: list[dict[str, Any]]) -> None:
    _versus_draft_tokens(ax, rows, "accept_len", "accept length")


def plot_warmup_vs_accept(ax: Any, rows: list[dict[str, Any]]) -> None:
    points = [(_num(r, "trial.warmup_requests"), r.get("accept_len")) for r in _complete(rows)
              if r["algorithm"] == "ngram"]
    points = [p for p in points if p[0] is not None and p[1] is not None]
    if not points:
        _empty(ax, "no completed NGRAM trial")
        return
    ax.scatter([p[0] for p in points], [p[1] for p in points], color=ALGO_COLORS["ngram"])
    ax.set_xlabel("warm-up requests (after flush)")
    ax.set_ylabel("accept length")
    ax.set_title("NGRAM: warm-up length vs accept length")


def plot_corpus_vs_accept(ax: Any, rows: list[dict[str, Any]]) -> None:
    """NGRAM with and without an external corpus: mean accept length (bars) and mean tok/s (labels) per corpus."""
    done = [r for r in _complete(rows) if r["algorithm"] == "ngram" and r.get("accept_len") is not None]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in done:
        groups.setdefault(corpus_label(r["params"].get("spec.external_corpus")), []).append(r)
    if not groups:
        _empty(ax, "no completed NGRAM trial")
        return
    names = sorted(groups, key=lambda n: (n != "none", n))
    accept = [sum(r["accept_len"] for r in groups[n]) / len(groups[n]) for n in names]
    tput = [sum(r["tput_tok_s"] for r in groups[n]) / len(groups[n]) for n in names]
    bars = ax.bar(range(len(names)), accept, color=["#999999" if n == "none" else ALGO_COLORS["ngram"]
                                                    for n in names])
    for bar, t, n in zip(bars, tput, names):
        ax.annotate(f"{t:.1f} tok/s\n{len(groups[n])} trial(s)", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("mean accept length")
    ax.set_title("NGRAM: external corpus vs none")


def _optuna_plot(fig: Any, ax: Any, study: Any, kind: str) -> Any:
    """Optuna's own matplotlib plots draw into a new figure; fall back to an empty state when they cannot."""
    import optuna

    if study is None:
        _empty(ax, "no Optuna study")
        return fig
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    needed = 1 if kind == "history" else 2
    if len(done) < needed:
        _empty(ax, f"{kind}: needs at least {needed} completed trial(s), have {len(done)}")
        return fig
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
            name = "objective 0" if target else None
            if kind == "history":
                axes = optuna.visualization.matplotlib.plot_optimization_history(study, target=target,
                                                                                 target_name=name or "Objective Value")
            else:
                axes = optuna.visualization.matplotlib.plot_param_importances(study, target=target)
        plt.close(fig)
        return axes.figure
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. importance with one distinct value
        _empty(ax, f"{kind}: {str(exc)[:80]}")
        return fig


def plot_pareto(ax: Any, rows: list[dict[str, Any]], metrics: list[str], modes: list[str],
                promoted: str | None = None) -> None:
    """Trials in the plane of the first two objectives; the front (pipeline.decide.pareto, feasible trials only) joined;
    infeasible trials (row `feasible` False) as red crosses; the promoted trial (row `name`) as a star."""
    from pipeline.decide.pareto import pareto_front

    done = [r for r in _complete(rows) if all(r.get(m) is not None for m in metrics[:2])]
    if len(metrics) < 2:
        _empty(ax, "single objective: no Pareto front")
        return
    if not done:
        _empty(ax, "no completed trial with both objectives")
        return
    mx, my = metrics[:2]
    feasible = [r for r in done if r.get("feasible") is not False]
    infeasible = [r for r in done if r.get("feasible") is False]
    front = pareto_front(feasible, metrics[:2], modes[:2])
    ax.scatter([r[mx] for r in feasible], [r[my] for r in feasible], color="#bbbbbb", label="trials")
    if infeasible:
        ax.scatter([r[mx] for r in infeasible], [r[my] for r in infeasible], marker="x", color="#d62728",
                   label="breaks an SLA limit")
    front = sorted(front, key=lambda r: r[mx])
    ax.plot([r[mx] for r in front], [r[my] for r in front], "o-", color="#1f77b4", label="Pareto front")
    star = [r for r in done if promoted is not None and r["name"] == promoted]
    if star:
        ax.scatter([star[0][mx]], [star[0][my]], marker="*", s=260, color="#ff7f0e", edgecolor="black", zorder=5,
                   label=f"promoted: {promoted}")
    ax.set_xlabel(mx)
    ax.set_ylabel(my)
    ax.legend(fontsize=8)
    ax.set_title("Pareto front")


def write_report(out_dir: Path, *, title: str, rows: list[dict[str, Any]], decision: str, ot_study: Any = None,
                 metrics: list[str] | None = None, modes: list[str] | None = None, promoted: str | None = None,
                 levels: Any = None) -> list[Path]:
    """Write report.html and the PNGs into out_dir; returns every file written (HTML last). `promoted` = the
    promoted trial's row name (starred on the Pareto plot); `levels` = a `pipeline.decide.levels.LevelsDecision`."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics, modes = metrics or ["tput_tok_s"], modes or ["max"]
    plots: list[tuple[str, Callable[[Any, Any], Any]]] = [
        ("throughput", lambda f, a: plot_throughput(a, rows)),
        ("tput_vs_draft_tokens", lambda f, a: plot_tput_vs_draft(a, rows)),
        ("accept_vs_draft_tokens", lambda f, a: plot_accept_vs_draft(a, rows)),
        ("warmup_vs_accept", lambda f, a: plot_warmup_vs_accept(a, rows)),
        ("corpus_vs_accept", lambda f, a: plot_corpus_vs_accept(a, rows)),
        ("optimization_history", lambda f, a: _optuna_plot(f, a, ot_study, "history")),
        ("param_importance", lambda f, a: _optuna_plot(f, a, ot_study, "importance")),
        ("pareto_front", lambda f, a: plot_pareto(a, rows, metrics, modes, promoted)),
    ]
    written = []
    for name, draw in plots:
        fig, ax = _figure()
        result = draw(fig, ax)
        figure = result if result is not None and hasattr(result, "savefig") else fig
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    images = "\n".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.stem.replace('_', ' ')}</figcaption></figure>" for p in written)
    table = format_table(rows) if rows else "(no trials recorded)"
    level_html = ""
    if levels is not None:
        from pipeline.decide.levels import format_level_table

        level_html = f"<h2>Per-concurrency decision</h2><pre>{html.escape(format_level_table(levels))}</pre>"
    corpus_cells = corpus_comparison(rows)  # only when the study searched a corpus
    corpus_html = (f"<h2>External corpus vs none (at equal draft tokens)</h2><pre>"
                   f"{html.escape(format_corpus_table(corpus_cells))}</pre>" if corpus_cells else "")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}pre{background:#f6f6f6;padding:1em;"
            "overflow-x:auto;font-size:12px}figure{display:inline-block;margin:0.5em}img{max-width:520px}</style>"
            f"</head><body><h1>{html.escape(title)}</h1><h2>Decision</h2><p>{html.escape(decision)}</p>"
            f"{level_html}{corpus_html}<h2>Trials</h2><pre>{html.escape(table)}</pre><h2>Plots</h2>{images}"
            "</body></html>")
    report = out_dir / "report.html"
    report.write_text(page)
    return written + [report]
