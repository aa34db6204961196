"""What a study decided, in the words a serving team acts on: one sentence, the speed-up per level with its spread,
what to deploy, and what no measured config could do. Pure and unit-tested; printed at the end of
`python -m pipeline.tune`, at the top of the report and as the study run's MLflow description.

Built from the per-level result (`pipeline.decide.levels.LevelsDecision`, with its config labels) or, when nothing
was re-measured, from the search's baseline figure. A level where no config meets an SLA limit is said as such with
the figures ("no config meets ttft_p99_ms <= 50 ms at 4 in flight (best: ...); you need more capacity or a looser
limit"): the baseline is served there as the fallback, but it is not an answer to the limit.

Also the level table as the console and `python -m pipeline.compare` print it (`level_table`): labels instead of ids,
the served config per level marked, the limits each config breaks named with figure and limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.decide.disturbance import disturbance
from pipeline.decide.levels import BASELINE, LevelResult, LevelRow, LevelsDecision
from pipeline.decide.sla import Verdict

ADVICE = "you need more capacity or a looser limit"


@dataclass(frozen=True)
class Deploy:
    """The command file(s) the study wrote: the engine to run, and the one above `switch_above` requests in flight
    when the policy serves two engines."""

    command: str
    high_command: str | None = None
    switch_above: int | None = None

    def text(self, what: str) -> str:
        line = f"run {self.command} ({what})"
        if self.high_command and self.switch_above is not None:
            line += f"; above {self.switch_above} in flight {self.high_command}"
        return line


@dataclass(frozen=True)
class Headline:
    """`kind`: promote | keep_baseline | no_baseline; `decision`: the one sentence; `levels`: one line per level;
    `impossible`: what no measured config could do; `deploy`: the command file(s) to run."""

    kind: str
    decision: str
    levels: tuple[str, ...] = ()
    impossible: tuple[str, ...] = ()
    deploy: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    caveat: str = ""  # what the decision's measurements are worth when other work disturbed them (`disturbance`)
    provisional: bool = False  # every run the decision rests on was disturbed

    @property
    def label(self) -> str:
        """`PROMOTE`, `KEEP_BASELINE (PROVISIONAL)`, ..."""
        return self.kind.upper() + (" (PROVISIONAL)" if self.provisional else "")

    def lines(self) -> list[str]:
        out = [f"decision: {self.label} -- {self.decision}"]
        if self.caveat:
            out.append(f"  Caveat: {self.caveat}")
        out += [f"  {line}" for line in self.levels]
        out += [f"  Not possible: {line}" for line in self.impossible]
        out += [f"  Note: {line}" for line in self.notes]
        if self.deploy:
            out.append(f"  Deploy: {self.deploy}")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def markdown(self) -> str:
        """For the MLflow run description (rendered as Markdown by the UI)."""
        parts = [f"**Decision ({self.label}):** {self.decision}"]
        if self.caveat:
            parts.append(f"**Caveat:** {self.caveat}")
        if self.levels:
            parts.append("\n".join(f"- {line}" for line in self.levels))
        parts += [f"**Not possible:** {line}" for line in self.impossible]
        parts += [f"**Note:** {line}" for line in self.notes]
        if self.deploy:
            parts.append(f"**Deploy:** {self.deploy}")
        return "\n\n".join(parts)


# --- names and figures ---------------------------------------------------------------------------------------------


def display_name(decision: LevelsDecision, config_id: str) -> str:
    """A config as the views name it: its label (quoted), or `the baseline`."""
    if config_id == BASELINE:
        return "the baseline"
    return f"'{decision.labels.get(config_id, config_id)}'"


def served_at(decision: LevelsDecision, level: int) -> str:
    """The config id the serving policy serves at `level` (BASELINE included)."""
    policy = decision.policy
    if policy.config is None:
        return BASELINE
    if policy.up_to is None or level <= policy.up_to:
        return policy.config
    return policy.above or BASELINE


def _row(result: LevelResult, config_id: str) -> LevelRow:
    return next(r for r in result.rows if r.id == config_id)


def speedup_spread(result: LevelResult, row: LevelRow) -> tuple[float, float] | None:
    """The lowest and highest of the row's re-runs over their paired baseline runs (`LevelRow.run_ratios`), else
    over the baseline's median at that level; None without runs."""
    if row.run_ratios:
        return min(row.run_ratios), max(row.run_ratios)
    base = _row(result, BASELINE).median_tok_s
    if not row.runs_tok_s or base <= 0:
        return None
    return min(row.runs_tok_s) / base, max(row.runs_tok_s) / base


