"""Prompt lengths against the target model's context, before any launch.

An engine refuses a request whose prompt tokens plus `max_new_tokens` exceed its context (the CPU engine and SGLang
answer 400): in the warm-up split such a prompt was dropped silently, in the measured split it failed the trial
after a launch, and the dry run passed. Here every prompt the study sends is tokenized as the engine tokenizes it and
the first one that cannot fit is refused, naming its row and its token count.

Checked where the model's files are on this machine (a CPU-engine id or .gguf once fetched, a local HF folder) for
the engines that take `--context-length` (cpu, sglang); a hub id's files are on the engine's node, where the trial
finds the problem. `context_problem` is pure; `check_prompt_context` reads the files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import StudyConfig
from pipeline.errors import PipelineError
from pipeline.measure.load import chat_input_ids
from pipeline.workloads import load_workload
from serve.engines import engine_for, folder_tokenizer
from serve.model_store import KNOWN_MODELS, SOURCE_MARKER, hf_dir_for, resolve_model

CONTEXT_FLAG = "--context-length"  # the CPU engine's and SGLang's flag alike
SPECIAL_MARGIN = 16  # BOS/EOS and a prefix space: more than any tokenizer adds to a plain text prompt
DEFAULT_CONTEXT = 4096  # what the CPU engine assumes for a config without max_position_embeddings


def context_flag(extra_flags: Sequence[str]) -> int | None:
    """The `--context-length` engine.extra_flags sets (`--context-length N` or `--context-length=N`). Pure."""
    for i, item in enumerate(extra_flags):
        value = None
        if item == CONTEXT_FLAG and i + 1 < len(extra_flags):
            value = extra_flags[i + 1]
        elif item.startswith(CONTEXT_FLAG + "="):
            value = item.split("=", 1)[1]
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def model_context(config: dict[str, Any]) -> int:
    """The context a model's config.json declares, as the CPU engine reads it. Pure."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("max_position_embeddings") or (text or {}).get("max_position_embeddings")
    return int(value) if value else DEFAULT_CONTEXT


def surely_fits(text: str, max_new_tokens: int, context: int, chat: bool) -> bool:
    """Whether a text prompt fits without tokenizing it: a token covers at least one byte of UTF-8 (byte-level BPE)
    or one character (SentencePiece), so a prompt has at most its byte count of tokens, plus the special and prefix
    tokens the tokenizer adds (`SPECIAL_MARGIN`). A chat prompt's template adds an unknown amount: never sure. Pure."""
    return not chat and len(text.encode("utf-8")) + SPECIAL_MARGIN + max_new_tokens <= context


def context_problem(source: str, target: str, context: int, where: str,
                    lengths: Iterable[tuple[str, int, int, int]]) -> str | None:
    """The first prompt whose tokens plus max_new_tokens exceed `context`, in one line; `lengths`: (prompt id, row
    number, prompt tokens, max_new_tokens); `where`: where the context figure comes from. Pure."""
    for pid, row, tokens, max_new in lengths:
        if tokens + max_new > context:
            return (f"workload {source!r}: prompt {pid!r} (row {row}) has {tokens:,} tokens, and with "
                    f"max_new_tokens {max_new} needs {tokens + max_new:,}, more than the {context:,}-token context "
                    f"of {target} ({where}); the engine would refuse it. Fix: shorten or drop that prompt, lower "
                    "workload.max_new_tokens, or raise the context (--context-length in engine.extra_flags, up to "
                    "what the model supports)")
    return None


def local_model_dir(target: str, fetch: bool) -> Path | None:
    """The HF folder of `target` on this machine, or None when its files are not here (`fetch`: fetch a CPU-engine
    id or convert a .gguf now, as the first trial would)."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if target in KNOWN_MODELS or (target.endswith(".gguf") and path.is_file()):
        if fetch:
            return resolve_model(target)
        folder = hf_dir_for(target)
        return folder if (folder / SOURCE_MARKER).exists() else None
    return None


def check_prompt_context(study: StudyConfig, fetch: bool = False) -> str | None:
    """Refuse (PipelineError) the first prompt of the study's splits that cannot fit the target's context; returns
    a note when it could not be checked here (None when checked)."""
    if not engine_for(study.engine.kind).context_limited:
        return None
    target = study.model.target
    try:
        folder = local_model_dir(target, fetch)
    except Exception as exc:  # noqa: BLE001 - the first trial fetches it again and reports the problem there
        return f"prompt lengths: not checked here ({target} could not be fetched: {type(exc).__name__}: {exc})"
    if folder is None:
        return f"prompt lengths: not checked here ({target}'s files are not on this machine yet)"
    settings = study.workload
    workload = load_workload(settings.source, seed=study.seed, n_warmup=settings.warmup_prompts,
                             n_measure=settings.measure_prompts, max_new_tokens=settings.max_new_tokens)
    prompts = {p.index: p for p in (*workload.warmup, *workload.measure)}.values()
    flag = context_flag(study.engine.extra_flags)
    config = json.loads((folder / "config.json").read_text())
    context = flag or model_context(config)
    where = f"{CONTEXT_FLAG} {flag} in engine.extra_flags" if flag else "its config.json"
    # the tokenizer (transformers, seconds to import) only for a prompt that could be too long
    doubtful = sorted((p for p in prompts if not surely_fits(p.text, p.max_new_tokens, context, bool(p.messages))),
                      key=lambda p: p.index)
    tokenizer: Any = folder_tokenizer(folder) if doubtful else None

    def lengths() -> Iterable[tuple[str, int, int, int]]:
        for p in doubtful:
            ids = chat_input_ids(p.messages, tokenizer) if p.messages else tokenizer.encode(p.text)
            yield p.id, p.index + 1, len(ids), p.max_new_tokens

    problem = context_problem(settings.source, target, context, where, lengths())
    if problem:
        raise PipelineError(problem)
    return None
