"""What an engine can be told about speculative decoding: the `SpecConfig` tagged union and its rules.

Pure: no torch, no sglang, no I/O. Both floors of the house use it: `serve/` engines render it into flags,
`pipeline/` searches over it.

Field names and meanings follow SGLang 0.5.23 (`--speculative-*` flags), so that one search space means the same
thing on the embedded CPU engine and on SGLang. Defaults are SGLang's where SGLang has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Algorithm = Literal["none", "ngram", "eagle", "eagle3", "standalone"]
ALGORITHMS: tuple[str, ...] = ("none", "ngram", "eagle", "eagle3", "standalone")
DRAFT_MODEL_ALGORITHMS: tuple[str, ...] = ("eagle", "eagle3", "standalone")


class FrozenModel(BaseModel):
    """Base for every config type: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoSpec(FrozenModel):
    """Plain decoding: the baseline every study measures first."""

    algorithm: Literal["none"] = "none"


class NgramSpec(FrozenModel):
    """SGLang NGRAM: drafts come from one global trie of recently decoded tokens, shared by all requests."""

    algorithm: Literal["ngram"] = "ngram"
    num_draft_tokens: int = Field(12, ge=1, description="verify width: tree nodes including the root")
    max_bfs_breadth: int = Field(10, ge=1, description="tree width; SGLang also copies it into eagle_topk")
    min_bfs_breadth: int = Field(1, ge=1, description="BFS breadth used for the longest suffix match")
    match_type: Literal["BFS", "PROB"] = Field("BFS", description="BFS: recency order; PROB: frequency order")
    max_trie_depth: int = Field(18, ge=2, description="the n-gram window: longest n-gram stored and matched")
    capacity: int = Field(10_000_000, ge=1, description="trie node budget, LRU-evicted when full")


class _DraftModelSpec(FrozenModel):
    # steps/topk/draft are None = "let the engine choose" (SGLang's auto params); all three or none.
    draft_model: str | None = Field(None, description="draft model path or id; required")
    num_steps: int | None = Field(None, ge=1, description="draft depth")
    topk: int | None = Field(None, ge=1, description="tree width: branching per draft step")
    num_draft_tokens: int | None = Field(None, ge=1, description="verify width: tree nodes including the root")


class EagleSpec(_DraftModelSpec):
    algorithm: Literal["eagle"] = "eagle"


class Eagle3Spec(_DraftModelSpec):
    algorithm: Literal["eagle3"] = "eagle3"


class StandaloneSpec(_DraftModelSpec):
    """A smaller model of the same tokenizer drafts `num_steps` x `topk` trees."""

    algorithm: Literal["standalone"] = "standalone"


SpecConfig = Annotated[
    Union[NoSpec, NgramSpec, EagleSpec, Eagle3Spec, StandaloneSpec], Field(discriminator="algorithm")
]
SPEC_ADAPTER: TypeAdapter[SpecConfig] = TypeAdapter(SpecConfig)
SPEC_TYPES: dict[str, type[FrozenModel]] = {
    "none": NoSpec, "ngram": NgramSpec, "eagle": EagleSpec, "eagle3": Eagle3Spec, "standalone": StandaloneSpec,
}


def parse_spec(data: object) -> SpecConfig:
    """Build a `SpecConfig` from a dict (or JSON-like data); raises pydantic's ValidationError."""
    return SPEC_ADAPTER.validate_python(data)


@dataclass(frozen=True)
class Violation:
    """One broken rule: which field, which rule, which value. `str()` is the message a user reads."""

    field: str
    rule: str
    value: str

    def __str__(self) -> str:
        return f"{self.field}: {self.rule}, got {self.value}"


def tree_candidates(num_steps: int, topk: int) -> int:
    """How many draft candidates an EAGLE-style tree of this shape holds (SGLang `organize_draft_results`)."""
    return topk + (num_steps - 1) * topk * topk


