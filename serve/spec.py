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

Algorithm = Literal["none", "ngram", "eagle", "eagle3", "standalone", "llama_ngram_simple", "llama_ngram_map_k",
                    "llama_ngram_map_k4v", "llama_ngram_mod", "llama_ngram_cache", "llama_draft", "vllm_ngram",
                    "vllm_suffix"]


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
    # SGLang's external corpus: a suffix automaton over documents loaded at start (and at runtime), drafting beside
    # the trie within `external_sam_budget` of the draft nodes; `/flush_cache` keeps it.
    external_corpus: str | None = Field(None, description="JSONL of strings loaded at start (SGLang: the path)")
    external_sam_budget: int = Field(0, ge=0, description="draft nodes reserved for the corpus subtree")
    external_corpus_max_tokens: int = Field(10_000_000, ge=1, description="start fails past this many corpus tokens")


class _DraftModelSpec(FrozenModel):
    # steps/topk/draft are None = "let the engine choose" (SGLang's auto params); all three or none.
    draft_model: str | None = Field(None, description="draft model path or id; required")
    num_steps: int | None = Field(None, ge=1, description="draft depth")
    topk: int | None = Field(None, ge=1, description="tree width: branching per draft step")
    num_draft_tokens: int | None = Field(None, ge=1, description="verify width: tree nodes including the root")


# SGLang 0.5.23's own adaptive tiers (`speculative/adaptive_spec_params.py` DEFAULT_ADAPTIVE_CONFIG): candidate
# num_steps per batch-size bucket (a batch routes to the largest bucket at or below its size); 0 = no drafting.
DEFAULT_ADAPTIVE_STEPS: dict[int, tuple[int, ...]] = {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}


class _EagleFamilySpec(_DraftModelSpec):
    # SGLang runs its adaptive controller for EAGLE and EAGLE3 only, with topk 1 (`adaptive_unsupported_reason`).
    adaptive: bool = Field(False, description="SGLang's runtime controller (--speculative-adaptive): num_steps per "
                           "batch-size bucket from candidate steps, with hysteresis; topk 1; steps/topk/draft tokens "
                           "unset = SGLang's (topk 1, the middle candidate, steps + 1)")
    adaptive_steps: dict[int, tuple[int, ...]] | None = Field(
        None, description="candidate steps per batch-size bucket (--speculative-adaptive-config); None = SGLang's "
        "default tiers. A study serves its adaptive winner as measured and only suggests steps from its level table")


class EagleSpec(_EagleFamilySpec):
    algorithm: Literal["eagle"] = "eagle"


class Eagle3Spec(_EagleFamilySpec):
    algorithm: Literal["eagle3"] = "eagle3"


def adaptive_candidates(steps: dict[int, tuple[int, ...]] | None) -> list[int]:
    """Every num_steps an adaptive engine may run (SGLang sizes its buffers for the union): `--speculative-num-steps`,
    when given, must be one of them."""
    return sorted({s for entry in (steps or DEFAULT_ADAPTIVE_STEPS).values() for s in entry})


class StandaloneSpec(_DraftModelSpec):
    """A smaller model of the same tokenizer drafts `num_steps` x `topk` trees."""

    algorithm: Literal["standalone"] = "standalone"


# --- llama.cpp `llama-server` speculative types (engine kind "llama_cpp"; its own tagged variants) ---------------
# llama.cpp's menu is not SGLang's: other algorithms, other knobs, so its variants carry llama.cpp's own names
# (`--spec-type X` -> algorithm `llama_X`, knobs after the `--spec-*` flags; defaults are llama-server's) and never
# collide with none/ngram/eagle/eagle3/standalone. The baseline stays `none`. Rendered to flags by
# serve/engines/llama_cpp/flags.py. `threads` (-t) is searchable per trial here: on a CPU box it is a real knob.


class _LlamaSpec(FrozenModel):
    threads: int | None = Field(None, ge=1, description="llama-server -t; None = the study's engine.threads")


class _LlamaNgramLookupSpec(_LlamaSpec):
    # ngram-simple / ngram-map-k / ngram-map-k4v: look up the last size_n tokens, draft the size_m tokens that followed
    size_n: int = Field(12, ge=1, le=1024, description="lookup n-gram length (--spec-ngram-*-size-n)")
    size_m: int = Field(48, ge=1, le=1024, description="draft m-gram length (--spec-ngram-*-size-m)")
    min_hits: int = Field(1, ge=1, description="hits an n-gram needs before its m-gram is drafted")


