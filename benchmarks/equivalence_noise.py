"""False-reject rate and power of the `baseline-noise` equivalence test (pipeline/decide/noise.py), by simulation.

    python benchmarks/equivalence_noise.py [--checks 5000] [--seed 0]

A simulated engine decodes each prompt greedily and, at every token, flips at a near-tie with a small hazard
(per-prompt, drawn once: some prompts have many near-ties, most few); after a flip its continuation is its own. Each
run draws its flips afresh, as a GPU's batch compositions differ from run to run. A lossless config is another
draw of the same process (the null hypothesis: the test's false rejects); a noisier config flips k times as often
(the power). Dependence across prompts: `independent` (every prompt flips on its own) or `run sd S` (each run has a
random intensity, log-normal with sd S, multiplying every prompt's hazard in that run: a run with more batch churn
flips more everywhere), which the sign test's independence assumption does not cover. `m` is the runs per side (1: a search trial against the baseline's two passes; 2: a finalist's three runs
against the baseline's three at one level). Machine-independent: the figures depend on the seed only.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.decide.noise import noise_test  # noqa: E402

PROMPTS, TOKENS, MAX_HAZARD = 64, 128, 0.01


def simulated_run(hazards: list[float], rng: random.Random, tail: int, scale: float) -> dict:
    out = {}
    for k, h in enumerate(hazards):
        p = min(h * scale, 0.999999)
        flip = TOKENS if p <= 0 else min(TOKENS, int(math.log(1 - rng.random()) / math.log(1 - p)))
        out[(k, 0)] = tuple(range(flip)) + (tail,) * (TOKENS - flip)
    return out


def refused(rng: random.Random, m: int, alpha: float, run_sd: float, scale: float) -> bool:
    hazards = [rng.uniform(0.0, MAX_HAZARD) for _ in range(PROMPTS)]

    def intensity() -> float:
        return math.exp(rng.gauss(0.0, run_sd)) if run_sd else 1.0

    ref = simulated_run(hazards, rng, -1, intensity())
    others = [simulated_run(hazards, rng, -2 - i, intensity()) for i in range(m)]
    cands = [simulated_run(hazards, rng, -10 - i, intensity() * scale) for i in range(m)]
    return not noise_test(ref, others, cands, alpha=alpha).passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=5000, help="simulated checks per cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{PROMPTS} prompts x {TOKENS} tokens, hazard per prompt ~ U(0, {MAX_HAZARD}) per token, "
          f"{args.checks} checks per cell, seed {args.seed}")
    print(f"{'prompts':<12} {'m':>2} {'alpha':>6} {'false reject':>12} {'power x1.5':>10} {'x2':>6} {'x3':>6}")
    for run_sd in (0.0, 0.2, 0.5):
        for m in (1, 2):
            for alpha in (0.05, 0.01):
                rng = random.Random(f"{args.seed}-{run_sd}-{m}-{alpha}")
                rates = [sum(refused(rng, m, alpha, run_sd, scale) for _ in range(args.checks)) / args.checks
                         for scale in (1.0, 1.5, 2.0, 3.0)]
                label = f"run sd {run_sd}" if run_sd else "independent"
                print(f"{label:<12} {m:>2} {alpha:>6} {rates[0]:>12.2%} "
                      f"{rates[1]:>10.1%} {rates[2]:>6.1%} {rates[3]:>6.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
