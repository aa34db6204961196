"""Greedy-output equivalence of a trial against the baseline: is speculation lossless here, and how nearly?

Pure: no I/O. Greedy speculative decoding must give token-identical outputs (docs/cpu-engine.md); in fp32 the CPU engine does,
in bf16 (and SGLang on GPUs) batched verification shifts logits and outputs drift apart after a while. So the report
gives the share of identical outputs, the mean matched prefix and the first divergence per prompt, and the gate is a
policy threshold on the identical share (1.0 for fp32).

Rules:
- Only measurement-phase requests are compared (warm-up length is itself a searched dimension, so warm-up prompt
  sets differ between trials). Requests are matched by `prompt_index`.
- Full sequences are compared: both sides use the same `max_new_tokens`, so a length difference (one side stopped
  at EOS earlier) is a divergence at the shorter length, not something to truncate away.
- A prompt without a successful output on one side (missing, or its request failed) cannot be shown identical: it
  counts as not identical and is listed. Equivalence that was not checked is not claimed.
- A prompt sent several times (a workload that had to cycle) is identical only if every output on both sides is the
  same sequence; its matched prefix (tokens and fraction) is the worst over all baseline x candidate pairs.

Modes (`promotion.equivalence`, `judge`): `exact` passes on the identical share (above); `baseline-noise` passes
unless the candidate diverges from the baseline's reference run significantly more than the baseline's other runs do
(`pipeline.decide.noise.noise_test`); `deterministic` is `exact` on outputs of deterministic-inference engines (the
caller supplies those outputs). Every report carries the exact figures, so the divergence is visible in every mode.
"""

from __future__ import annotations

from typing import Any

from collections import defaultdict
from collections.abc import Iterable, Sequence

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pipeline.decide.noise import NoiseVerdict, noise_test, run_outputs
from pipeline.measure.summary import RequestRecord, to_records


class EquivalenceReport(BaseModel):
    """How a trial's greedy outputs compare with the baseline's. `passed` = identical_share >= threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    passed: bool
    threshold: float
    identical_share: float
    n_prompts: int
    n_identical: int
    n_compared: int
    mean_prefix_tokens: float | None
    mean_prefix_fraction: float | None
    first_divergence: dict[int, int]
    missing_in_candidate: tuple[int, ...]
    missing_in_baseline: tuple[int, ...]
    inconsistent: tuple[int, ...]
    reason: str
    mode: str = "exact"
    noise: NoiseVerdict | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_equivalence(
    baseline: pa.Table | Iterable[RequestRecord],
    candidate: pa.Table | Iterable[RequestRecord],
    *,
    threshold: float,
) -> EquivalenceReport:
    """Compare the candidate's measurement outputs with the baseline's, prompt by prompt (see the module rules).

    `threshold` is the required share of identical outputs, in (0, 1]. `identical_share` = identical prompts over
    every prompt seen on either side. `mean_prefix_*` average over prompts present on both sides; the fraction is
    prefix / the longer of the two outputs (1.0 for identical outputs, including two empty ones).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(
            f"threshold is the required share of identical outputs and must be in (0, 1], got threshold={threshold!r} "
            "(1.0 for fp32, lower only where the dtype is known not to be bit-exact)")
    base = _outputs_by_prompt(to_records(baseline))
    cand = _outputs_by_prompt(to_records(candidate))
    prompts = sorted(set(base) | set(cand))
    missing_in_candidate = tuple(p for p in prompts if p not in cand)
    missing_in_baseline = tuple(p for p in prompts if p not in base)
    inconsistent = tuple(p for p in prompts if len(set(base.get(p, ()))) > 1 or len(set(cand.get(p, ()))) > 1)

    identical = 0
    prefixes: list[int] = []
    fractions: list[float] = []
    divergence: dict[int, int] = {}
    for p in prompts:
        if p not in base or p not in cand:
            continue
        pairs = [(b, c) for b in base[p] for c in cand[p]]
        prefix = min(common_prefix(b, c) for b, c in pairs)
        prefixes.append(prefix)
        fractions.append(min(_fraction(b, c) for b, c in pairs))
        if len(set(base[p]) | set(cand[p])) == 1:
            identical += 1
        else:
            divergence[p] = prefix

    share = identical / len(prompts) if prompts else 0.0
    passed = bool(prompts) and share >= threshold
    report: dict[str, Any] = dict(
        passed=passed,
        threshold=float(threshold),
        identical_share=share,
        n_prompts=len(prompts),
        n_identical=identical,
        n_compared=len(prefixes),
        mean_prefix_tokens=sum(prefixes) / len(prefixes) if prefixes else None,
        mean_prefix_fraction=sum(fractions) / len(fractions) if fractions else None,
        first_divergence=divergence,
        missing_in_candidate=missing_in_candidate,
        missing_in_baseline=missing_in_baseline,
        inconsistent=inconsistent,
    )
    return EquivalenceReport(**report, reason=_reason(**report))


