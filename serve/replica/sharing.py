"""Launch sharing: when a trial's engine may be the engine already running in its replica. Pure: no Ray, no HTTP.

An engine launch of a big model costs minutes of every GPU it holds, and SGLang 0.5.23 changes nothing speculative
at runtime except accept thresholds (ignored at temperature 0) and external corpora (`POST /add_external_corpus`,
list, remove). So in a trial replica (serve/replica/deployment.py) an NGRAM corpus is never a launch flag: the engine starts
without it and the replica loads it over HTTP (the load is timed there, on both engines alike). Two trial configs
whose launches are then equal share one launch: the replica keeps the engine, swaps the corpus, and the trial
flushes, warms up and measures as after a fresh start. Warm-up length and concurrency are not engine settings at all.

The one exception to equality: a config without a corpus may run on an engine started with another SAM budget or
corpus token limit, because with no corpus loaded the trie drafts alone with the whole draft budget (SGLang's
`Ngram::batchMatch`, `kernels/jit/csrc/ngram_corpus/ngram.cpp`: per-SAM budget 0 when no SAM is loaded; the CPU
engine's `corpus.draft_with_corpora` the same). The reverse does not hold: a corpus needs its own budget at launch.
"""

from __future__ import annotations

from typing import Any

from serve.engines.base import ReplicaConfig
from serve.spec import NgramSpec

__all__ = ["launch_config", "runtime_corpus", "launch_key", "can_share"]

# Settings of a replica config that do not change the running engine: where its log goes, how long a start may
# take, and the corpus documents (loaded at runtime).
_NOT_LAUNCH = ("log_dir", "start_timeout_s", "corpus_documents")
_CORPUS_LIMITS = ("external_sam_budget", "external_corpus_max_tokens")


def runtime_corpus(config: ReplicaConfig) -> str | None:
    """The corpus file a trial replica loads after the start (the config's `spec.external_corpus`), or None."""
    return config.spec.external_corpus if isinstance(config.spec, NgramSpec) else None


def launch_config(config: ReplicaConfig) -> ReplicaConfig:
    """What the engine is started with in a trial replica: `config` without its corpus (loaded at runtime)."""
    if runtime_corpus(config) is None:
        return config
    return config.model_copy(update={"spec": config.spec.model_copy(update={"external_corpus": None}),
                                     "corpus_documents": None})


def launch_key(config: ReplicaConfig, corpus_limits: bool = True) -> dict[str, Any]:
    """Everything about `config` that its engine's launch depends on (`corpus_limits=False`: without the SAM budget
    and corpus token limit)."""
    key = launch_config(config).to_replica()
    for name in _NOT_LAUNCH:
        key.pop(name, None)
    if not corpus_limits and isinstance(key.get("spec"), dict):
        key["spec"] = {k: v for k, v in key["spec"].items() if k not in _CORPUS_LIMITS}
    return key


def can_share(running: ReplicaConfig, wanted: ReplicaConfig) -> bool:
    """Whether `wanted` can be measured on the engine launched for `running` (module docstring)."""
    limits = runtime_corpus(wanted) is not None
    return launch_key(running, limits) == launch_key(wanted, limits)
