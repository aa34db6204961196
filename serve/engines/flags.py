"""Speculative flags per SGLang version range: the one place flag names are written down.

SGLang 0.5.23 renamed the NGRAM flags ("[Spec][Ngram]" series, e.g. sgl-project/sglang#21225): the n-gram window is
`--speculative-ngram-max-trie-depth`; the match-window and branch-length flags are gone and now fail with
"unrecognized arguments". `--cuda-graph-max-bs` is gone too (it is now *ambiguous*, because argparse accepts
prefixes). Flags are always rendered with their exact full names.

The 0.5.23 table was checked against SGLang's own parser (tests/unit/test_sglang_flags.py). The legacy table follows
the pre-0.5.23 docs (`--speculative-ngram-{min,max}-match-window-size`, `--speculative-ngram-branch-length`); the
exact release where the rename landed was not pinned down, so versions before 0.5.23 get the legacy table.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.spec import EagleSpec, Eagle3Spec, NgramSpec, NoSpec, SpecConfig, StandaloneSpec

ALGORITHM_NAMES = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3", "standalone": "STANDALONE"}


@dataclass(frozen=True)
class FlagTable:
    since: tuple[int, int, int]
    ngram: dict[str, str]  # NgramSpec field -> flag; the "n-gram window" is max_trie_depth
    removed: tuple[str, ...]  # flags this version rejects: never emit them


COMMON = {
    "algorithm": "--speculative-algorithm",
    "draft_model": "--speculative-draft-model-path",
    "num_steps": "--speculative-num-steps",
    "topk": "--speculative-eagle-topk",
    "num_draft_tokens": "--speculative-num-draft-tokens",
    "max_running_requests": "--max-running-requests",
}

TABLES: tuple[FlagTable, ...] = (
    FlagTable(
        since=(0, 5, 23),
        ngram={
            "min_bfs_breadth": "--speculative-ngram-min-bfs-breadth",
            "max_bfs_breadth": "--speculative-ngram-max-bfs-breadth",
            "match_type": "--speculative-ngram-match-type",
            "max_trie_depth": "--speculative-ngram-max-trie-depth",
            "capacity": "--speculative-ngram-capacity",
        },
        removed=("--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size",
                 "--speculative-ngram-branch-length", "--cuda-graph-max-bs"),
    ),
    FlagTable(
        since=(0, 0, 0),
        ngram={
            "min_bfs_breadth": "--speculative-ngram-min-bfs-breadth",
            "max_bfs_breadth": "--speculative-ngram-max-bfs-breadth",
            "match_type": "--speculative-ngram-match-type",
            "max_trie_depth": "--speculative-ngram-max-match-window-size",
            "capacity": "--speculative-ngram-capacity",
        },
        removed=("--speculative-ngram-max-trie-depth",),
    ),
)
LATEST = TABLES[0]


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.5.23.post1' -> (0, 5, 23); unparseable parts count as 0."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def table_for(version: str | None) -> FlagTable:
    """The table for an installed SGLang version; None (unknown) gets the newest."""
    if version is None:
        return LATEST
    wanted = parse_version(version)
    return next(t for t in TABLES if wanted >= t.since)


def render_spec(spec: SpecConfig, max_running_requests: int | None = None,
                table: FlagTable = LATEST) -> list[str]:
    """Speculative argv for `spec`. NGRAM never gets steps/topk: SGLang derives them (topk := max breadth)."""
    flags: list[str] = []
    if isinstance(spec, NgramSpec):
        flags += [COMMON["algorithm"], ALGORITHM_NAMES["ngram"],
                  COMMON["num_draft_tokens"], str(spec.num_draft_tokens)]
        for field, flag in table.ngram.items():
            flags += [flag, str(getattr(spec, field))]
    elif isinstance(spec, (EagleSpec, Eagle3Spec, StandaloneSpec)):
        flags += [COMMON["algorithm"], ALGORITHM_NAMES[spec.algorithm]]
        if spec.draft_model:
            flags += [COMMON["draft_model"], spec.draft_model]
        for name in ("num_steps", "topk", "num_draft_tokens"):  # all three or none: validated, not assumed here
            if getattr(spec, name) is not None:
                flags += [COMMON[name], str(getattr(spec, name))]
    elif not isinstance(spec, NoSpec):
        raise TypeError(f"unknown spec type {type(spec).__name__}")
    if max_running_requests is not None:
        flags += [COMMON["max_running_requests"], str(max_running_requests)]
    leaked = sorted(set(flags) & set(table.removed))
    if leaked:
        raise ValueError(f"flags {leaked} do not exist in this SGLang version range (since {table.since})")
    return flags
