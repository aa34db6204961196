"""Promotion: should a finalist replace the baseline? (DESIGN §8)

The decision at the top of this module is pure and unit-tested; the MLflow registry action lives in
`pipeline/registry.py`, and the command line at the bottom (`python -m pipeline.promote`) shows, rolls back or
re-points the production alias of a finished study.

Rule: every finalist and the baseline are re-measured (>= `min_runs` runs each, fresh replica, flush + warm-up each
time). Score = median - 1.4826 x MAD of those throughputs (a noise-penalized centre: a config whose runs scatter is
not trusted with its median). A finalist that failed an equivalence check is disqualified first (unless the policy
says equivalence is not required); among the rest, the bar is baseline score x (1 + margin) (computed as score +
margin x |score| so a negative score from very noisy runs still raises it), and a finalist must beat
it strictly. Of those that do, every one whose score is within `tie_tolerance` of the best counts as tied, and the
one with the fewest draft tokens wins (cheaper to verify, less to lose when the workload shifts); then the higher
score, then the id. If no finalist beats the bar, the decision is "keep_baseline", which is a valid outcome.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve.spec import SpecConfig, draft_token_count

MAD_TO_SIGMA = 1.4826  # scales the MAD of normal data to its standard deviation


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PromotionPolicy(_Frozen):
    """How sure the tuner must be before replacing the baseline."""

    min_runs: int = Field(3, ge=3, description="re-measured runs per config; a MAD of fewer than 3 is meaningless")
    margin: float = Field(0.03, ge=0.0, description="required gain over the baseline score, as a fraction")
    tie_tolerance: float = Field(0.01, ge=0.0, lt=1.0, description="scores within this fraction of the best tie")
    require_equivalence: bool = Field(True, description="a finalist that failed an equivalence check cannot win")


class Finalist(_Frozen):
    """A re-measured candidate. Give its `spec` or its `draft_tokens` (draft tokens per verify step, root excluded)."""

    id: str = Field(min_length=1)
    throughputs: tuple[float, ...]
    equivalent: bool = Field(description="every equivalence check of every run passed")
    spec: SpecConfig | None = None
    draft_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Finalist:
        if self.spec is None and self.draft_tokens is None:
            raise ValueError(f"finalist {self.id!r}: give spec or draft_tokens (needed by the tie rule), got neither")
        if self.spec is not None and self.draft_tokens not in (None, draft_token_count(self.spec)):
            raise ValueError(
                f"finalist {self.id!r}: draft_tokens={self.draft_tokens} disagrees with its spec, which asks for "
                f"{draft_token_count(self.spec)}; give one of the two")
        _check_runs(f"finalist {self.id!r}", self.throughputs)
        return self

    @property
    def n_draft_tokens(self) -> int:
        if self.draft_tokens is not None:
            return self.draft_tokens
        return draft_token_count(self.spec)  # type: ignore[arg-type]  # _check guarantees a spec here


class RunStats(_Frozen):
    """Robust summary of repeated throughput runs (tok/s). `mad` is the raw median absolute deviation."""

    runs: tuple[float, ...]
    median: float
    mad: float
    score: float


class CandidateScore(RunStats):
    """One finalist's result: its stats, and why it lost (None for the winner)."""

    id: str
    draft_tokens: int
    equivalent: bool
    beats_baseline: bool
    lost_because: str | None


class Decision(_Frozen):
    """The outcome: promote `winner`, or keep the baseline. `bar` is the score a finalist had to beat."""

    kind: Literal["promote", "keep_baseline"]
    winner: str | None
    baseline: RunStats
    bar: float
    candidates: tuple[CandidateScore, ...]
    policy: PromotionPolicy
    reason: str


def run_stats(throughputs: Sequence[float]) -> RunStats:
    """Median, MAD and score = median - 1.4826 x MAD of repeated throughput runs."""
    runs = tuple(float(x) for x in throughputs)
    _check_runs("runs", runs)
    median = statistics.median(runs)
    mad = statistics.median(abs(x - median) for x in runs)
    return RunStats(runs=runs, median=median, mad=mad, score=median - MAD_TO_SIGMA * mad)


