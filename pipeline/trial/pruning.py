"""Early stopping wired into a search trial: after each measured chunk the trial reports its partial result to Tune and
asks the rule (`pipeline.decide.stopping.check`, pure) whether it can still beat the baseline; a trial that cannot is PRUNED.

The baseline's figures come from its MLflow run, read once by the trial (`pipeline.records.trial_runs.read_baseline`:
any driver on any node finds them there); the I/O here is the chunked measurement (`measure_phase`, called by
`pipeline.trial.engine_pass.measure_config`).
Finalist re-runs are never watched.
Chunks are `concurrency` requests (1 at the search level the rule applies to), each one `run_phase`, laid end to end
in the phase window: the pause between chunks (the rule, Tune's report) is left out of the window, so a watched
trial's throughput is its requests' own; every trial of the search, the baseline included, is measured this way.

Open-loop arrivals (`workload.arrival.mode: poisson`) switch early stopping off: chunks run one after the other would
close the loop again (a chunk waits for the previous one), and the rule compares throughputs, which under open loop
follow the offered rate rather than the config. Such a phase is one `run_open_loop` on the study's seeded schedule,
the same for every trial and finalist run, so they all see the same arrival times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import StudyConfig, TrialConfig
from pipeline.measure.load import LoadRequest, run_phase
from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord, chunks, continue_records, summarize
from pipeline.measure.openloop import run_open_loop
from pipeline.vocabulary.outcome import MEASURING
from pipeline.decide.equivalence import StoredBaseline
from pipeline.decide.stopping import BaselineFigures, StoppingPolicy, StopResult, VerifyCost, baseline_figures, check, rule_off
from serve.spec import draft_token_count

Progress = Callable[[list[RequestRecord], StopResult | None], None]


@dataclass
class Watch:
    """Called by a trial's measurement after each chunk with the measured records so far and the engine's
    `/server_info`: reports progress (Tune's intermediate result) and answers the rule's verdict, None where the
    rule does not apply (the baseline, no baseline yet, concurrency > 1). `last` keeps the latest verdict."""

    baseline: BaselineFigures | None
    total_requests: int
    draft_tokens: int
    max_new_tokens: int
    policy: StoppingPolicy
    progress: Progress | None = None
    last: StopResult | None = None
    _curve: tuple[VerifyCost | None] | None = None

    def __call__(self, records: list[RequestRecord], server_info: ServerInfo) -> StopResult | None:
        result = None
        if self.baseline is not None:
            result = check(self.baseline, records, total_requests=self.total_requests,
                           draft_tokens=self.draft_tokens, max_new_tokens=self.max_new_tokens,
                           verify_cost=self._verify_cost(server_info), policy=self.policy)
            self.last = result
        if self.progress is not None:
            self.progress(records, result)
        return result

    def _verify_cost(self, server_info: ServerInfo) -> VerifyCost | None:
        if self._curve is None:
            try:
                self._curve = (verify_curve(server_info),)
            except (ValueError, KeyError, TypeError):  # a malformed curve: cost 1, which errs towards continuing
                self._curve = (None,)
        return self._curve[0]


def verify_curve(server_info: ServerInfo) -> VerifyCost | None:
    """The engine's verify-cost curve (`verify_cost.sizes`/`relative`); None when it reports none (probe off,
    SGLang). Raises what a malformed curve raises (KeyError, TypeError, ValueError)."""
    curve = server_info.verify_cost
    if not curve:
        return None
    return VerifyCost(sizes=tuple(curve["sizes"]), relative=tuple(curve["relative"]))


def measure_phase(url: str, items: list[Any], kwargs: dict[str, Any], watch: Watch | None,
                  server_info: ServerInfo, arrival: Any = None,
                  seed: int = 0) -> tuple[list[RequestRecord], str | None]:
    """The measurement phase: in one piece without a watch; else chunk by chunk, asking the watch after each one.
    With `arrival` (a `pipeline.config.ArrivalSettings`) in poisson mode: open loop on the schedule seeded by `seed`
    (records labelled with `kwargs["concurrency"]`), never watched.
    Returns the records and, when the rule stopped the trial, its reason (the bound that stopped it). Chunk by chunk,
    a lost request ends the phase at once: the trial fails whatever the rest would measure (a dead or hung engine
    would only make every later request wait out its timeout)."""
    if arrival is not None and arrival.open_loop:
        if watch is not None:
            raise ValueError("open-loop measurement cannot be watched: early stopping is off under "
                             "workload.arrival.mode poisson (trial_watch returns no watch)")
        return run_open_loop(url, items, rate_per_s=arrival.rate_per_s, seed=seed, phase="measure",
                             max_duration_s=arrival.max_duration_s, label=kwargs["concurrency"],
                             temperature=kwargs.get("temperature", 0.0),
                             timeout_s=kwargs.get("timeout_s", 300.0)), None
    if watch is None:
        return run_phase(url, items, phase="measure", **kwargs), None
    records: list[RequestRecord] = []
    offset = 0.0
    for chunk in chunks(len(items), kwargs["concurrency"]):
        got = run_phase(url, items[chunk.start:chunk.stop], phase="measure", **kwargs)
        records += continue_records(got, offset_s=offset, first_position=chunk.start)
        # The next chunk starts where this one's last request ended: the time the watch takes (Tune's report waits
        # for the driver) is not engine time, so Summary.window_s counts the requests only.
        offset += max((r.start_s + r.e2e_s for r in got), default=0.0)
        if any(not r.ok for r in got):
            return records, None
        verdict = watch(records, server_info)
        if verdict is not None and verdict.stop and chunk.stop < len(items):
            return records, verdict.reason
    return records, None


def trial_watch(study: StudyConfig, baseline: StoredBaseline | None, measure: Sequence[LoadRequest],
                config: TrialConfig, progress: Progress | None, unread: str | None = None) -> tuple[Watch | None, str]:
    """The watch for one search trial and a note for its MLflow tag `early_stopping` (on, or why not).
    None when early stopping is off: the trial is then measured in one piece, as before the switch existed.
    `baseline`: the study's COMPLETE baseline as read before the trial (None: none yet, or `unread` says why it could
    not be read: the tracking store's trouble turns the rule off rather than failing the trial)."""
    budget = study.budget
    if not budget.early_stopping:
        return None, "off (budget.early_stopping: false)"
    if study.workload.arrival.open_loop:
        return None, ("off (workload.arrival.mode: poisson: measured chunks would close the loop, and throughput "
                      "follows the offered rate)")
    off = rule_off(enabled=True, algorithm=config.spec.algorithm, concurrency=config.concurrency)
    figures = None
    if off is None and baseline is None:
        off = unread or "no baseline trial has completed yet: nothing to compare with"
    elif off is None and baseline is not None:
        figures = baseline_figures(baseline.tput_tok_s, baseline.requests, budget.early_stopping_sigma)
        off = None if figures else "the baseline measured no throughput"
    policy = StoppingPolicy()
    watch = Watch(baseline=figures, total_requests=len(measure), draft_tokens=draft_token_count(config.spec),
                  max_new_tokens=max((r.max_new_tokens for r in measure), default=1), policy=policy,
                  progress=progress)
    if off or figures is None:
        return watch, f"not applied: {off}"
    step = (f"step {figures.step_s * 1000:.1f} ms" if figures.step_s
            else "no decode step time: analytic rule off")
    return watch, (f"on (alpha {policy.alpha:g}, sigma {figures.sigma:g}, baseline {figures.tput_tok_s:.2f} tok/s, "
                   f"{step})")


