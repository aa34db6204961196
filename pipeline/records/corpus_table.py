"""The study's "corpus vs no corpus" answer (pure, over the study's trial rows), printed after the trial table and
shown in the HTML report. NGRAM trials are compared at equal `num_draft_tokens` only (a longer draft changes tok/s
and accept length by itself): per draft length and corpus setting, the best trial's tok/s and accept length, its
warm-up requests and SAM budget, and the corpus load time paid at every engine start. The corpus files themselves
are the trial's (`pipeline.trial.corpus`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.vocabulary.row import TrialRow

__all__ = ["CorpusCell", "corpus_comparison", "corpus_label", "format_corpus_table"]


def corpus_label(value: Any) -> str:
    """A trial's corpus as reports name it: `none`, or the file's name without its suffix (the search space's
    `warmup` choice is logged as `warmup`: trials record the requested setting, not the written file)."""
    if value in (None, "", "None"):
        return "none"
    return Path(str(value)).stem


@dataclass(frozen=True)
class CorpusCell:
    """One line of the corpus comparison: the best COMPLETE NGRAM trial of one (draft length, corpus) pair."""

    draft_tokens: int
    corpus: str
    trials: int
    best: str
    tput_tok_s: float
    accept_len: float | None
    vs_baseline: float | None
    sam_budget: int | None
    warmup_requests: int | None
    load_s: float | None


def corpus_comparison(rows: Sequence[TrialRow]) -> list[CorpusCell]:
    """Corpus vs no corpus at equal draft tokens (module docstring). Empty when no NGRAM trial used a corpus (a study
    without the corpus dimension has nothing to compare). Ordered by draft length, `none` first. Pure."""
    done = [r for r in rows if r.algorithm == "ngram" and r.complete and r.tput_tok_s is not None
            and r.whole("spec.num_draft_tokens") is not None]
    if not any(corpus_label(r.params.get("spec.external_corpus")) != "none" for r in done):
        return []
    groups: dict[tuple[int, str], list[TrialRow]] = {}
    for r in done:
        key = (r.whole("spec.num_draft_tokens") or 0, corpus_label(r.params.get("spec.external_corpus")))
        groups.setdefault(key, []).append(r)
    cells = []
    for (draft, corpus), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "none", kv[0][1])):
        best = max(members, key=lambda r: r.tput_tok_s or 0.0)
        cells.append(CorpusCell(draft, corpus, len(members), best.name, best.tput_tok_s or 0.0, best.accept_len,
                                best.vs_baseline, best.whole("spec.external_sam_budget"),
                                best.whole("trial.warmup_requests"), best.corpus_load_s))
    return cells


def format_corpus_table(cells: Sequence[CorpusCell]) -> str:
    """The comparison as text (stdout and the HTML report); draft lengths measured with only one corpus setting are
    listed too, marked, since they compare nothing."""
    lines = [f"{'draft tokens':>12} {'corpus':<20} {'trials':>6} {'best tok/s':>10} {'vs base':>7} {'accept':>6} "
             f"{'SAM budget':>10} {'warm-up':>7} {'load s':>7}  best trial"]
    settings = {d: sum(1 for c in cells if c.draft_tokens == d) for d in {c.draft_tokens for c in cells}}
    for c in cells:
        ratio = f"{c.vs_baseline:.2f}x" if c.vs_baseline else "-"
        accept = f"{c.accept_len:.2f}" if c.accept_len is not None else "-"
        budget = str(c.sam_budget) if c.sam_budget is not None and c.corpus != "none" else "-"
        load = f"{c.load_s:.2f}" if c.load_s is not None else "-"
        warm = str(c.warmup_requests) if c.warmup_requests is not None else "-"
        alone = "  (no other corpus setting at this draft length)" if settings[c.draft_tokens] < 2 else ""
        lines.append(f"{c.draft_tokens:>12} {c.corpus:<20} {c.trials:>6} {c.tput_tok_s:>10.2f} {ratio:>7} "
                     f"{accept:>6} {budget:>10} {warm:>7} {load:>7}  {c.best}{alone}")
    return "\n".join(lines)