def decide(
    baseline_throughputs: Sequence[float], finalists: Sequence[Finalist], policy: PromotionPolicy | None = None,
) -> Decision:
    """Apply the promotion rule (module docstring). Raises ValueError on too few runs or duplicate ids."""
    policy = policy or PromotionPolicy()
    if len(baseline_throughputs) < policy.min_runs:
        raise ValueError(
            f"baseline has {len(baseline_throughputs)} throughput run(s); policy.min_runs={policy.min_runs} requires "
            f"at least {policy.min_runs} (re-measure it, or lower min_runs)")
    seen: set[str] = set()
    for f in finalists:
        if f.id in seen:
            raise ValueError(f"finalist id {f.id!r} appears twice; finalist ids must be unique")
        seen.add(f.id)
        if len(f.throughputs) < policy.min_runs:
            raise ValueError(
                f"finalist {f.id!r} has {len(f.throughputs)} throughput run(s); policy.min_runs={policy.min_runs} "
                f"requires at least {policy.min_runs} (re-measure it, or lower min_runs)")

    base = run_stats(baseline_throughputs)
    # Written as score + margin x |score| so that a (pathological) negative baseline score still raises the bar.
    bar = base.score + policy.margin * abs(base.score)
    stats = {f.id: run_stats(f.throughputs) for f in finalists}
    allowed = [f for f in finalists if f.equivalent or not policy.require_equivalence]
    beating = [f for f in allowed if stats[f.id].score > bar]

    winner: Finalist | None = None
    tied: list[Finalist] = []
    if beating:
        best = max(stats[f.id].score for f in beating)
        band = best - policy.tie_tolerance * abs(best)
        tied = [f for f in beating if stats[f.id].score >= band]
        winner = min(tied, key=lambda f: (f.n_draft_tokens, -stats[f.id].score, f.id))

    bar_text = f"{bar:.2f} tok/s (baseline score {base.score:.2f} + {policy.margin:.1%} margin)"
    beating_ids = {f.id for f in beating}
    tied_ids = {f.id for f in tied}
    candidates = []
    for f in finalists:
        s = stats[f.id]
        lost = None
        if winner is None or f.id != winner.id:
            lost = _why_lost(f, s, winner, stats, beating_ids, tied_ids, policy, bar_text)
        candidates.append(CandidateScore(
            **s.model_dump(), id=f.id, draft_tokens=f.n_draft_tokens, equivalent=f.equivalent,
            beats_baseline=f.id in beating_ids, lost_because=lost))

    return Decision(
        kind="promote" if winner else "keep_baseline", winner=winner.id if winner else None, baseline=base, bar=bar,
        candidates=tuple(candidates), policy=policy,
        reason=_reason(winner, stats, tied, finalists, allowed, policy, bar_text))


def _check_runs(where: str, runs: Sequence[float]) -> None:
    if not runs:
        raise ValueError(f"{where}: no throughput runs given")
    bad = [x for x in runs if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"{where}: throughputs must be finite numbers >= 0 (tok/s), got {bad} in {list(runs)}")


def _describe(f: Finalist, s: RunStats) -> str:
    return f"{f.id!r} scored {s.score:.2f} tok/s (median {s.median:.2f}, MAD {s.mad:.2f}, {len(s.runs)} runs)"


def _why_lost(
    f: Finalist, s: RunStats, winner: Finalist | None, stats: dict[str, RunStats], beating_ids: set[str],
    tied_ids: set[str], policy: PromotionPolicy, bar_text: str,
) -> str:
    if policy.require_equivalence and not f.equivalent:
        return "failed an equivalence check (outputs differ from the baseline's), so it cannot be promoted"
    if f.id not in beating_ids or winner is None:
        return f"score {s.score:.2f} does not beat the bar {bar_text}"
    if f.id in tied_ids:
        if f.n_draft_tokens > winner.n_draft_tokens:
            return (f"tied with {winner.id!r} (score {s.score:.2f} within {policy.tie_tolerance:.1%} of the best) "
                    f"but uses more draft tokens ({f.n_draft_tokens} > {winner.n_draft_tokens})")
        return (f"tied with {winner.id!r} on score band and draft tokens ({f.n_draft_tokens}); "
                "lost the tie-break (higher score, then id)")
    best = max(beating_ids, key=lambda i: (stats[i].score, i))
    return (f"score {s.score:.2f} beats the bar but trails the best, {best!r} ({stats[best].score:.2f}), by more than "
            f"the {policy.tie_tolerance:.1%} tie tolerance")