def stop_metrics(result: StopResult | None) -> dict[str, float]:
    """The latest verdict's bounds as MLflow metrics (the reason holds them in words)."""
    if result is None:
        return {}
    values = {"stop_requests": float(result.requests), "stop_baseline_low_tok_s": result.baseline_low_tok_s,
              "stop_statistical_high_tok_s": result.statistical_high_tok_s,
              "stop_analytic_high_tok_s": result.analytic_high_tok_s}
    return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}  # MLflow: finite only


def intermediate_report(records: list[RequestRecord], result: StopResult | None, metrics: Sequence[str],
                        modes: Sequence[str], sentinel: dict[str, float], seed: int) -> dict[str, Any]:
    """What a trial reports to Tune after a chunk: every objective metric of the partial measurement (Tune refuses a
    result without them; `sentinel` where a metric has no value yet), outcome MEASURING and the rule's bounds.
    Optuna's single-objective search keeps the first metric as the trial's intermediate value, which a PRUNED trial
    then carries as its value."""
    summary = summarize(records, seed=seed)
    report: dict[str, Any] = {"outcome": MEASURING, "measured_requests": summary.n_requests,
                              **stop_metrics(result)}
    for metric, mode in zip(metrics, modes):
        value = getattr(summary, metric, None)
        report[metric] = float(value) if value is not None else sentinel[mode]
    return report