class LlamaNgramSimpleSpec(_LlamaNgramLookupSpec):
    algorithm: Literal["llama_ngram_simple"] = "llama_ngram_simple"


class LlamaNgramMapKSpec(_LlamaNgramLookupSpec):
    algorithm: Literal["llama_ngram_map_k"] = "llama_ngram_map_k"


class LlamaNgramMapK4vSpec(_LlamaNgramLookupSpec):
    algorithm: Literal["llama_ngram_map_k4v"] = "llama_ngram_map_k4v"


class LlamaNgramModSpec(_LlamaSpec):
    algorithm: Literal["llama_ngram_mod"] = "llama_ngram_mod"
    n_match: int = Field(24, ge=1, description="lookup length (--spec-ngram-mod-n-match)")
    n_min: int = Field(48, ge=0, description="fewest draft tokens worth verifying (--spec-ngram-mod-n-min)")
    n_max: int = Field(64, ge=1, description="most draft tokens (--spec-ngram-mod-n-max)")


class LlamaNgramCacheSpec(_LlamaSpec):
    algorithm: Literal["llama_ngram_cache"] = "llama_ngram_cache"
    dynamic_cache: bool = Field(True, description="a dynamic lookup cache file, fresh per engine start")
    static_cache: str | None = Field(None, description="a static lookup cache file (--lookup-cache-static)")


class LlamaDraftSpec(_LlamaSpec):
    """`--spec-type draft-simple`: a smaller GGUF of the same vocabulary drafts greedily."""

    algorithm: Literal["llama_draft"] = "llama_draft"
    draft_model: str | None = Field(None, description="draft GGUF: a known model id (id@f32 for F32) or a path")
    draft_n_max: int = Field(3, ge=1, description="most draft tokens per step (--spec-draft-n-max)")
    draft_n_min: int = Field(0, ge=0, description="fewest draft tokens worth verifying (--spec-draft-n-min)")
    p_min: float = Field(0.0, ge=0, le=1, description="stop drafting below this draft probability")
    p_split: float = Field(0.1, ge=0, le=1, description="speculative split probability (--spec-draft-p-split)")


LLAMA_CPP_SPECS: tuple[type[FrozenModel], ...] = (
    LlamaNgramSimpleSpec, LlamaNgramMapKSpec, LlamaNgramMapK4vSpec, LlamaNgramModSpec, LlamaNgramCacheSpec,
    LlamaDraftSpec)
LlamaCppSpec = Union[LlamaNgramSimpleSpec, LlamaNgramMapKSpec, LlamaNgramMapK4vSpec, LlamaNgramModSpec,
                     LlamaNgramCacheSpec, LlamaDraftSpec]


# --- vLLM speculative methods (engine kind "vllm"; its own tagged variants, as llama.cpp's) ---------------------------
# vLLM's `--speculative-config` JSON keys, under `vllm_<method>` so they never collide with SGLang's names. Rendered by
# serve/engines/vllm/flags.py.


class VllmNgramSpec(FrozenModel):
    """vLLM `method: ngram` (prompt lookup): the longest suffix of the request's own tokens, between
    `prompt_lookup_min` and `prompt_lookup_max` long, found earlier in them proposes the tokens that followed it. No
    state outside the request."""

    algorithm: Literal["vllm_ngram"] = "vllm_ngram"
    # vLLM has no default K for ngram (it must be given); the lookup lengths default to vLLM's own (5 and 5)
    num_speculative_tokens: int = Field(3, ge=1, le=64, description="K: most draft tokens per step")
    prompt_lookup_min: int = Field(5, ge=1, description="shortest suffix n-gram matched")
    prompt_lookup_max: int = Field(5, ge=1, description="longest suffix n-gram matched")