def _reason(
    winner: Finalist | None, stats: dict[str, RunStats], tied: list[Finalist], finalists: Sequence[Finalist],
    allowed: list[Finalist], policy: PromotionPolicy, bar_text: str,
) -> str:
    allowed_ids = {f.id for f in allowed}
    disqualified = sorted(f.id for f in finalists if f.id not in allowed_ids)
    if not finalists:
        return "keep baseline: no finalists were given"
    if winner is not None:
        text = f"promote: {_describe(winner, stats[winner.id])}, which beats the bar {bar_text}"
        if winner.equivalent:
            text += "; its outputs passed every equivalence check"
        else:
            text += "; its outputs FAILED an equivalence check (allowed because policy.require_equivalence=False)"
        if len(tied) > 1:
            others = sorted(f.id for f in tied if f.id != winner.id)
            text += (f"; chosen over {others} (scores within {policy.tie_tolerance:.1%} of the best) for the fewest "
                     f"draft tokens ({winner.n_draft_tokens})")
    elif not allowed:
        return f"keep baseline: every finalist failed an equivalence check ({disqualified})"
    else:
        best = max(allowed, key=lambda f: stats[f.id].score)
        text = (f"keep baseline: no finalist beats the bar {bar_text}; "
                f"the best eligible, {_describe(best, stats[best.id])}")
    if disqualified:
        text += f"; disqualified for failing an equivalence check: {disqualified}"
    return text


# --- command line: python -m pipeline.promote ---------------------------------------------------------------------

def _parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.promote",
        description="Show the promoted config of a study, roll production back to 'previous', or point it at a "
                    "registered version. The decision itself is made at the end of `python -m pipeline.tune`.")
    parser.add_argument("--study", metavar="FILE", help="the study file the study was run with")
    parser.add_argument("--name", help="study name (default: from the study file, else 'default')")
    parser.add_argument("--output", help="output folder of the study (default: ./runs/<name>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the output folder)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--rollback", action="store_true", help="swap aliases production and previous")
    action.add_argument("--set-version", metavar="N", help="point production at registered version N")
    parser.add_argument("--deploy", metavar="URL", help="after moving the alias, wait until the production endpoint "
                        "at URL (started with `python -m serve.production`, which follows the alias and rolls with "
                        "a new replica before the old one stops) serves the new version")
    parser.add_argument("--api-key", help="API key for --deploy's /v1/config check (default: $SPECDEC_API_KEYS)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds --deploy waits (default 900)")
    return parser


def wait_for_endpoint(url: str, version: str, api_key: str | None, timeout_s: float) -> None:
    """Poll `<url>/v1/config` until it reports `version`; raises TimeoutError."""
    import time

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            seen = httpx.get(f"{url.rstrip('/')}/v1/config", headers=headers, timeout=10).json().get("version")
            if str(seen) == str(version):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} still serves version {seen} after {timeout_s:.0f} s (wanted {version}); is "
                       f"`python -m serve.production` running with --follow-alias-s > 0?")


def main(argv: Sequence[str] | None = None) -> int:
    import json
    import sys

    from pipeline.config import load_study
    from pipeline.errors import PipelineError
    from pipeline.record import Tracker, default_tracking_uri
    from pipeline.registry import PRODUCTION, load_serving_config, rollback, set_production

    args = _parser().parse_args(argv)
    overrides = {k: v for k, v in {"name": args.name, "output_dir": args.output,
                                   "tracking.uri": args.tracking_uri}.items() if v}
    try:
        study = load_study(args.study, overrides)
        uri = study.tracking.uri or default_tracking_uri(study.output_path())
        tracker = Tracker(uri, study.tracking.experiment or study.name)
        name = study.tracking.registered_model or f"specdec-{study.name}"
        if args.rollback:
            now, before = rollback(tracker, name)
            print(f"{name}: production -> version {now} (previous -> {before})")
        elif args.set_version:
            set_production(tracker, name, args.set_version)
            print(f"{name}: production -> version {args.set_version}")
        config = load_serving_config(uri, f"models:/{name}@{PRODUCTION}")
        print(json.dumps(config, indent=2))
        if args.deploy:
            from mlflow.tracking import MlflowClient

            import os

            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            version = client.get_model_version_by_alias(name, PRODUCTION).version
            key = args.api_key or (os.environ.get("SPECDEC_API_KEYS", "").split(",")[0] or None)
            wait_for_endpoint(args.deploy, str(version), key, args.timeout)
            print(f"{args.deploy} now serves {name} version {version}")
        return 0
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - MLflow errors (no such model/alias) are user-facing here
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
