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

A search trial's gate (`judge_pass`, over a `Gate`: the study's mode as it applies to one config) compares its
measured outputs with the baseline trial's (`StoredBaseline`, read from the baseline's run once per trial):
- `exact`: against the baseline's measured outputs.
- `baseline-noise`: the baseline measured once more on a freshly launched engine (`Gate.reference_pass`), and that
  second pass is the noise a trial's divergence is tested against (`pipeline.decide.noise`). A trial always runs on
  another launch than the baseline's first pass, so the reference must too: noise within one launch (same allocator
  state, same CUDA graphs) understates it. It still measures decode kernels against decode kernels, where a trial's
  verify runs extend kernels over a tree mask, so a lossless trial may diverge systematically more than the
  reference: a NOT_EQUIVALENT verdict here is not reported to the search as a measurement
  (`Outcome.reports_measurement`), and finalists are judged again at every level (`pipeline.study.finalists`).
- `deterministic`: the baseline and every compared trial measure once more on an engine started with the engine
  kind's deterministic-inference flags (`Gate.flags`; SGLang's `--enable-deterministic-inference`), whose greedy
  outputs do not depend on the batch; those outputs must be identical, while the trial's throughput is the one
  measured without the flags. On an engine that is batch-invariant as it is (the CPU engine in fp32) `deterministic`
  is `exact` (`mode_as_run`), with no extra launch.
The passes are measured by the trial (`pipeline.trial.gate`); everything here is judged on what they measured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pipeline.decide.noise import NoiseVerdict, noise_test, run_outputs
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord, to_records
from pipeline.vocabulary.outcome import Outcome

NOT_COMPARED_DETERMINISTIC = ("the baseline has no deterministic-inference pass (it failed, or the engine refused "
                              "its flags), so no output of the search was compared with it")
# the modes that compare with a pass the baseline measured once more, and that pass's name
PASS_OF_MODE = {"baseline-noise": "noise", "deterministic": "deterministic"}


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
    return compare_outputs(to_records(baseline), to_records(candidate), threshold=threshold)