def judge(mode: str, reference: pa.Table | Iterable[RequestRecord], candidates: Sequence[Iterable[RequestRecord]], *,
          baseline_others: Sequence[Iterable[RequestRecord]] = (), threshold: float = 1.0,
          alpha: float = 0.05) -> EquivalenceReport:
    """The candidate's run(s) against the baseline's reference run at the same level, under `mode`.

    `exact` and `deterministic`: every candidate run must pass `check_equivalence` at `threshold` (the report is the
    worst run's). `baseline-noise`: the sign test over all candidate runs, with the baseline's other runs at that level
    as its noise (`baseline_others`); the exact figures are those of the first candidate run."""
    reference = to_records(reference)
    runs = [to_records(c) for c in candidates]
    if not runs:
        raise ValueError("judge: no candidate run to compare")
    if mode in ("exact", "deterministic"):
        reports = [check_equivalence(reference, run, threshold=threshold) for run in runs]
        worst = min(reports, key=lambda r: (r.passed, r.identical_share))
        return worst.model_copy(update={"mode": mode})
    if mode != "baseline-noise":
        raise ValueError(f"unknown equivalence mode {mode!r}: exact, baseline-noise or deterministic")
    first = check_equivalence(reference, runs[0], threshold=1.0)
    verdict = noise_test(run_outputs(reference), [run_outputs(to_records(o)) for o in baseline_others],
                         [run_outputs(run) for run in runs], alpha=alpha)
    exact_part = first.reason.split(": ", 1)[1] if ": " in first.reason else first.reason
    return first.model_copy(update={"mode": mode, "noise": verdict, "passed": verdict.passed,
                                    "reason": f"{verdict.reason}; exact figures: {exact_part}"})


def _outputs_by_prompt(records: Sequence[RequestRecord]) -> dict[int, list[tuple[int, ...]]]:
    out: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for r in records:
        if r.phase == "measure" and r.ok:
            out[r.prompt_index].append(r.output_ids)
    return dict(out)


def _fraction(b: Sequence[int], c: Sequence[int]) -> float:
    longest = max(len(b), len(c))
    return common_prefix(b, c) / longest if longest else 1.0


def _reason(
    *, passed: bool, threshold: float, identical_share: float, n_prompts: int, n_identical: int,
    mean_prefix_fraction: float | None, first_divergence: dict[int, int], missing_in_candidate: tuple[int, ...],
    missing_in_baseline: tuple[int, ...], inconsistent: tuple[int, ...], **_: object,
) -> str:
    if not n_prompts:
        return "no successful measurement outputs on either side: equivalence cannot be shown"
    verdict = "passed" if passed else "failed"
    cmp = ">=" if passed else "<"
    parts = [f"{verdict}: {n_identical}/{n_prompts} outputs identical ({identical_share:.1%}) {cmp} "
             f"required {threshold:.1%}"]
    if first_divergence:
        shown = ", ".join(f"prompt {p} at token {t}" for p, t in sorted(first_divergence.items())[:5])
        more = f" (+{len(first_divergence) - 5} more)" if len(first_divergence) > 5 else ""
        parts.append(f"first divergence: {shown}{more}")
    if mean_prefix_fraction is not None and mean_prefix_fraction < 1.0:
        parts.append(f"mean matched prefix {mean_prefix_fraction:.1%} of the longer output")
    if missing_in_candidate:
        parts.append(f"no successful candidate output for prompts {list(missing_in_candidate)}")
    if missing_in_baseline:
        parts.append(f"no successful baseline output for prompts {list(missing_in_baseline)}")
    if inconsistent:
        parts.append(f"outputs differ between repeats of the same prompt on one side: {list(inconsistent)}")
    return "; ".join(parts)
