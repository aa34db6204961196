"""The drift test's false-alarm rate and detection delay, measured on seeded synthetic studies and traffic:
`python -m pipeline.loop.drift_check [--seeds N] [--requests N] [--prompts N] [--set key=value ...]`.

Each seed draws a synthetic study (`prompts` prompts, each measured in 3 runs, as the promotion re-runs do) and
live traffic (every request a fresh prompt of the same population), builds the reference as the loop does
(`pipeline.loop.drift.metric_reference`) and runs the detector over the live stream. Populations:
- `accept`: per-prompt accept length ~ Normal(2.4, 0.6) clipped to [1, 5], run-to-run noise sd 0.15;
- `tput`: per-prompt tok/s ~ LogNormal(log 20, 0.4), run-to-run noise 3%;
- `mixed`: 30% copy-heavy prompts (accept ~ Normal(3.8, 0.4)), 70% free text (Normal(1.4, 0.2)), clipped.
False alarms: the share of seeds with any alarm on stationary traffic over `requests` requests (with its 95% upper
bound, Clopper-Pearson style via the rule of three when none). Delay: after the population's mean drops by a
fraction at request `at`, requests until the alarm (median, 95th percentile, share detected within `requests`).
`tests/unit/test_loop_drift.py` runs a smaller sweep of the same functions; docs/loop.md states a larger one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.loop.drift import DetectorState, DriftSettings, metric_reference, update

__all__ = ["POPULATIONS", "run_detector", "false_alarms", "delays", "main"]

Draw = Callable[[Any, int, float], Any]  # (rng, n, mean scale) -> per-prompt values


def _accept(rng: Any, n: int, scale: float) -> Any:
    return np.clip(rng.normal(2.4 * scale, 0.6 * scale, n), 1.0, 5.0)


def _tput(rng: Any, n: int, scale: float) -> Any:
    return rng.lognormal(np.log(20.0 * scale), 0.4, n)


def _mixed(rng: Any, n: int, scale: float) -> Any:
    copy = rng.random(n) < 0.3
    return np.clip(np.where(copy, rng.normal(3.8, 0.4, n), rng.normal(1.4, 0.2, n)) * scale, 1.0, 5.0)


POPULATIONS: dict[str, tuple[Draw, float]] = {"accept": (_accept, 0.15), "tput": (_tput, 0.03),
                                             "mixed": (_mixed, 0.05)}


def run_detector(seed: int, settings: DriftSettings, population: str = "accept", prompts: int = 16,
                 requests: int = 5000, drop: float = 0.0, at: int = 0) -> int | None:
    """Requests seen when the detector alarmed on one seeded study + stream (None: no alarm). With `drop` > 0 the
    live population's scale falls by that fraction from request `at` on."""
    draw, noise = POPULATIONS[population]
    rng = np.random.default_rng(seed)
    per_prompt = draw(rng, prompts, 1.0)
    relative = population == "tput"
    study = [(str(i), float(v * (1 + rng.normal(0, noise)) if relative else v + rng.normal(0, noise)))
             for _ in range(3) for i, v in enumerate(per_prompt)]
    ref = metric_reference("accept_length", 1, study)
    if ref is None:
        return None
    live = draw(rng, requests, 1.0)
    if drop:
        live[at:] = draw(rng, requests - at, 1.0 - drop)
    state = update(DetectorState(metric="accept_length", bucket=1), ref, settings, [float(x) for x in live])
    return state.alarm_at


def false_alarms(settings: DriftSettings, seeds: Sequence[int], **kw: Any) -> int:
    return sum(1 for s in seeds if run_detector(s, settings, **kw) is not None)


def delays(settings: DriftSettings, seeds: Sequence[int], drop: float, at: int, **kw: Any) -> list[int | None]:
    """Requests from the step to the alarm per seed (None: not detected; an alarm before the step counts as 0)."""
    out: list[int | None] = []
    for s in seeds:
        alarm = run_detector(s, settings, drop=drop, at=at, **kw)
        out.append(None if alarm is None else max(0, alarm - at))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.loop.drift_check", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--drops", default="0.3,0.4,0.5")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a DriftSettings field")
    args = parser.parse_args(argv)
    settings = DriftSettings.model_validate({k: float(v) if "." in v else int(v)
                                             for k, v in (item.split("=", 1) for item in args.set)})
    print(f"settings: {settings.model_dump()}; {args.prompts} study prompts x 3 runs; {args.seeds} seeds")
    for population in POPULATIONS:
        seeds = range(args.seeds)
        alarms = false_alarms(settings, seeds, population=population, prompts=args.prompts, requests=args.requests)
        bound = 3 / args.seeds if alarms == 0 else None
        print(f"{population:7s} stationary, {args.requests} requests: {alarms}/{args.seeds} seeds alarmed"
              + (f" (95% upper bound {bound:.2%})" if bound is not None else f" ({alarms / args.seeds:.2%})"))
        for drop in (float(x) for x in args.drops.split(",")):
            found = delays(settings, range(10**6, 10**6 + args.seeds // 2), drop, 500, population=population,
                           prompts=args.prompts, requests=min(args.requests, 5500))
            hit = sorted(d for d in found if d is not None)
            share = len(hit) / len(found)
            text = (f"median {statistics.median(hit):.0f}, p95 {hit[int(0.95 * (len(hit) - 1))]}" if hit else "-")
            print(f"{population:7s} drop {drop:.0%} at request 500: detected {share:.1%} within 5000, delay {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