def compare_outputs(baseline: Sequence[RequestRecord], candidate: Sequence[RequestRecord], *,
                    threshold: float) -> EquivalenceReport:
    """`check_equivalence` over records."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(
            f"threshold is the required share of identical outputs and must be in (0, 1], got threshold={threshold!r} "
            "(1.0 for fp32, lower only where the dtype is known not to be bit-exact)")
    base = _outputs_by_prompt(baseline)
    cand = _outputs_by_prompt(candidate)
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


def judge(mode: str, reference: Sequence[RequestRecord], candidates: Sequence[Sequence[RequestRecord]], *,
          baseline_others: Sequence[Sequence[RequestRecord]] = (), threshold: float = 1.0,
          alpha: float = 0.05) -> EquivalenceReport:
    """The candidate's run(s) against the baseline's reference run at the same level, under `mode`.

    `exact` and `deterministic`: every candidate run must pass `check_equivalence` at `threshold` (the report is the
    worst run's). `baseline-noise`: the sign test over all candidate runs, with the baseline's other runs at that level
    as its noise (`baseline_others`); the exact figures are those of the first candidate run."""
    runs = list(candidates)
    if not runs:
        raise ValueError("judge: no candidate run to compare")
    if mode in ("exact", "deterministic"):
        reports = [compare_outputs(reference, run, threshold=threshold) for run in runs]
        worst = min(reports, key=lambda r: (r.passed, r.identical_share))
        return worst.model_copy(update={"mode": mode})
    if mode != "baseline-noise":
        raise ValueError(f"unknown equivalence mode {mode!r}: exact, baseline-noise or deterministic")
    first = compare_outputs(reference, runs[0], threshold=1.0)
    verdict = noise_test(run_outputs(reference), [run_outputs(o) for o in baseline_others],
                         [run_outputs(run) for run in runs], alpha=alpha)
    exact_part = first.reason.split(": ", 1)[1] if ": " in first.reason else first.reason
    return first.model_copy(update={"mode": mode, "noise": verdict, "passed": verdict.passed,
                                    "reason": f"{verdict.reason}; exact figures: {exact_part}"})


def _outputs_by_prompt(records: Iterable[RequestRecord]) -> dict[int, list[tuple[int, ...]]]:
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


# --- a search trial's gate -----------------------------------------------------------------------------------------


def mode_as_run(mode: str, deterministic_flags: Sequence[str] | None) -> str:
    """The study's equivalence mode as it runs: `deterministic` on a batch-invariant engine (no flags to add) is
    `exact`."""
    return "exact" if mode == "deterministic" and not deterministic_flags else mode


@dataclass(frozen=True)
class StoredBaseline:
    """What a trial needs of the study's COMPLETE baseline trial, read from its run once
    (`pipeline.records.trial_runs.read_baseline`): its throughput (early stopping's bar), its measured requests (the
    outputs every comparison starts from) and, where the trial's mode compares with one, the pass it measured once
    more (`noise`, `deterministic`; None: it has none)."""

    tput_tok_s: float | None
    requests: tuple[RequestRecord, ...]
    noise: tuple[RequestRecord, ...] | None = None
    deterministic: tuple[RequestRecord, ...] | None = None


@dataclass(frozen=True)
class Gate:
    """The study's equivalence mode as it applies to one config (`pipeline.trial.gate.gate_for` builds it)."""

    setting: str  # `promotion.equivalence`
    algorithm: str
    temperature: float
    threshold: float  # `exact`: the share of outputs that must be identical
    alpha: float  # `baseline-noise`: the sign test's level
    flags: tuple[str, ...] = ()  # what the engine kind adds to start deterministically

    @property
    def mode(self) -> str:
        """The mode as it runs (`mode_as_run`)."""
        return mode_as_run(self.setting, self.flags)

    @property
    def compares(self) -> bool:
        """Whether the config's greedy outputs are compared with the baseline's (a speculative config, temperature
        0)."""
        return self.algorithm != "none" and self.temperature == 0

    @property
    def stored_pass(self) -> str | None:
        """The baseline's pass the comparison reads beside its measured requests (`PASS_OF_MODE`), None for none."""
        return PASS_OF_MODE.get(self.mode) if self.compares else None

    @property
    def reference_pass(self) -> str | None:
        """The pass the baseline measures once more, for later trials to compare with: `noise` on a fresh launch,
        `deterministic` with `flags`. None for any other config, at temperature > 0, and in `exact`."""
        return PASS_OF_MODE.get(self.mode) if self.algorithm == "none" and self.temperature == 0 else None



@dataclass(frozen=True)
class PassVerdict:
    """One pass judged as a trial: its outcome, why, and the equivalence report where outputs were compared."""

    outcome: Outcome
    reason: str
    report: EquivalenceReport | None = None


def judge_pass(measured: Measurement, gate: Gate | None = None, baseline: StoredBaseline | None = None,
               own: Measurement | None = None) -> PassVerdict:
    """A pass as its trial ends: its `ending`; then, with a `gate` (a search trial's), a COMPLETE pass's greedy
    outputs against the baseline's (None: no baseline completed) by the study's mode: NOT_EQUIVALENT when they fail
    it, COMPLETE with the reason where they were not compared. `own`: the trial's own deterministic pass, which
    `deterministic` compares where the baseline has one."""
    ending = measured.ending
    if ending.outcome is not Outcome.COMPLETE or gate is None:
        return PassVerdict(ending.outcome, ending.reason)
    passed, reason, report = _compared(gate, measured.records, baseline, own)
    if passed is False:
        return PassVerdict(Outcome.NOT_EQUIVALENT, reason, report)
    return PassVerdict(Outcome.COMPLETE, "" if passed else reason, report)


def _compared(gate: Gate, records: Sequence[RequestRecord], baseline: StoredBaseline | None,
              own: Measurement | None) -> tuple[bool | None, str, EquivalenceReport | None]:
    """(passed: None = not compared, why, the report)."""
    if gate.algorithm == "none":
        return True, "", None
    if gate.temperature > 0:
        return None, "sampling (temperature > 0): outputs are not compared", None
    if baseline is None:
        return None, "no baseline outputs to compare with (the baseline did not complete)", None
    reference, candidate, threshold = baseline.requests, records, gate.threshold
    others: tuple[Sequence[RequestRecord], ...] = ()
    if gate.mode == "baseline-noise":
        if baseline.noise is None:
            return None, "not compared: the baseline has no second pass to measure its own noise with", None
        others = (baseline.noise,)
    elif gate.mode == "deterministic":
        if baseline.deterministic is None:  # its pass failed or the engine refused it: the figure stands, unpromoted
            return None, f"not compared: {NOT_COMPARED_DETERMINISTIC}", None
        if own is None:
            raise ValueError("deterministic equivalence judges the trial's own deterministic pass: measure it "
                             "first")
        if own.failure:
            return False, ("the deterministic-inference pass failed, so equivalence is not shown: "
                           f"{own.failure_text()}"), None
        reference, candidate, threshold = baseline.deterministic, own.records, 1.0  # identical, batch-invariant
    report = judge(gate.mode, reference, [candidate], baseline_others=others, threshold=threshold, alpha=gate.alpha)
    return report.passed, report.reason, report
