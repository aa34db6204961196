"""Composition root of the CPU engine: resolve and load the model(s), build the speculator, decoder, scheduler and
request factory, measure the verify-cost curve. Used by the HTTP server, the tests and the benchmark."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from serve.engines.cpu.command_line import EngineConfig
from serve.engines.cpu.convert import load_tokenizer
from serve.ngram.corpus import Encode, ExternalCorpora
from serve.engines.cpu.decode import Decoder, Speculator
from serve.model_store import resolve_model
from serve.ngram.trie import NgramCache
from serve.engines.cpu.params import RequestFactory
from serve.engines.cpu.probe import STARTUP_PROBE_SIZES, cached_draft_cost, cached_verify_cost
from serve.engines.cpu.runner import ModelRunner
from serve.engines.cpu.scheduler import Scheduler
from serve.engines.cpu.speculators import NgramSpeculator, StandaloneSpeculator
from serve.spec import NgramSpec, StandaloneSpec

__all__ = ["LoadedEngine", "build_engine", "make_speculator", "encoder_of", "eos_ids_of", "ENGINE_VERSION"]

ENGINE_VERSION = "specdec-cpu-engine 0.1 (SGLang 0.5.23 protocol)"
log = logging.getLogger("serve.engines.cpu")


class EngineError(RuntimeError):
    """The engine cannot start with this config (model load, draft/target mismatch); the message says why."""


@dataclass
class LoadedEngine:
    """The CPU engine loaded in this process (model, scheduler, tokenizer); its kind is `adapter.CpuEngine`."""

    config: EngineConfig
    tokenizer: Any
    runner: ModelRunner
    decoder: Decoder
    scheduler: Scheduler
    factory: RequestFactory
    context_length: int
    model_dir: str
    draft_dir: str | None = None
    verify_cost: dict | None = None
    startup_time: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)

    @property
    def speculative(self) -> bool:
        return self.decoder.speculator is not None

    def _draft_weights(self) -> dict:
        speculator = self.decoder.speculator
        if not isinstance(speculator, StandaloneSpeculator):
            return {}
        choice = speculator.runner.weights
        return {"draft_weights_mode": choice.mode, "draft_weights_isa": choice.isa,
                "draft_weights_reason": choice.reason}

    def server_info(self) -> dict:
        """SGLang-shaped /server_info: resolved args at the top level, plus `internal_states[0]`."""
        info = self.config.server_args()
        info["context_length"] = self.context_length
        state = {
            **self.scheduler.stats(self.speculative),
            "speculative_algorithm": self.config.algorithm,
            "speculative_num_steps": self.config.speculative_num_steps,
            "speculative_eagle_topk": self.config.speculative_eagle_topk,
            "speculative_num_draft_tokens": info["speculative_num_draft_tokens"],
            "effective_max_running_requests_per_dp": self.config.max_running_requests,
        }
        speculator = self.decoder.speculator
        if isinstance(speculator, NgramSpeculator):
            state["ngram_trie_nodes"] = speculator.cache.num_nodes
        # Loaded corpora are listed where SGLang lists them, `GET /list_external_corpora` (corpus_routes.py), not here
        info.update({
            "version": ENGINE_VERSION, "engine": "cpu", "model_dir": self.model_dir, "draft_model_dir": self.draft_dir,
            "torch_threads": torch.get_num_threads(), "forward": self.runner.backend, "verify_cost": self.verify_cost,
            # what --weights resolved to (the target's; a draft model resolves its own, reported as draft_weights_*)
            "weights_mode": self.runner.weights.mode, "weights_isa": self.runner.weights.isa,
            "weights_reason": self.runner.weights.reason, **self._draft_weights(),
            "startup_time": self.startup_time, "warnings": list(self.config.warnings),
            "internal_states": [state],
        })
        return info


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return frozenset(ids)


def encoder_of(tokenizer: Any) -> Encode:
    """Text -> token ids as SGLang tokenizes corpus documents: without special tokens (no BOS between documents)."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def make_speculator(config: EngineConfig, draft_runner: ModelRunner | None,
                    tokenizer: Any = None) -> Speculator | None:
    """The draft source for `config.spec`. NGRAM always gets an `ExternalCorpora` (SGLang accepts runtime corpora
    without a start-up one); the start-up corpus file is loaded here, with its path as the corpus id as in SGLang,
    so a bad file stops the engine before it serves (ValueError with SGLang's message)."""
    spec = config.spec
    if isinstance(spec, NgramSpec):
        cache = NgramCache(max_trie_depth=spec.max_trie_depth, capacity=spec.capacity,
                           min_bfs_breadth=spec.min_bfs_breadth, max_bfs_breadth=spec.max_bfs_breadth,
                           match_type=spec.match_type, num_draft_tokens=spec.num_draft_tokens)
        corpora = ExternalCorpora(spec.external_corpus_max_tokens)
        if spec.external_corpus is not None:
            if tokenizer is None:
                raise EngineError("ngram: an external corpus needs the tokenizer to load it")
            corpora.add_file(str(spec.external_corpus), spec.external_corpus, encoder_of(tokenizer))
        return NgramSpeculator(cache, spec.num_draft_tokens, spec.max_trie_depth, corpora=corpora,
                               external_sam_budget=spec.external_sam_budget)
    if isinstance(spec, StandaloneSpec):
        if draft_runner is None:
            raise EngineError("standalone: the draft model is not loaded")
        if spec.num_steps is None or spec.topk is None or spec.num_draft_tokens is None:
            raise EngineError("standalone: num_steps, topk and num_draft_tokens are resolved by the parser")
        return StandaloneSpeculator(draft_runner, spec.num_steps, spec.topk, spec.num_draft_tokens)
    return None


