"""The command line (SGLang 0.5.23 flag names) and the resolved engine config. Pure: no torch, no I/O.

Resolution mirrors what SGLang does to the same flags (reference/sglang-0.5.23.md §2), so that `/server_info` reports
what a real SGLang server would have run:
- NGRAM: `speculative_num_draft_tokens` := 12 if unset; `speculative_eagle_topk` := max_bfs_breadth (a given topk is
  ignored, with a warning); `speculative_num_steps` := num_draft_tokens // topk if unset (it has no effect on drafting).
- STANDALONE: steps/topk/draft all unset -> SGLang's auto (3, 1, 4). Otherwise all three must be set, and topk=1
  needs draft = steps + 1 (serve.spec rules; SGLang would assert or silently rewrite instead).
- `max_running_requests` := 48 if unset (SGLang does this for every speculative algorithm; the CPU engine uses the
  same value without speculation, where SGLang would size it from GPU memory).
EAGLE/EAGLE3/NEXTN are rejected: no EAGLE heads for these models exist on PyPI.
"""

from __future__ import annotations

import argparse
import random
from typing import Literal

from pydantic import Field, ValidationError

from serve.engines.cpu.faults import Fault, FaultSpecError, parse_faults
from serve.errors import ConfigError  # the one ConfigError of both floors; re-exported here
from serve.engines.spec_flags import BY_FIELD, SETTINGS, server_args_of
from serve.spec import FrozenModel, NgramSpec, NoSpec, StandaloneSpec, validate_spec

__all__ = ["ConfigError", "EngineConfig", "build_parser", "parse_config", "DEFAULT_MAX_RUNNING_REQUESTS"]

DEFAULT_MAX_RUNNING_REQUESTS = 48
NGRAM_DEFAULT_DRAFT_TOKENS = 12
STANDALONE_AUTO = (3, 1, 4)  # SGLang _auto_choose_speculative_params for STANDALONE: steps, topk, draft
_SGLANG_ONLY = {"EAGLE", "EAGLE3", "NEXTN", "DFLASH", "DSPARK", "UNO", "FROZEN_KV_MTP"}

# SpecConfig field -> the flag that sets it (for error messages): the one table's flags.
_FLAGS = {setting.field: setting.flag for setting in SETTINGS}


