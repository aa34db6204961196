"""The study report: one self-contained HTML page (and its PNGs, which MLflow's artifact viewer also shows).

Top to bottom: the headline (the decision in one sentence, the speed-up per level with its spread, what to deploy,
what no config could do: `pipeline.decide.headline`), the speed-up-by-concurrency chart (two levels or more), the
study's details (model, engine and version, hardware, date, commit, prompt and output lengths, levels), the
per-level table, the runs the decision rests on (each run's figure, slot in the measuring order and flags), latency
distributions and request timelines per level, the corpus comparison (a study that searched an external corpus), the
trials table, the simulated space (simulate-first), then the plots the study has data for (`pipeline.records.plots`,
`pipeline.records.run_plots`: each is left out when it would be empty, compare nothing or hold one point). What is
shown beside the decision comes from `pipeline.records.report_data.gather_report_inputs`. The page is a Jinja2
template (templates/report.html.j2, autoescaped). Configs are named by their labels. Laid out for a laptop screen:
no table or image wider than the page.

Another stage's plot joins `PLOTS`-style through `extra_plots`: (file name, caption, draw) where `draw(fig, ax)`
returns False (nothing to show), True (drawn on `ax`) or its own matplotlib figure -- e.g. the predicted-vs-measured
plot of the simulation stage, once predictions exist.
"""

from __future__ import annotations

import base64
import html
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from pipeline.decide.headline import (BASELINE, TABLE_METRICS, Headline, limits_text, row_status, served_at,
                                      speedup_spread)
from pipeline.decide.levels import LevelsDecision
from pipeline.records import plots, run_plots
from pipeline.records.report_data import ReportInputs, RunRecord
from pipeline.records.corpus_table import corpus_comparison, format_corpus_table
from pipeline.vocabulary.row import TrialRow