def validate_spec(spec: SpecConfig, prefix: str = "spec") -> list[Violation]:
    """Every rule SGLang does not check itself but that crashes or misleads it (reference §2). Pure."""
    if isinstance(spec, NgramSpec):
        return _validate_ngram(spec, prefix)
    if isinstance(spec, (EagleSpec, Eagle3Spec, StandaloneSpec)):
        return _validate_draft_model(spec, prefix)
    return []


def _validate_ngram(spec: NgramSpec, prefix: str) -> list[Violation]:
    found = []
    if spec.min_bfs_breadth > spec.max_bfs_breadth:
        # SGLang accepts this at argument time; its C++ constructor then kills the worker.
        found.append(Violation(
            f"{prefix}.min_bfs_breadth", "ngram: min_bfs_breadth <= max_bfs_breadth must hold",
            f"min_bfs_breadth={spec.min_bfs_breadth}, max_bfs_breadth={spec.max_bfs_breadth}"))
    if spec.capacity <= spec.max_trie_depth:
        # Not checked anywhere in 0.5.23; capacity == depth crashes the scheduler (sglang issue #36495).
        found.append(Violation(
            f"{prefix}.capacity", "ngram: capacity > max_trie_depth must hold",
            f"capacity={spec.capacity}, max_trie_depth={spec.max_trie_depth}"))
    if spec.num_draft_tokens < 2:
        found.append(Violation(
            f"{prefix}.num_draft_tokens", "ngram: num_draft_tokens >= 2 must hold (the root plus at least one draft)",
            f"num_draft_tokens={spec.num_draft_tokens}"))
    return found


def _validate_draft_model(spec: EagleSpec | Eagle3Spec | StandaloneSpec, prefix: str) -> list[Violation]:
    found = []
    algo = spec.algorithm
    if not spec.draft_model:
        found.append(Violation(
            f"{prefix}.draft_model", f"{algo} needs a draft model (set model.drafts.{algo} in the study)",
            "draft_model=None"))
    shape = {"num_steps": spec.num_steps, "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens}
    given = [k for k, v in shape.items() if v is not None]
    if given and len(given) != len(shape):
        # SGLang answers a partial set with a bare AssertionError.
        missing = [k for k in shape if k not in given]
        found.append(Violation(
            f"{prefix}.{missing[0]}", f"{algo}: num_steps, topk and num_draft_tokens must be all set or all unset",
            ", ".join(f"{k}={v}" for k, v in shape.items())))
        return found
    steps, topk, draft = spec.num_steps, spec.topk, spec.num_draft_tokens
    if steps is None or topk is None or draft is None:  # all unset: the engine chooses
        return found
    if draft < 2:
        found.append(Violation(
            f"{prefix}.num_draft_tokens", f"{algo}: num_draft_tokens >= 2 must hold", f"num_draft_tokens={draft}"))
    if topk == 1 and draft != steps + 1:
        # SGLang silently rewrites draft := steps + 1, so the trial would not measure what it says.
        found.append(Violation(
            f"{prefix}.num_draft_tokens", f"{algo}: topk == 1 requires num_draft_tokens == num_steps + 1 (SGLang would silently change it)",
            f"num_steps={steps}, topk={topk}, num_draft_tokens={draft}"))
    elif draft - 1 > tree_candidates(steps, topk):
        found.append(Violation(
            f"{prefix}.num_draft_tokens",
            f"{algo}: num_draft_tokens - 1 <= topk + (num_steps - 1) * topk^2 must hold (the candidates the tree holds)",
            f"num_draft_tokens={draft}, num_steps={steps}, topk={topk} "
            f"({draft - 1} > {tree_candidates(steps, topk)})"))
    return found


def draft_token_count(spec: SpecConfig) -> int:
    """Draft tokens a spec asks the target to verify per step (0 for the baseline); used by tie-breaking."""
    value = getattr(spec, "num_draft_tokens", None)
    return int(value) - 1 if value else 0