class EngineConfig(FrozenModel):
    """Everything the engine was told, resolved. `spec` is a serve.spec variant with auto values filled in."""

    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    dtype: Literal["float32", "bfloat16"] = "float32"
    context_length: int | None = Field(None, ge=1)
    max_running_requests: int = Field(DEFAULT_MAX_RUNNING_REQUESTS, ge=1)
    max_queued_requests: int = Field(128, ge=1)  # bounded waiting queue (scheduler.py); SGLang: unbounded
    max_total_tokens: int | None = Field(None, ge=1)  # token budget of the running requests; None: 4 x context
    random_seed: int = 0
    threads: int | None = Field(None, ge=1)
    weights: Literal["auto", "fp32", "gguf"] = "auto"  # decode matmuls on the GGUF kernel (cpu/gguf_linear.py)
    verify_probe_seconds: float = Field(1.5, ge=0)
    verify_probe_refresh: bool = False  # measure the curve even if probe.py has it cached for this key
    log_level: str = "info"
    spec: NoSpec | NgramSpec | StandaloneSpec = NoSpec()
    speculative_num_steps: int | None = None  # as SGLang reports it (NGRAM: derived, no effect on drafting)
    speculative_eagle_topk: int | None = None
    warnings: tuple[str, ...] = ()
    test_faults: tuple[Fault, ...] = ()  # --test-fault (serve.engines.cpu.faults); never in server_args

    @property
    def algorithm(self) -> str | None:
        """SGLang spelling of the algorithm, None without speculation."""
        return None if self.spec.algorithm == "none" else self.spec.algorithm.upper()

    def server_args(self) -> dict:
        """The resolved config under SGLang ServerArgs field names (what /server_info reports)."""
        spec = self.spec
        speculative = server_args_of(spec)
        if not isinstance(spec, NgramSpec):  # SGLang lists the NGRAM settings (at their defaults) whatever the algorithm
            speculative.update({k: v for k, v in server_args_of(NgramSpec()).items() if "_ngram_" in k})
        return {
            "model_path": self.model_path, "served_model_name": self.served_model_name, "host": self.host,
            "port": self.port, "dtype": self.dtype, "context_length": self.context_length,
            "max_running_requests": self.max_running_requests, "random_seed": self.random_seed,
            "max_queued_requests": self.max_queued_requests, "max_total_tokens": self.max_total_tokens,
            "device": "cpu", "threads": self.threads, "weights": self.weights,
            **speculative,
            "speculative_algorithm": self.algorithm,
            "speculative_num_steps": self.speculative_num_steps,
            "speculative_eagle_topk": self.speculative_eagle_topk,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.engines.cpu", allow_abbrev=False,
        description="Embedded CPU engine: SGLang 0.5.23 HTTP protocol over a small HF model with real speculative "
                    "decoding (NGRAM, STANDALONE). Flag names are SGLang's; abbreviations are not accepted.")
    p.add_argument("--model-path", "--model", dest="model_path", required=True,
                   help="known id (see `python -m serve.engines.cpu.models list`), a .gguf file or an HF dir")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: model path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default) is bit-exact vs plain decoding; bfloat16 is faster here but not bit-exact")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-queued-requests", type=int, default=128,
                   help="waiting requests at most; one more gets 429 with Retry-After (default 128)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="token budget (KV) of the running requests: prompt + max_new_tokens each "
                        "(default 4 x context length)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help=f"requests decoded at once (one batched forward per step); default {DEFAULT_MAX_RUNNING_REQUESTS} like SGLang")
    p.add_argument("--random-seed", type=int, default=None, help="seeds requests that carry no seed (default random)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s = p.add_argument_group("speculative decoding (SGLang 0.5.23 semantics)")
    s.add_argument(BY_FIELD["algorithm"].flag, default=None,
                   help="NGRAM or STANDALONE (case-insensitive); absent: none")
    s.add_argument(BY_FIELD["draft_model"].flag, "--speculative-draft-model", dest="speculative_draft_model_path",
                   default=None, help="STANDALONE: draft model (same tokenizer as the target)")
    # The rest of the table, typed and defaulted from serve.spec (NGRAM's defaults are SGLang's).
    for setting in SETTINGS:
        if setting.field == "adaptive":  # a switch of EAGLE's, which this engine lacks: accepted, then ignored as
            s.add_argument(setting.flag, dest=setting.server_arg, action="store_true",  # SGLang ignores it elsewhere
                           help="SGLang's adaptive EAGLE steps; ignored here (no EAGLE), as SGLang ignores it for "
                                "NGRAM/STANDALONE")
            continue
        if setting.field in ("algorithm", "draft_model") or not set(setting.algorithms) & {"ngram", "standalone"}:
            continue  # the CPU engine implements NGRAM and STANDALONE only
        info = (NgramSpec if setting.algorithms == ("ngram",) else StandaloneSpec).model_fields[setting.field]
        kind = str if setting.field in ("match_type", "external_corpus") else int
        choices = ("BFS", "PROB") if setting.field == "match_type" else None
        s.add_argument(setting.flag, dest=setting.server_arg, type=kind, choices=choices, default=info.default,
                       help=info.description)
    e = p.add_argument_group("engine-only")
    e.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    e.add_argument("--weights", choices=("auto", "fp32", "gguf"), default="auto",
                   help="decode/verify matmuls (<= 24 rows) on the model's GGUF Q4_1/Q8_0 blocks through a C++ kernel "
                        "(same weights bit for bit, ~2x plain decode), prefill on the fp32 tensors: gguf = required "
                        "(the start fails if this model or machine cannot), fp32 = never, auto (default) = gguf where "
                        "possible, else fp32 with the reason in the log and /server_info. The kernel is built once "
                        "per machine (~30 s; `python -m serve.engines.cpu.models fetch` builds it too)")
    e.add_argument("--verify-probe-seconds", type=float, default=1.5,
                   help="time budget of the start-up verify-cost probe (N = 1..16 query tokens, 8 sizes); 0 turns it off")
    e.add_argument("--verify-probe-refresh", action="store_true",
                   help="measure the verify-cost curve now even if it is cached for this model, dtype, thread "
                        "count and machine (the cache is written again)")
    e.add_argument("--test-fault", action="append", default=[], metavar="SPEC",
                   help="testing only: make this engine fail on purpose, e.g. crash-after=2@speculative "
                        "(repeatable; kinds and syntax in serve/engines/cpu/faults.py)")
    return p


def parse_config(argv: list[str] | None = None) -> EngineConfig:
    """Parse and resolve. argparse exits 2 on unknown flags/bad types; other problems raise ConfigError."""
    args = build_parser().parse_args(argv)
    algo = (args.speculative_algorithm or "").upper() or None
    warnings: list[str] = []
    steps = topk = None
    if algo is None:
        spec: NoSpec | NgramSpec | StandaloneSpec = NoSpec()
        given = [f for f in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                             "speculative_draft_model_path") if getattr(args, f) is not None]
        if given:
            flags = ", ".join("--" + g.replace("_", "-") for g in given)
            warnings.append(f"{flags} ignored: no --speculative-algorithm")
    elif algo == "NGRAM":
        ngram: NgramSpec = _build(NgramSpec, dict(
            num_draft_tokens=(NGRAM_DEFAULT_DRAFT_TOKENS if args.speculative_num_draft_tokens is None
                              else args.speculative_num_draft_tokens),
            max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
            min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
            match_type=args.speculative_ngram_match_type, max_trie_depth=args.speculative_ngram_max_trie_depth,
            capacity=args.speculative_ngram_capacity, external_corpus=args.speculative_ngram_external_corpus_path,
            external_sam_budget=args.speculative_ngram_external_sam_budget,
            external_corpus_max_tokens=args.speculative_ngram_external_corpus_max_tokens))
        if args.speculative_num_draft_tokens is None:
            warnings.append(f"--speculative-num-draft-tokens unset: using {NGRAM_DEFAULT_DRAFT_TOKENS} "
                            "(SGLang's NGRAM default)")
        if args.speculative_eagle_topk is not None:
            warnings.append("--speculative-eagle-topk is ignored for NGRAM: SGLang sets it to max_bfs_breadth")
        if args.speculative_draft_model_path is not None:
            warnings.append("--speculative-draft-model-path is ignored for NGRAM")
        spec, topk = ngram, ngram.max_bfs_breadth
        steps = args.speculative_num_steps if args.speculative_num_steps is not None else ngram.num_draft_tokens // topk
    elif algo == "STANDALONE":
        shape = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
        if shape == (None, None, None):
            shape = STANDALONE_AUTO
        standalone: StandaloneSpec = _build(StandaloneSpec, dict(
            draft_model=args.speculative_draft_model_path, num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2]))
        spec, steps, topk = standalone, standalone.num_steps, standalone.topk
    elif algo in _SGLANG_ONLY:
        raise ConfigError(
            f"--speculative-algorithm: {args.speculative_algorithm!r} is not offered by the CPU engine (it needs "
            "EAGLE/MTP heads or CUDA kernels, and no such heads exist on PyPI for these models); "
            "use NGRAM or STANDALONE")
    else:
        raise ConfigError(f"--speculative-algorithm: Unknown speculative algorithm name: {args.speculative_algorithm} "
                          "(the CPU engine offers NGRAM and STANDALONE)")
    if args.speculative_adaptive:
        warnings.append("--speculative-adaptive ignored: SGLang runs it for EAGLE/EAGLE3 only")
    violations = validate_spec(spec, prefix="spec")
    if violations:
        raise ConfigError("; ".join(f"{_flag_of(v.field)}: {v}" for v in violations))
    for flag, value, minimum in (("--max-running-requests", args.max_running_requests, 1),
                                 ("--max-queued-requests", args.max_queued_requests, 1),
                                 ("--max-total-tokens", args.max_total_tokens, 1),
                                 ("--context-length", args.context_length, 1), ("--threads", args.threads, 1),
                                 ("--port", args.port, 0)):
        if value is not None and value < minimum:
            raise ConfigError(f"{flag}: must be >= {minimum}, got {value}")
    if args.verify_probe_seconds < 0:
        raise ConfigError("--verify-probe-seconds: must be >= 0 (0 turns the probe off), "
                          f"got {args.verify_probe_seconds}")
    try:
        test_faults = parse_faults(args.test_fault)
    except FaultSpecError as err:
        raise ConfigError(str(err)) from None
    return EngineConfig(
        model_path=args.model_path, served_model_name=args.served_model_name or args.model_path, host=args.host,
        port=args.port, dtype=args.dtype, context_length=args.context_length,
        max_running_requests=(DEFAULT_MAX_RUNNING_REQUESTS if args.max_running_requests is None
                              else args.max_running_requests),
        max_queued_requests=args.max_queued_requests, max_total_tokens=args.max_total_tokens,
        random_seed=args.random_seed if args.random_seed is not None else random.randrange(2**31),
        threads=args.threads, weights=args.weights, verify_probe_seconds=args.verify_probe_seconds,
        verify_probe_refresh=args.verify_probe_refresh, log_level=args.log_level, spec=spec,
        speculative_num_steps=steps, speculative_eagle_topk=topk, warnings=tuple(warnings),
        test_faults=test_faults)


def _build(kind, fields: dict):
    try:
        return kind(**fields)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            name = str(e["loc"][0]) if e["loc"] else "?"
            problems.append(f"{_FLAGS.get(name, name)}: {e['msg']}, got {e.get('input')!r}")
        raise ConfigError("; ".join(problems)) from None


def _flag_of(field: str) -> str:
    return _FLAGS.get(field.rsplit(".", 1)[-1], field)