Draw = Callable[[Any, Any], Any]  # (fig, ax) -> False | True | a Figure
WIDE = ("throughput", "accept_length")  # full width; the other plots two to a row

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:1.2em 1.5em;max-width:1100px;
color:#222;line-height:1.4}
h1{font-size:1.5em;margin:.2em 0 .6em}h2{font-size:1.15em;margin:1.6em 0 .5em;border-bottom:1px solid #ddd}
.headline{border:1px solid #c9d7e8;background:#f4f8fc;border-radius:6px;padding:.8em 1.1em}
.headline .decision{font-size:1.1em;margin:.2em 0 .5em}.badge{display:inline-block;padding:.05em .5em;
border-radius:4px;font-size:.8em;font-weight:600;color:#fff;background:#2e7d32;margin-right:.4em}
.badge.keep_baseline{background:#616161}.badge.no_baseline{background:#c62828}
.impossible{background:#fff4e5;border-left:4px solid #ef6c00;padding:.4em .8em;margin:.4em 0}
.deploy code{background:#eef1f4;padding:.1em .3em;border-radius:3px;word-break:break-all}
ul{margin:.3em 0 .3em 1.2em;padding:0}
table{border-collapse:collapse;width:100%;font-size:13px;margin:.4em 0}
th,td{border-bottom:1px solid #e3e3e3;padding:.3em .45em;text-align:left;vertical-align:top}
th{background:#f3f3f3;font-weight:600}td.num,th.num{text-align:right;white-space:nowrap}
td.config{word-break:break-word;min-width:10em}td.note{word-break:break-word;color:#555;font-size:12px}
tr.served td{background:#fff3e0;font-weight:600}tr.level-start td{border-top:2px solid #bbb}
.bad{color:#c62828}.muted{color:#777}
table.details th{width:16em;background:none;font-weight:600;color:#444}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12px;max-width:100%}
figure{margin:.8em 0}img{max-width:100%;height:auto;border:1px solid #eee}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:0 1em}
figcaption{font-size:12px;color:#555}
"""


def _e(text: Any) -> str:
    return html.escape(str(text))


def headline_html(headline: Headline) -> str:
    """The headline as the page's first block: kind badge and sentence, one item per level, what was not possible,
    what to deploy."""
    levels = "".join(f"<li>{_e(line)}</li>" for line in headline.levels)
    impossible = "".join(f"<div class='impossible'><b>Not possible:</b> {_e(line)}</div>"
                         for line in headline.impossible)
    notes = "".join(f"<p class='muted'>{_e(line)}</p>" for line in headline.notes)
    deploy = f"<p class='deploy'><b>Deploy:</b> <code>{_e(headline.deploy)}</code></p>" if headline.deploy else ""
    # other work disturbed the re-runs the decision rests on: said beside the decision, not below the fold
    caveat = (f"<div class='impossible' id='caveat'><b>Caveat:</b> {_e(headline.caveat)}</div>"
              if headline.caveat else "")
    provisional = "<span class='badge no_baseline'>PROVISIONAL</span>" if headline.provisional else ""
    return (f"<section class='headline' id='headline'><p class='decision'><span class='badge {_e(headline.kind)}'>"
            f"{_e(headline.kind.replace('_', ' ').upper())}</span>{provisional}{_e(headline.decision)}</p>{caveat}"
            f"{f'<ul>{levels}</ul>' if levels else ''}{impossible}{notes}{deploy}</section>")


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def level_table_html(levels: LevelsDecision) -> str:
    """The per-level decision as an HTML table: per level each config, its median tok/s, speed-up with the runs'
    range, latency medians, whether it is served, and the limits it breaks (figure and limit)."""
    heads = "".join(f"<th class='num'>{_e(label)}</th>" for _, label in TABLE_METRICS)
    body = []
    for result in levels.levels:
        served = served_at(levels, result.level)
        for i, row in enumerate(result.rows):
            name = "baseline" if row.id == BASELINE else levels.labels.get(row.id, row.id)
            spread = speedup_spread(result, row)
            speed = "-" if row.speedup is None else f"{row.speedup:.2f}x"
            runs = f"{spread[0]:.2f}-{spread[1]:.2f}x" if spread and len(row.runs_tok_s) > 1 else "-"
            cells = "".join(f"<td class='num'>{_ms(row.latencies_ms.get(m))}</td>" for m, _ in TABLE_METRICS)
            broken = "; ".join(f"breaks {v.metric} &lt;= {v.max_ms:g} ms ({_ms(v.figure_ms)})"
                               for v in row.verdicts if not v.ok)
            classes = " ".join(c for c in ("served" if row.id == served else "", "level-start" if i == 0 else "") if c)
            body.append(
                f"<tr class='{classes}'><td class='num'>{result.level}</td><td class='config'>{_e(name)}</td>"
                f"<td class='num'>{_tok(row.median_tok_s)}</td><td class='num'>{speed}</td>"
                f"<td class='num'>{runs}</td>{cells}<td>{_e(row_status(levels, result, row))}</td>"
                f"<td class='note bad'>{broken}</td></tr>")
    limits = limits_text(levels)
    return ("<table id='level-table'><thead><tr><th class='num'>in flight</th><th>config</th>"
            "<th class='num'>tok/s</th><th class='num'>speed-up</th><th class='num'>runs</th>"
            f"{heads}<th>status</th><th>limits broken</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p class='muted'>Medians over the re-runs; speed-up = median tok/s / the baseline's at the same level; "
            f"runs = each re-run over the baseline's median.{(' Limits: ' + _e(limits) + '.') if limits else ''}"
            f"</p><p><b>Serving policy:</b> {_e(levels.policy.text)}</p>"
            + (f"<p class='muted'>{_e(levels.finalists)}</p>" if levels.finalists else ""))


def trials_table_html(rows: Sequence[TrialRow], remeasured: bool = False) -> str:
    """The search's trials (baseline first, then by throughput): config label, outcome, figures, and the reason of
    a failed trial or the SLA limits a completed one broke. The speed-up is the one every view shows
    (`TrialRow.speedup`: a finalist's as the decision read it, the search's beside it, labelled). `remeasured`: the
    decision rests on re-runs."""
    if not rows:
        return "<p class='muted'>No trials recorded.</p>"
    body = []
    for r in rows:
        ratio = f"{r.speedup:.2f}x" if r.speedup else "-"
        accept = f"{r.accept_len:.2f}" if r.accept_len else "-"
        notes = ["the baseline"] if r.baseline else []
        if r.search_note:
            notes.append(f"re-measured: the finalists' paired runs ({r.search_note})")
        if not r.complete and r.reason:
            notes.append(r.reason[:300])
        notes += [t for t in r.sla or () if t.startswith("BROKEN")]
        body.append(f"<tr><td class='config'>{_e(r.name)}</td><td>{_e(r.outcome_text)}</td>"
                    f"<td class='num'>{_tok(r.tput_tok_s)}</td><td class='num'>{ratio}</td>"
                    f"<td class='num'>{accept}</td><td class='num'>{_ms(r.ttft_p50_ms)}</td>"
                    f"<td class='note'>{_e('; '.join(notes))}</td></tr>")
    return ("<table id='trials-table'><thead><tr><th>config</th><th>outcome</th><th class='num'>tok/s</th>"
            "<th class='num'>speed-up</th><th class='num'>accept length</th><th class='num'>TTFT p50</th>"
            f"<th>note</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
            "<p class='muted'>tok/s, accept length and TTFT: one measurement per trial during the search"
            + ("; speed-up: a finalist's from its re-measured runs paired with the baseline's (what the decision "
               "above rests on), the search's own beside it; the others' from the search." if remeasured
               else "; speed-up: over the search's baseline measurement.") + "</p>")


def _draw(out_dir: Path, name: str, draw: Draw, rows_hint: int = 0) -> Path | None:
    """Run one plot; its PNG, or None when it had nothing to show."""
    # lazy: matplotlib only when a figure is drawn
    import matplotlib.pyplot as plt

    fig, ax = plots.figure(rows_hint, width=9.0 if name in (*WIDE, "speedup_by_concurrency") else 6.4)
    result = draw(fig, ax)
    if result is False or result is None:
        plt.close(fig)
        return None
    shown = result if hasattr(result, "savefig") else fig
    shown.tight_layout()
    path = out_dir / f"{name}.png"
    shown.savefig(path)
    plt.close(shown)
    if shown is not fig:
        plt.close(fig)
    return path


def write_report(out_dir: Path, *, title: str, rows: Sequence[TrialRow], headline: Headline | None = None,
                 decision: str = "", ot_study: Any = None, metrics: list[str] | None = None,
                 modes: list[str] | None = None, promoted: str | None = None, levels: LevelsDecision | None = None,
                 extra_plots: Sequence[tuple[str, str, Draw]] = (), inputs: ReportInputs | None = None) -> list[Path]:
    """Write report.html and the PNGs it shows into out_dir; returns every file written (HTML last). `headline`:
    the decision (`decision` as plain text when there is none); `promoted` = the promoted trial's row name
    (starred on the Pareto plot); `levels` = a `pipeline.decide.levels.LevelsDecision`; `extra_plots`: see the
    module docstring; `inputs`: the study's details, the runs the decision rests on and the simulated space."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.png"):  # a plot this run leaves out must not linger from an earlier one
        old.unlink()
    metrics, modes = metrics or ["tput_tok_s"], modes or ["max"]
    headline = headline or Headline(kind="keep_baseline", decision=decision or "no decision recorded")
    n_done = len(plots.complete(rows))
    figures: list[tuple[str, str, Draw, int]] = [
        ("speedup_by_concurrency", "Speed-up over the baseline by concurrency (served config bold, switch marked)",
         lambda f, a: plots.plot_speedup_levels(a, levels), 0),
        ("throughput", "Speed-up over the baseline by config: the finalists' from their re-measured runs (what the "
                       "decision rests on), the others' from the search's single measurement",
         lambda f, a: plots.plot_throughput(a, rows), n_done),
        ("accept_length", "Accept length by config", lambda f, a: plots.plot_accept(a, rows), n_done),
        ("tput_vs_draft_tokens", "Throughput vs draft tokens", lambda f, a: plots.plot_tput_vs_draft(a, rows), 0),
        ("accept_vs_draft_tokens", "Accept length vs draft tokens",
         lambda f, a: plots.plot_accept_vs_draft(a, rows), 0),
        ("warmup_vs_accept", "NGRAM: warm-up length vs accept length",
         lambda f, a: plots.plot_warmup_vs_accept(a, rows), 0),
        ("corpus_vs_accept", "NGRAM: external corpus vs none", lambda f, a: plots.plot_corpus_vs_accept(a, rows), 0),
        ("pareto_front", "Pareto front of the objectives",
         lambda f, a: plots.plot_pareto(a, rows, metrics, modes, promoted), 0),
        ("optimization_history", f"Search history: {metrics[0]} per trial and the best so far",
         lambda f, a: run_plots.plot_history(ot_study, metrics[0]), 0),
        ("param_importance", "Optuna: parameter importance", lambda f, a: plots.plot_optuna(f, ot_study,
                                                                                           "importance"), 0),
        *((name, caption, draw, 0) for name, caption, draw in extra_plots),
    ]
    runs = inputs.runs if inputs else ()
    by_level: list[tuple[str, str, Draw]] = []
    for level in run_plots.levels_of(runs):
        by_level += [(f"latency_c{level}", f"Latency at {level} in flight: TTFT, inter-token gap, end to end (ms)",
                      level_draw(run_plots.plot_latency, runs, level)),
                     (f"timeline_c{level}", f"Requests over time at {level} in flight, one lane per request, runs in measuring order",
                      level_draw(run_plots.plot_timeline, runs, level))]
    if inputs is not None:
        space, metric = inputs.space, inputs.space_metric
        by_level.append(("simulated_space", f"Predicted {metric} of every simulated config",
                         lambda f, a: run_plots.plot_space(space, metric)))
    figures += [(name, caption, draw, 0) for name, caption, draw in by_level]
    drawn = {name: (path, caption) for name, caption, draw, hint in figures
             if (path := _draw(out_dir, name, draw, hint)) is not None}
    shown = {name: figure_view(*drawn.pop(name)) for name in list(drawn)
             if name == "speedup_by_concurrency" or name.startswith(("latency_c", "timeline_c"))
             or name == "simulated_space"}
    cells = corpus_comparison(rows)  # only when the study searched a corpus
    page = render_page(
        title=title, css=CSS, headline=Markup(headline_html(headline)), speedup=shown.get("speedup_by_concurrency"),
        details=inputs.details.items if inputs else (),
        level_table=Markup(level_table_html(levels)) if levels is not None else None,
        runs=run_rows(runs), finalist_stage=bool(inputs and inputs.finalist_stage),
        latency=[v for k, v in shown.items() if k.startswith("latency_c")],
        timelines=[v for k, v in shown.items() if k.startswith("timeline_c")],
        corpus=format_corpus_table(cells) if cells else None,
        trials=Markup(trials_table_html(rows, remeasured=levels is not None)),
        space=shown.get("simulated_space"), space_note=space_note(inputs),
        wide=[figure_view(*drawn.pop(name)) for name in WIDE if name in drawn],  # bars named by labels: full width
        grid=[figure_view(path, caption) for path, caption in drawn.values()])
    report = out_dir / "report.html"
    report.write_text(page)
    paths = [p for name, caption, draw, hint in figures for p in [out_dir / f"{name}.png"] if p.exists()]
    return paths + [report]


def level_draw(plot: Callable[[Sequence[RunRecord], int], Any], runs: Sequence[RunRecord], level: int) -> Draw:
    """One level's plot as a `Draw` (bound now: a lambda in a loop would see the last level)."""
    return lambda fig, ax: plot(runs, level)


def figure_view(path: Path, caption: str) -> dict[str, str]:
    """A drawn PNG as the template shows it: inline (the page is one file), with its caption."""
    return {"name": path.stem, "caption": caption, "data": base64.b64encode(path.read_bytes()).decode()}


def _median_ms(values: Sequence[float | None]) -> str:
    shown = [v for v in values if v is not None]
    return _ms(statistics.median(shown) * 1000) if shown else "-"


def run_rows(runs: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The runs table's cells, one dict per run, a rule above each new level. Pure."""
    return [{"level": r.level, "level_start": i == 0 or runs[i - 1].level != r.level,
             "order": "-" if r.order is None else r.order, "name": r.name, "config": r.config,
             "outcome": r.outcome.lower() or "-", "tput": _tok(r.tput_tok_s), "requests": len(r.e2es_s),
             "ttft": _median_ms(r.ttfts_s), "e2e": _median_ms(r.e2es_s), "flags": "; ".join(r.flags),
             "counted": r.counted}
            for i, r in enumerate(runs)]


def space_note(inputs: ReportInputs | None) -> str:
    if inputs is None or len(inputs.space) < 2:
        return ""
    launched = [p for p in inputs.space if p.launched]
    return (f"simulate-first predicted {inputs.space_metric} for {len(inputs.space)} configs from the baseline's "
            f"measured requests and launched {len(launched)} of them; a launch's star is what it measured.")


def render_page(**context: Any) -> str:
    """The page from templates/report.html.j2, every value escaped unless passed as Markup."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("pipeline.records", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=False)
    return env.get_template("report.html.j2").render(**context)
