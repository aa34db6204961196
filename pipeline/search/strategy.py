"""Which search a study runs (`search.strategy`, pipeline/config/search.py): `tpe` over launches, `grid` (every point
of a small space, in order), or `simulate-first` where the acceptance simulator can model every config of the space:
NGRAM always (its trie is replayed), llama-server's `ngram-simple` and vLLM's `ngram` (lookups in the request's own
tokens, pipeline/simulate/chains.py), STANDALONE where the engine can replay its draft model on the baseline's tokens
(the CPU engine). Never EAGLE/EAGLE3 (a draft head reads the target's hidden states, which only a launch computes)
nor temperature > 0 (sampled tokens differ from the baseline's). Pure apart from `enqueue_grid`, which tells the
Optuna study."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import StudyConfig
from pipeline.search.space import SearchSpace, grid_points
from pipeline.simulate.predict import PREDICTABLE_METRICS
from serve.engines import algorithms_of, replays_drafts
from serve.spec import EAGLE_HEAD_ALGORITHMS

__all__ = ["SIMULATED_ALGORITHMS", "Strategy", "enqueue_grid", "resolve_strategy"]

# draft-free algorithms the simulator replays (NGRAM with SGLang 0.5.23's trie, schedule and external corpus;
# llama-server 11434's stateless ngram-simple lookup; vLLM 0.32.0's stateless ngram proposer). llama.cpp's other
# n-gram types keep state of their own (maps, hashed pools, lookup files) that is not replayed: a space with them is
# searched by launches.
SIMULATED_ALGORITHMS = frozenset({"none", "ngram", "llama_ngram_simple", "vllm_ngram"})
# draft-model algorithms it replays where the engine kind can run its draft model over recorded tokens
DRAFT_REPLAYED_ALGORITHMS = frozenset({"standalone"})


@dataclass(frozen=True)
class Strategy:
    name: str  # "tpe" | "simulate-first" | "grid"
    reason: str  # why, in words for the dry run and the log

    @property
    def simulated(self) -> bool:
        return self.name == "simulate-first"

    def fall_back(self, problem: str) -> Strategy:
        """tpe instead, for a reason found after the resolution (e.g. the prompts cannot be tokenized here)."""
        return Strategy("tpe", f"falls back to tpe (every trial a launch): {problem}")


def _unsimulable(study: StudyConfig, space: SearchSpace) -> str | None:
    replayed = DRAFT_REPLAYED_ALGORITHMS if replays_drafts(study.engine.kind) else frozenset()
    others = sorted(set(space.algorithms) - SIMULATED_ALGORITHMS - replayed)
    heads = [a for a in others if a in EAGLE_HEAD_ALGORITHMS]
    if heads:
        return (f"the space has {heads}: an EAGLE head drafts from the target's hidden states, which only a launch "
                "of the target computes")
    if others:
        return (f"the space has {others}: on engine {study.engine.kind} the simulator models SGLang's NGRAM, "
                "llama-server's ngram-simple and vLLM's ngram only (a draft model's trees are replayed on the CPU "
                "engine)")
    if "ngram" in space.algorithms and "ngram" not in algorithms_of(study.engine.kind):
        return f"engine {study.engine.kind} has no SGLang NGRAM (its n-gram types are its own algorithms)"
    if study.workload.temperature > 0:
        return (f"workload.temperature={study.workload.temperature}: sampled outputs differ from the baseline's, "
                "so its tokens do not fix the accept lengths")
    unknown = [m for m in study.objective.metrics if m not in PREDICTABLE_METRICS]
    if unknown:
        return f"objective metric(s) {unknown} are not predicted (predicted: {list(PREDICTABLE_METRICS)})"
    return None


def resolve_strategy(study: StudyConfig, space: SearchSpace) -> Strategy:
    """The strategy the study runs and why; an explicit simulate-first that cannot be simulated falls back to tpe
    (said so in the reason), as auto does."""
    wanted = study.search.strategy
    if wanted == "tpe":
        return Strategy("tpe", "search.strategy is tpe: every trial is a launch")
    if wanted == "grid":
        return Strategy("grid", "search.strategy is grid: every point of the space is launched in order after the "
                        f"baseline, as budget.max_trials={study.budget.max_trials} permits; tpe for any budget left")
    problem = _unsimulable(study, space)
    if problem is None and study.budget.max_trials < 2:
        problem = "budget.max_trials=1 launches the baseline only: nothing is left to predict"
    if problem is not None:
        return Strategy("tpe", "").fall_back(problem)
    settings = study.search.simulate
    launches = min(settings.launches + 1, study.budget.max_trials)
    return Strategy("simulate-first", (
        f"{'search.strategy is simulate-first' if wanted == 'simulate-first' else 'auto: every config is simulable'}"
        f", greedy: the baseline is launched and answers the warm-up split, the simulator predicts every config "
        f"(up to {settings.points} points, {settings.seconds:g} s), then {launches - 1} predicted config(s) are "
        f"launched ({launches} of budget.max_trials={study.budget.max_trials} with the baseline; more, by "
        f"{settings.widen_by} a launch, while the median prediction error exceeds {settings.error_threshold:.0%})"))


def enqueue_grid(ot_study: Any, space: SearchSpace, max_trials: int) -> int:
    """Enqueue every point of the space after the baseline (at most `max_trials` - 1), unless the study has any trial
    besides its baseline already (a resumed study keeps what it ran). Returns the points enqueued."""
    if len(ot_study.get_trials(deepcopy=False)) > 1:
        return 0
    points = [p for p in grid_points(space) if p.get("algorithm") != "none"][:max(0, max_trials - 1)]
    for params in points:
        ot_study.enqueue_trial(params)
    return len(points)
