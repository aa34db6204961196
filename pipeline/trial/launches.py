"""Engine launches: what a study will cost in them (`plan_launches`, printed by `--dry-run`) and what it cost
(`record_launches`: the `engine_launches` of every trial and finalist run, summed on the study run).

A launch of a big model costs minutes of every GPU it holds. Shared (serve/replica/sharing.py): consecutive trials of one
trial process whose engine settings are equal, differing only in warm-up length or corpus; a finalist's runs at the
study's other levels (each run starts one engine, then flushes, warms up and measures at every level). Not shared: a
finalist's runs among themselves (each run measures a freshly started engine), the baseline's noise pass
(`baseline-noise`: a launch's own noise is not another launch's), and the deterministic-inference passes of
`equivalence: deterministic` (another command line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.config import StudyConfig
from pipeline.console_log import detail
from pipeline.records.gaps import keeping
from pipeline.records.trial_runs import child_rows
from pipeline.vocabulary.resolution import Resolution
from pipeline.trial.gate import effective_mode
from pipeline.trial.context import TrialContext
from serve.engines.base import ReplicaConfig
from serve.replica.sharing import can_share

__all__ = ["LaunchPlan", "plan_launches", "format_plan", "record_launches"]


@dataclass(frozen=True)
class LaunchPlan:
    trials: int  # valid search trials (each needs an engine)
    search: int  # their launches, consecutive ones sharing where they can
    deterministic: int  # the baseline's and the trials' deterministic-inference passes, never shared
    noise: int  # the baseline's noise pass (baseline-noise): a fresh launch of its own
    finalists: int  # baseline + finalists x runs, levels sharing a run's launch
    finalists_unshared: int  # the same without sharing: one launch per run and level

    @property
    def total(self) -> int:
        return self.search + self.deterministic + self.noise + self.finalists

    @property
    def unshared(self) -> int:
        return self.trials + self.deterministic + self.noise + self.finalists_unshared


def plan_launches(study: StudyConfig, resolutions: Sequence[Resolution]) -> LaunchPlan:
    """Launches of `study` if its search ran the sampled `resolutions` (the baseline first) in that order in one trial
    process. Pure."""
    # Only what varies between a study's trials decides whether two of them share a launch; the study's own engine
    # settings are the same for all (and the trial lifecycle, which builds the full config, imports Ray).
    configs = [ReplicaConfig(engine=study.engine.kind, model=study.model.target, spec=r.config.spec,
                             max_running_requests=r.config.max_running_requests)
               for r in resolutions if r.valid and r.config is not None]
    search = sum(1 for i, c in enumerate(configs) if i == 0 or not can_share(configs[i - 1], c))
    compared = sum(1 for r in resolutions if r.valid and r.config is not None and r.config.spec.algorithm != "none")
    deterministic = compared + 1 if effective_mode(study) == "deterministic" and study.workload.temperature == 0 else 0
    runs = (1 + study.promotion.finalists) * study.promotion.runs if study.promotion.finalists else 0
    return LaunchPlan(trials=len(configs), search=search, deterministic=deterministic,
                      noise=int(effective_mode(study) == "baseline-noise"), finalists=runs,
                      finalists_unshared=runs * len(study.concurrency))


def format_plan(study: StudyConfig, plan: LaunchPlan) -> str:
    """The plan as the dry run prints it (comment lines)."""
    lines = [f"# engine launches, if the search ran these configs in this order in one trial process: {plan.total} "
             f"({plan.unshared} without launch sharing)",
             f"#   search: {plan.search} for {plan.trials} trials (equal engine settings, differing only in warm-up "
             "length or corpus, share one)"]
    if plan.deterministic:
        lines.append(f"#   deterministic-inference passes: {plan.deterministic} (the baseline and every compared trial "
                     "once more, on engines started with the deterministic flags)")
    elif effective_mode(study) == "baseline-noise":
        lines.append("#   the baseline's noise pass: 1 (a fresh launch: its reference is another launch's noise)")
    if plan.finalists:
        lines.append(f"#   finalists: {plan.finalists} (baseline + {study.promotion.finalists} finalist(s) x "
                     f"{study.promotion.runs} runs, each run's launch measuring every level of {study.concurrency}; "
                     f"{plan.finalists_unshared} with a launch per run and level)")
    return "\n".join(lines)


def record_launches(ctx: TrialContext) -> int:
    """Sum the study's `engine_launches` (every trial and finalist run's, logged with it) onto the study run;
    returns the sum. Never fails the study."""
    try:
        counts = [n for r in child_rows(ctx.tracker, ctx.parent_run_id, kind=None)
                  if (n := r.metric("engine_launches")) is not None]
        total, passes = int(sum(counts)), len(counts)
        with keeping("the study run's metric engine_launches"):  # a refused write leaves the study incomplete
            ctx.tracker.log_figures(ctx.parent_run_id, {"engine_launches": float(total)})
        # after the headline, which ends the console: the log file (and --verbose) only
        detail(f"engine launches: {total} for {passes} measured trial and finalist runs")
        return total
    except Exception as exc:  # noqa: BLE001 - bookkeeping must never fail the study
        detail(f"engine launches could not be recorded: {type(exc).__name__}: {exc}")
        return -1
