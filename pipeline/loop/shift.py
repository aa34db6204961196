"""Workload shift: does live traffic still look like the workload the config was tuned on? Pure.

Two signals, reported beside the drift test (`pipeline.loop.drift`), which says whether the config still performs as
measured; a shift says why it may not, and flags a change before performance shows it:

- Lengths: two-sample Kolmogorov-Smirnov on prompt tokens and on output tokens, the study's measured requests
  against the live ones. A shift is flagged when the KS distance D >= `min_distance` AND its asymptotic p-value <
  `alpha`: the p-value alone would flag trivial differences once thousands of live requests are in, the distance
  alone would flag noise on small samples. Output lengths are capped by each request's `max_tokens`, in the study
  and live alike.
- Text: word n-gram containment. NGRAM speculation drafts from text seen before, so what matters is how much of the
  live text's n-grams the tuned-on workload already holds. Compared on equal footing: k texts from each side,
  `overlap` = share of the distinct n-grams of k live texts found in k workload texts, against `self_overlap` = the
  same share between two disjoint halves of the workload (what "the same kind of traffic" scores). A shift is
  flagged when overlap / self_overlap < `min_overlap_ratio`. `live_self_overlap` (the live texts' own halves) says
  whether the new traffic repeats itself more or less than the old.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import ConfigDict, Field

from serve.spec import FrozenModel

__all__ = ["ShiftSettings", "LengthShift", "TextShift", "ShiftReport", "ks_distance", "ks_pvalue", "length_shift",
           "ngrams", "text_shift", "shift_report"]

_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class _Model(FrozenModel):
    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)


class ShiftSettings(_Model):
    min_distance: float = Field(0.25, gt=0, le=1, description="KS distance at or above which lengths shifted")
    alpha: float = Field(1e-3, gt=0, lt=1, description="KS p-value below which a distance is not noise")
    ngram: int = Field(3, ge=1, le=8, description="word n-gram length of the text signal")
    min_overlap_ratio: float = Field(0.5, gt=0, le=1, description="live overlap / workload self-overlap below "
                                                                  "which the text shifted")
    min_samples: int = Field(20, ge=2, description="fewer live requests (lengths) or texts per half: not tested")
    seed: int = 0


class LengthShift(_Model):
    field: str
    reference: int
    live: int
    distance: float
    p_value: float
    reference_median: float
    live_median: float
    shifted: bool


class TextShift(_Model):
    texts: int = Field(description="texts per side compared (k)")
    overlap: float
    self_overlap: float
    live_self_overlap: float
    ratio: float | None
    shifted: bool

    @property
    def text(self) -> str:
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.2f}"
        return (f"n-gram overlap {self.overlap:.2f} vs the workload's own {self.self_overlap:.2f} (ratio {ratio}, "
                f"{self.texts} texts a side; the live text repeats itself {self.live_self_overlap:.2f})"
                + (" SHIFTED" if self.shifted else ""))


class ShiftReport(_Model):
    shifted: bool
    lengths: tuple[LengthShift, ...]
    text: TextShift | None
    summary: str


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """sup |F_a - F_b| over both samples' values (empirical CDFs, ties handled). Pure."""
    if len(a) == 0 or len(b) == 0:
        raise ValueError("ks_distance: both samples must be non-empty")
    xa, xb = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    points = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, points, side="right") / len(xa)
    fb = np.searchsorted(xb, points, side="right") / len(xb)
    return float(np.max(np.abs(fa - fb)))


def ks_pvalue(distance: float, n: int, m: int) -> float:
    """Asymptotic two-sided p-value of a KS distance between samples of n and m (Kolmogorov's series, with
    Stephens' small-sample correction of the argument)."""
    effective = n * m / (n + m)
    lam = (math.sqrt(effective) + 0.12 + 0.11 / math.sqrt(effective)) * distance
    if lam < 1e-3:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return float(min(1.0, max(0.0, 2 * total)))


def length_shift(name: str, reference: Sequence[float], live: Sequence[float],
                 settings: ShiftSettings) -> LengthShift | None:
    """KS test of one length field; None when either side has fewer than `min_samples`."""
    if len(reference) < settings.min_samples // 2 or len(live) < settings.min_samples:
        return None
    distance = ks_distance(reference, live)
    p_value = ks_pvalue(distance, len(reference), len(live))
    return LengthShift(field=name, reference=len(reference), live=len(live), distance=distance, p_value=p_value,
                       reference_median=float(np.median(reference)), live_median=float(np.median(live)),
                       shifted=distance >= settings.min_distance and p_value < settings.alpha)


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Distinct word n-grams of one text (lower-cased words and punctuation marks)."""
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _containment(part: Sequence[str], whole: Sequence[str], n: int) -> float:
    inner = set().union(*(ngrams(t, n) for t in part)) if part else set()
    outer = set().union(*(ngrams(t, n) for t in whole)) if whole else set()
    return len(inner & outer) / len(inner) if inner else 0.0


def text_shift(reference: Sequence[str], live: Sequence[str], settings: ShiftSettings) -> TextShift | None:
    """The text signal (module docstring); None when either side has too few texts for two halves of
    `min_samples // 2`."""
    k = min(len(reference) // 2, len(live) // 2)
    if k < max(2, settings.min_samples // 2):
        return None
    rng = random.Random(settings.seed)
    ref, cur = list(reference), list(live)
    rng.shuffle(ref)
    rng.shuffle(cur)
    n = settings.ngram
    half_a, half_b = ref[:k], ref[k:2 * k]
    self_overlap = _containment(half_b, half_a, n)
    overlap = _containment(cur[:k], half_a, n)
    live_self = _containment(cur[k:2 * k], cur[:k], n)
    ratio = overlap / self_overlap if self_overlap > 0 else None
    return TextShift(texts=k, overlap=overlap, self_overlap=self_overlap, live_self_overlap=live_self, ratio=ratio,
                     shifted=ratio is not None and ratio < settings.min_overlap_ratio)


def shift_report(reference_lengths: Mapping[str, Sequence[float]], live_lengths: Mapping[str, Sequence[float]],
                 reference_texts: Sequence[str], live_texts: Sequence[str], settings: ShiftSettings) -> ShiftReport:
    """Both signals. `*_lengths`: field name (prompt_tokens, completion_tokens) -> values; texts may be empty (the
    text signal is then not tested and the summary says so)."""
    lengths = tuple(found for name in sorted(reference_lengths)
                    if (found := length_shift(name, reference_lengths[name], live_lengths.get(name, ()), settings)))
    text = text_shift(reference_texts, live_texts, settings)
    parts = []
    for item in lengths:
        parts.append(f"{item.field}: median {item.reference_median:g} -> {item.live_median:g}, "
                     f"KS D={item.distance:.2f} (p={item.p_value:.1g}){' SHIFTED' if item.shifted else ''}")
    untested = sorted(set(reference_lengths) - {item.field for item in lengths})
    if untested:
        parts.append(f"{', '.join(untested)}: too few requests to test")
    if text is not None:
        parts.append(f"text: {text.text}")
    else:
        parts.append("text: not tested (" + ("no texts given" if not reference_texts or not live_texts
                                              else "too few texts on one side") + ")")
    shifted = any(item.shifted for item in lengths) or bool(text and text.shifted)
    return ShiftReport(shifted=shifted, lengths=lengths, text=text,
                       summary=("workload SHIFTED: " if shifted else "workload as tuned: ") + "; ".join(parts))