def speedup_text(result: LevelResult, row: LevelRow) -> str:
    """`1.24x (runs 1.18x-1.30x)`; `-` when the baseline measured nothing."""
    if row.speedup is None:
        return "-"
    spread = speedup_spread(result, row)
    if spread is None or len(row.runs_tok_s) < 2:
        return f"{row.speedup:.2f}x"
    return f"{row.speedup:.2f}x (runs {spread[0]:.2f}x-{spread[1]:.2f}x)"


def _ms(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _limit(verdict: Verdict) -> str:
    return f"{verdict.metric} <= {verdict.max_ms:g} ms"


# --- per level -----------------------------------------------------------------------------------------------------


def _why_not(result: LevelResult, row: LevelRow, decision: LevelsDecision) -> str:
    """Why a finalist is not served at this level, in a few words."""
    if row.refused:
        broken = [v for v in row.verdicts if not v.ok]
        return "breaks " + ", ".join(f"{_limit(v)} ({_ms(v.figure_ms)})" for v in broken)
    score = next((c for c in result.decision.candidates if c.id == row.id), None)
    if decision.policy.unsplit and result.winner == row.id:
        return "it wins here, but one config serves every level (two engines do not fit)"
    if score is None or score.lost_because is None:
        return "not served here by the policy"
    if not score.equivalent and result.decision.policy.require_equivalence:
        return "its outputs differ from the baseline's"
    if result.decision.bar is None:
        return "a baseline re-run failed, so the bar is unknown"
    if "re-runs failed" in score.lost_because:
        return "a re-run failed"
    base = result.decision.baseline.median
    if not score.beats_baseline and base > 0:
        return f"needs a noise-adjusted score above {result.decision.bar / base:.2f}x the baseline"
    return "another finalist is preferred (tie rule: fewer draft tokens)"


def level_line(decision: LevelsDecision, result: LevelResult) -> str:
    """`1 in flight: 'X' 12.4 tok/s vs the baseline's 10.0 = 1.24x (runs 1.18x-1.30x)`, or, where the baseline is
    served, its figure and the best finalist's with why it is not served."""
    served = served_at(decision, result.level)
    base = _row(result, BASELINE)
    head = f"{result.level} in flight:"
    if served != BASELINE:
        row = _row(result, served)
        return (f"{head} {display_name(decision, served)} {row.median_tok_s:.1f} tok/s vs the baseline's "
                f"{base.median_tok_s:.1f} = {speedup_text(result, row)}")
    line = f"{head} the baseline, {base.median_tok_s:.1f} tok/s"
    others = [r for r in result.rows if r.id != BASELINE and r.speedup is not None]
    if others:
        best = max(others, key=lambda r: r.median_tok_s)
        line += (f"; best finalist {display_name(decision, best.id)} {speedup_text(result, best)}, "
                 f"{_why_not(result, best, decision)}")
    return line


def impossible_lines(decision: LevelsDecision, result: LevelResult) -> list[str]:
    """The limits no measured config meets at this level, with the best figure; or, when each limit is met by some
    config but none meets them all, that; and a served config that breaks a limit another config meets."""
    limits: dict[tuple[str, float], list[tuple[LevelRow, Verdict]]] = {}
    for row in result.rows:
        for verdict in row.verdicts:
            limits.setdefault((verdict.metric, verdict.max_ms), []).append((row, verdict))
    if not limits:
        return []
    where = f"at {result.level} in flight"
    lines = []
    for pairs in limits.values():
        if any(v.ok for _, v in pairs):
            continue
        measured = sorted((p for p in pairs if p[1].figure_ms is not None), key=lambda p: p[1].figure_ms or 0.0)
        best = (f"best: {display_name(decision, measured[0][0].id)} {_ms(measured[0][1].figure_ms)}"
                if measured else "no config measured it")
        base = next((v for r, v in pairs if r.id == BASELINE), None)
        if measured and base is not None and measured[0][0].id != BASELINE:
            best += f", the baseline {_ms(base.figure_ms)}"
        lines.append(f"no config meets {_limit(pairs[0][1])} {where} ({best}); {ADVICE}")
    if not lines and not any(all(v.ok for v in row.verdicts) for row in result.rows):
        lines.append(f"no config meets every limit at once {where} (each is met by some config: "
                     + "; ".join(f"{display_name(decision, r.id)} breaks "
                                 + ", ".join(_limit(v) for v in r.verdicts if not v.ok) for r in result.rows)
                     + f"); {ADVICE}")
    served = _row(result, served_at(decision, result.level))
    meets = [r for r in result.rows if all(v.ok for v in r.verdicts)]
    if meets and not all(v.ok for v in served.verdicts):
        broken = ", ".join(f"{_limit(v)} ({_ms(v.figure_ms)})" for v in served.verdicts if not v.ok)
        lines.append(f"{display_name(decision, served.id)} is served {where} as the fallback and breaks {broken}; "
                     f"{', '.join(display_name(decision, r.id) for r in meets)} meet(s) it but "
                     f"{'is' if len(meets) == 1 else 'are'} not faster by the promotion rule")
    return lines


# --- the sentence --------------------------------------------------------------------------------------------------


def _at(decision: LevelsDecision, config_id: str, levels: Sequence[LevelResult]) -> str:
    parts = []
    for result in levels:
        row = _row(result, config_id)
        if row.speedup is not None:
            parts.append(f"{row.speedup:.2f}x at {result.level}")
    return ", ".join(parts)


def _keep_reason(decision: LevelsDecision) -> str:
    low = decision.levels[0]
    if low.decision.bar is None:
        return ("a baseline re-run failed, so no finalist can be shown faster; re-run the promotion once the engine "
                "answers every request")
    finalists = [r for r in low.rows if r.id != BASELINE]
    if finalists and all(r.refused for r in finalists):
        return f"every finalist breaks an SLA limit at {low.level} in flight"
    scores = {c.id: c for c in low.decision.candidates}
    eligible = [r for r in finalists if not r.refused and r.id in scores and "cannot be promoted" not in
                (scores[r.id].lost_because or "")]
    if not eligible:
        return f"no finalist is eligible at {low.level} in flight (outputs differ from the baseline's or a re-run " \
               "failed)"
    best = max(eligible, key=lambda r: r.median_tok_s)
    base = low.decision.baseline.median
    need = f", needs above {low.decision.bar / base:.2f}x" if base > 0 and low.decision.bar is not None else ""
    wins = [r.level for r in decision.levels if r.winner]
    later = f"; finalists won only at higher levels ({wins}), and one config cannot start there" if wins else ""
    return (f"no finalist beats it by the promotion margin and its noise at {low.level} in flight (best: "
            f"{display_name(decision, best.id)} {speedup_text(low, best)}{need}){later}")


def unsplit_sentence(decision: LevelsDecision) -> str:
    """The sentence of a policy that serves one config at every level because the two engines the levels call for
    do not fit the serving side (`ServingPolicy.unsplit`)."""
    policy = decision.policy
    why = (f"one engine only, because the levels call for a second one and {policy.unsplit} (set engine.serving_gpus "
           "if production has room for both)")
    if policy.config is None:
        return (f"keep the baseline at every level: {why}; no finalist is within the margin of the baseline at "
                "every level.")
    return (f"serve {display_name(decision, policy.config)} at every measured level "
            f"({_at(decision, policy.config, list(decision.levels))}): {why}.")


def decision_sentence(decision: LevelsDecision) -> str:
    policy = decision.policy
    levels = list(decision.levels)
    if policy.unsplit:
        return unsplit_sentence(decision)
    if policy.config is None:
        return f"keep the baseline: {_keep_reason(decision)}."
    name = display_name(decision, policy.config)
    if policy.up_to is None:
        where = "at every measured level" if len(levels) > 1 else f"at {levels[0].level} in flight"
        return f"serve {name}: faster than the baseline {where} ({_at(decision, policy.config, levels)})."
    low = [r for r in levels if r.level <= policy.up_to]
    high = [r for r in levels if r.level > policy.up_to]
    text = f"serve {name} up to {policy.up_to} in flight ({_at(decision, policy.config, low)})"
    if policy.above:
        return (text + f" and {display_name(decision, policy.above)} above {policy.up_to} "
                f"({_at(decision, policy.above, high)}).")
    lost = ", ".join(f"{_row(r, policy.config).speedup or 0:.2f}x at {r.level}" for r in high)
    return text + f", the baseline above {policy.up_to}: speculation does not pay there ({lost})."


def levels_headline(decision: LevelsDecision, deploy: Deploy) -> Headline:
    """The headline of a study whose finalists were re-measured at every level, with its caveat when other work
    disturbed the re-runs (`pipeline.decide.disturbance`)."""
    disturbed = disturbance(decision)
    what = ("the baseline" if decision.policy.config is None
            else f"{display_name(decision, decision.policy.config)}"
            + (" up to the switch" if deploy.high_command else ""))
    return Headline(kind="promote" if decision.policy.config else "keep_baseline",
                    decision=decision_sentence(decision),
                    levels=tuple(level_line(decision, r) for r in decision.levels),
                    impossible=tuple(line for r in decision.levels for line in impossible_lines(decision, r)),
                    deploy=deploy.text(what), caveat=disturbed.caveat(), provisional=disturbed.provisional)


def search_only_headline(reason: str, baseline_tok_s: float | None, level: int, deploy: Deploy | None,
                         best: tuple[str, float] | None = None) -> Headline:
    """The headline when nothing was re-measured (no finalist, or no baseline: `baseline_tok_s` None): `reason` is
    the decision's own words (`keep baseline: ...`), `best` the fastest speculative trial's (label, speed-up) from
    the search's single measurement, shown as a hint, not a verdict."""
    sentence = reason or "no decision"
    levels = []
    if baseline_tok_s is not None:
        line = f"{level} in flight: the baseline, {baseline_tok_s:.1f} tok/s (one search measurement)"
        if best is not None:
            line += f"; fastest trial '{best[0]}' {best[1]:.2f}x in its single measurement"
        levels.append(line)
    return Headline(kind="keep_baseline" if baseline_tok_s is not None else "no_baseline",
                    decision=sentence.rstrip(".") + ".", levels=tuple(levels),
                    deploy=deploy.text("the baseline") if deploy else "nothing to deploy")


# --- the level table -----------------------------------------------------------------------------------------------

TABLE_METRICS = (("ttft_p50_ms", "ttft p50"), ("ttft_p99_ms", "ttft p99"), ("itl_p50_ms", "itl p50"),
                 ("itl_p99_ms", "itl p99"), ("e2e_p99_ms", "e2e p99"))


def row_status(decision: LevelsDecision, result: LevelResult, row: LevelRow) -> str:
    """`SERVED`, `refused`, or '' -- plus `fallback` for a served baseline that breaks a limit (never `WINNER`
    beside `BROKEN`: a fallback is not an answer to the limit)."""
    served = served_at(decision, result.level) == row.id
    if served:
        return "SERVED (fallback)" if row.id == BASELINE and not all(v.ok for v in row.verdicts) else "SERVED"
    return "refused" if row.refused else ""


def level_table(decision: LevelsDecision) -> str:
    """The level table for a terminal: per level, each config's label, median tok/s, speed-up with its run range,
    latency medians, what is served, and the limits broken (figure > limit); the policy and not-possible lines
    after."""
    names = {row.id: "baseline" if row.id == BASELINE else decision.labels.get(row.id, row.id)
             for result in decision.levels for row in result.rows}
    width = max([len(n) for n in names.values()] + [6])
    head = (f"{'level':>5}  {'config':<{width}} {'tok/s':>8}  {'speed-up':<24}"
            + "".join(f"{label:>9}" for _, label in TABLE_METRICS) + "  status")
    lines = [head]
    for result in decision.levels:
        for row in result.rows:
            cells = "".join(f"{_cell(row.latencies_ms.get(m)):>9}" for m, _ in TABLE_METRICS)
            status = row_status(decision, result, row)
            broken = "; ".join(f"breaks {_limit(v)}: {_ms(v.figure_ms)}" for v in row.verdicts if not v.ok)
            lines.append(f"{result.level:>5}  {names[row.id]:<{width}} {row.median_tok_s:>8.2f}  "
                         f"{speedup_text(result, row):<24}{cells}  {status}{'  ' if status and broken else ''}"
                         f"{broken}")
    limits = limits_text(decision)
    if limits:
        lines.append(f"limits: {limits}")
    return "\n".join(lines)


def limits_text(decision: LevelsDecision) -> str:
    """The SLA limits the levels were checked against: `ttft_p99_ms <= 50 ms at 4` (medians over the re-runs)."""
    found: dict[tuple[str, float], list[int]] = {}
    for result in decision.levels:
        for verdict in result.rows[0].verdicts if result.rows else ():
            found.setdefault((verdict.metric, verdict.max_ms), []).append(result.level)
    return "; ".join(f"{metric} <= {limit:g} ms at {', '.join(str(x) for x in levels)} in flight"
                     for (metric, limit), levels in found.items())


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}ms"