class VllmSuffixSpec(FrozenModel):
    """vLLM `method: suffix` (Arctic Inference's suffix decoding): drafts from a suffix tree of the request's prompt
    and from a global tree of earlier requests' outputs, kept across requests (up to `max_cached_requests`, FIFO), so
    what it drafts depends on what the server answered before. Field names, defaults and ranges are those of vLLM
    0.32.0's `SpeculativeConfig` (`_validate_suffix_decoding`); `arctic-inference` must be in vLLM's venv."""

    algorithm: Literal["vllm_suffix"] = "vllm_suffix"
    # vLLM's unset K is the tree depth (24); suffix decoding drafts a varying number per step, K is the cap
    num_speculative_tokens: int = Field(24, ge=1, le=64, description="K: most draft tokens per step")
    suffix_decoding_max_tree_depth: int = Field(24, ge=1, description="deepest suffix tree: prefix match plus "
                                                "draft length are at most this")
    # Arctic's cache refuses more than 2**31 - 1 (an int32) when vLLM's worker builds it, minutes into a start
    suffix_decoding_max_cached_requests: int = Field(10000, ge=0, le=0x7FFFFFFF, description="earlier requests' "
                                                     "outputs kept in the global tree, FIFO; 0 = no global tree "
                                                     "(prompt trees only, nothing kept between requests)")
    suffix_decoding_max_spec_factor: float = Field(1.0, ge=0, description="draft at most this times the prefix "
                                                   "match length")
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1, description="draft only tokens whose frequency-"
                                                  "estimated probability is at least this")


VLLM_SPECS: tuple[type[FrozenModel], ...] = (VllmNgramSpec, VllmSuffixSpec)


def validate_vllm_spec(spec: FrozenModel, prefix: str = "spec") -> list[Violation]:
    """Rules vLLM refuses at start (minutes into a launch on a CPU), checked before one. Pure. (vllm_suffix's ranges
    are all per field, in its pydantic fields.)"""
    if isinstance(spec, VllmNgramSpec) and spec.prompt_lookup_min > spec.prompt_lookup_max:
        return [Violation(f"{prefix}.prompt_lookup_min", "vllm_ngram: prompt_lookup_min <= prompt_lookup_max must hold",
                          f"prompt_lookup_min={spec.prompt_lookup_min}, prompt_lookup_max={spec.prompt_lookup_max}")]
    return []


def algorithm_of(spec_type: type[FrozenModel]) -> str:
    """The union's tag of one variant: its `algorithm` field's only value."""
    return str(spec_type.model_fields["algorithm"].default)


# Every list of algorithm names below is read off the variants, so a new variant cannot be missed by one of them.
SGLANG_SPECS: tuple[type[FrozenModel], ...] = (NoSpec, NgramSpec, EagleSpec, Eagle3Spec, StandaloneSpec)
SGLANG_ALGORITHMS: tuple[str, ...] = tuple(algorithm_of(t) for t in SGLANG_SPECS)
DRAFT_MODEL_ALGORITHMS: tuple[str, ...] = tuple(algorithm_of(t) for t in SGLANG_SPECS if issubclass(t, _DraftModelSpec))
# draft heads: trained on the target's hidden states, so no replay from token ids alone can predict them
EAGLE_HEAD_ALGORITHMS: tuple[str, ...] = tuple(algorithm_of(t) for t in SGLANG_SPECS if issubclass(t, _EagleFamilySpec))
LLAMA_CPP_ALGORITHMS: tuple[str, ...] = tuple(algorithm_of(t) for t in LLAMA_CPP_SPECS)
VLLM_ALGORITHMS: tuple[str, ...] = tuple(algorithm_of(t) for t in VLLM_SPECS)


def validate_llama_cpp_spec(spec: FrozenModel, prefix: str = "spec") -> list[Violation]:
    """Rules llama-server does not check itself or answers with a crash or a silent clamp. Pure."""
    found = []
    if isinstance(spec, LlamaNgramModSpec) and spec.n_min > spec.n_max:
        found.append(Violation(f"{prefix}.n_min", f"{spec.algorithm}: n_min <= n_max must hold",
                               f"n_min={spec.n_min}, n_max={spec.n_max}"))
    if isinstance(spec, LlamaDraftSpec):
        if not spec.draft_model:
            found.append(Violation(
                f"{prefix}.draft_model", "llama_draft needs a draft model (set draft_model in the search space: a "
                "known model id such as smollm2-135m, id@f32, or a .gguf path)", "draft_model=None"))
        if spec.draft_n_min > spec.draft_n_max:
            found.append(Violation(f"{prefix}.draft_n_min", "llama_draft: draft_n_min <= draft_n_max must hold",
                                   f"draft_n_min={spec.draft_n_min}, draft_n_max={spec.draft_n_max}"))
    if isinstance(spec, LlamaNgramCacheSpec) and not spec.dynamic_cache and not spec.static_cache:
        found.append(Violation(f"{prefix}.dynamic_cache", "llama_ngram_cache needs a dynamic or a static cache "
                               "(set dynamic_cache: true or static_cache: <file>)",
                               "dynamic_cache=False, static_cache=None"))
    return found