def build_engine(config: EngineConfig) -> LoadedEngine:
    """Load everything the config names and start the worker thread."""
    if config.threads:
        torch.set_num_threads(config.threads)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    model_dir = resolve_model(config.model_path)
    timings["resolve_model"] = time.monotonic() - t0
    t0 = time.monotonic()
    # Llama-family models load straight from safetensors into the fast forward (no HF modules): see runner.py
    runner = ModelRunner.from_dir(model_dir, config.dtype, config.weights)
    timings["load_weight"] = time.monotonic() - t0  # includes the GGUF kernel's one-time build (~30 s) if it ran
    log.info("weights: %s (%s)", runner.weights.mode, runner.weights.reason)
    t0 = time.monotonic()
    tokenizer = load_tokenizer(model_dir)
    timings["load_tokenizer"] = time.monotonic() - t0
    draft_runner = None
    draft_dir = None
    if isinstance(config.spec, StandaloneSpec):
        t0 = time.monotonic()
        if not config.spec.draft_model:
            raise EngineError("--speculative-draft-model-path: STANDALONE needs a draft model")
        draft_dir = resolve_model(config.spec.draft_model)
        _check_same_vocab(tokenizer, load_tokenizer(draft_dir), config.spec.draft_model, config)
        draft_runner = ModelRunner.from_dir(draft_dir, config.dtype, config.weights)
        log.info("draft weights: %s (%s)", draft_runner.weights.mode, draft_runner.weights.reason)
        timings["load_draft_weight"] = time.monotonic() - t0
    model_max = int(getattr(runner.config, "max_position_embeddings", 0) or 0) or 4096
    context_length = config.context_length or model_max
    if config.context_length and model_max and config.context_length > model_max:
        log.warning("--context-length %d exceeds the model's max_position_embeddings %d",
                    config.context_length, model_max)
    verify_cost = None
    if config.verify_probe_seconds > 0:
        t0 = time.monotonic()
        verify_cost = cached_verify_cost(runner, model_dir, config.dtype, config.verify_probe_seconds,
                                         STARTUP_PROBE_SIZES, refresh=config.verify_probe_refresh)
        timings["verify_cost_probe"] = time.monotonic() - t0
        if draft_runner is not None and draft_dir is not None:
            t0 = time.monotonic()
            verify_cost["draft_cost"] = cached_draft_cost(draft_runner, draft_dir, config.dtype,
                                                          config.verify_probe_seconds, STARTUP_PROBE_SIZES,
                                                          refresh=config.verify_probe_refresh)
            timings["draft_cost_probe"] = time.monotonic() - t0
    # SGLang loads a start-up corpus inside its scheduler's start and reports no time of its own for it, so neither
    # does this engine: a trial times the corpus it loads through `POST /add_external_corpus` (serve/replica/deployment.py).
    speculator = make_speculator(config, draft_runner, tokenizer)
    decoder = Decoder(runner, tokenizer, speculator)
    scheduler = Scheduler(decoder, config.max_running_requests, config.max_queued_requests,
                          config.max_total_tokens or 4 * context_length)
    factory = RequestFactory(tokenizer, eos_ids_of(runner.model, tokenizer), context_length, runner.vocab_size,
                             config.random_seed)
    scheduler.start()
    return LoadedEngine(config=config, tokenizer=tokenizer, runner=runner, decoder=decoder, scheduler=scheduler,
                  factory=factory, context_length=context_length, model_dir=str(model_dir),
                  draft_dir=str(draft_dir) if draft_dir else None, verify_cost=verify_cost,
                  startup_time={k: round(v, 3) for k, v in timings.items()})


def _check_same_vocab(target: Any, draft: Any, draft_model: str, config: EngineConfig) -> None:
    if target.get_vocab() != draft.get_vocab():
        raise EngineError(
            f"--speculative-draft-model-path: {draft_model!r} does not share the tokenizer of "
            f"--model-path {config.model_path!r} (vocabularies differ); STANDALONE needs the same vocabulary "
            "(e.g. qwen2.5-coder-0.5b drafting for qwen2.5-coder-1.5b)")