SpecConfig = Annotated[
    Union[NoSpec, NgramSpec, EagleSpec, Eagle3Spec, StandaloneSpec, LlamaCppSpec, VllmNgramSpec, VllmSuffixSpec],
    Field(discriminator="algorithm")
]
SPEC_ADAPTER: TypeAdapter[SpecConfig] = TypeAdapter(SpecConfig)
SPEC_TYPES: dict[str, type[FrozenModel]] = {algorithm_of(t): t for t in (*SGLANG_SPECS, *LLAMA_CPP_SPECS, *VLLM_SPECS)}


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
    if isinstance(spec, LLAMA_CPP_SPECS):
        return validate_llama_cpp_spec(spec, prefix)
    if isinstance(spec, VLLM_SPECS):
        return validate_vllm_spec(spec, prefix)
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
    if spec.external_sam_budget > spec.num_draft_tokens - 1:
        # SGLang refuses this at start-up (speculative_hook.py) when a corpus is given; the CPU engine always does.
        found.append(Violation(
            f"{prefix}.external_sam_budget", "ngram: external_sam_budget <= num_draft_tokens - 1 must hold",
            f"external_sam_budget={spec.external_sam_budget}, num_draft_tokens={spec.num_draft_tokens}"))
    if spec.external_corpus is not None and spec.external_sam_budget == 0:
        found.append(Violation(
            f"{prefix}.external_sam_budget", "ngram: a corpus needs external_sam_budget > 0 (SGLang refuses 0)",
            f"external_corpus={spec.external_corpus!r}, external_sam_budget=0"))
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
    found += _validate_adaptive(spec, prefix)
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


def _validate_adaptive(spec: EagleSpec | Eagle3Spec | StandaloneSpec, prefix: str) -> list[Violation]:
    """SGLang turns adaptive off, with only a log warning, where `adaptive_unsupported_reason` says so (for a single
    engine config: topk other than 1), so such a trial would measure a static config under an adaptive label; and it
    refuses steps outside the candidates (`_init_adaptive_speculative_params`)."""
    if not isinstance(spec, _EagleFamilySpec):
        return []
    found = []
    if spec.adaptive_steps is not None and not spec.adaptive:
        found.append(Violation(f"{prefix}.adaptive_steps", f"{spec.algorithm}: adaptive_steps needs adaptive: true",
                               "adaptive=False"))
    for bucket, steps in (spec.adaptive_steps or {}).items():
        if bucket < 1 or not steps or any(s < 0 for s in steps):
            found.append(Violation(f"{prefix}.adaptive_steps", "each bucket >= 1 maps to a non-empty list of steps "
                                   ">= 0 (SGLang's loader rule)", f"{bucket}: {list(steps)}"))
    if not spec.adaptive:
        return found
    if spec.topk not in (None, 1):
        found.append(Violation(f"{prefix}.topk", f"{spec.algorithm}: adaptive runs topk 1 only (SGLang would turn it "
                               "off and run the static config)", f"adaptive=True, topk={spec.topk}"))
    candidates = adaptive_candidates(spec.adaptive_steps)
    if spec.num_steps is not None and spec.num_steps not in candidates:
        found.append(Violation(f"{prefix}.num_steps", f"{spec.algorithm}: with adaptive, num_steps must be one of the "
                               f"candidate steps {candidates} (SGLang refuses others)", f"num_steps={spec.num_steps}"))
    return found


def draft_token_count(spec: SpecConfig) -> int:
    """Draft tokens a spec asks the target to verify per step (0 for the baseline); used by tie-breaking."""
    value = getattr(spec, "num_draft_tokens", None)
    if value is None:  # llama.cpp's and vLLM's variants count draft tokens without the root
        fields = ("draft_n_max", "n_max", "size_m", "num_speculative_tokens")
        return int(next((getattr(spec, f) for f in fields if hasattr(spec, f)), 0))
    return int(value) - 1 if value else 0
