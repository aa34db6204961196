"""Corpus files for trials: the workload's warm-up split (or a traffic capture) written as SGLang's external corpus.

A corpus is a JSONL file of JSON strings (SGLang 0.5.23's `--speculative-ngram-external-corpus-path` format). The
search space's corpus dimension (`external_corpus`) takes:
- null: no corpus;
- `warmup` (`WARMUP_CORPUS`): the study's warm-up split, written once per study into its output dir and shared by
  every trial that samples it (content-addressed name, so a changed workload gets a new file);
- any other string: a user's corpus file, used as it is.

`corpus_for_trial` turns the sentinel into a path before the replica is configured; `corpus_record` reads what the
engine reported after start-up: corpus tokens (from `/server_info`'s `external_corpora`) and the load time, a cost
paid at every restart. Documents are what the engine sees: a plain prompt's text; a chat prompt rendered with the
chat template (decoded from its rendered ids, special tokens kept, so the engine tokenizes them back to the same ids)
followed by its recorded answer when the workload has one (`output`, e.g. in a capture).

`python -m pipeline.corpus WORKLOAD OUT.jsonl [--target MODEL]` writes a whole workload (e.g. a merged capture) as a
corpus, for the search space's corpus choices or `--speculative-ngram-external-corpus-path`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["main", "WARMUP_CORPUS", "CorpusFile", "corpus_documents", "write_corpus", "corpus_for_trial", "corpus_record"]

WARMUP_CORPUS = "warmup"


@dataclass(frozen=True)
class CorpusFile:
    path: str
    documents: int
    bytes: int
    sha1: str


def corpus_documents(items: Iterable[Any], tokenizer: Any = None) -> list[str]:
    """One document per distinct warm-up item, in order (a cycled split repeats prompts: the corpus need not).

    `items` are `pipeline.load.LoadRequest`s or `pipeline.workloads.Prompt`s. Chat items (`input_ids` set) need the
    tokenizer to turn the rendered ids back into text; without one their readable text is used."""
    docs: list[str] = []
    seen: set[str] = set()
    for item in items:
        ids = getattr(item, "input_ids", None)
        if ids is None and getattr(item, "messages", None) and tokenizer is not None:
            from pipeline.load import chat_input_ids

            ids = chat_input_ids(item.messages, tokenizer)
        text = tokenizer.decode(list(ids)) if ids is not None and tokenizer is not None else item.text
        output = getattr(item, "output", None)
        doc = text + output if output else text
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)
    return docs


def write_corpus(documents: Sequence[str], path: str | Path) -> CorpusFile:
    """Write documents as a corpus JSONL atomically (a concurrent trial never reads half a file)."""
    if not documents:
        raise ValueError("corpus: no documents to write (the warm-up split is empty: set workload.warmup_prompts "
                         ">= 1, or use a corpus file)")
    body = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents).encode("utf-8")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(body)
    os.replace(tmp, target)
    return CorpusFile(str(target), len(documents), len(body), hashlib.sha1(body).hexdigest())


def corpus_for_trial(trial: Any, warmup: Sequence[Any], out_dir: str | Path,
                     tokenizer: Any = None) -> tuple[Any, CorpusFile | None]:
    """(trial with the `warmup` sentinel replaced by the written file's path, the file) — the trial unchanged and
    None when it has no corpus or names a user file. `trial` is a `pipeline.config.TrialConfig`."""
    spec = trial.spec
    corpus = getattr(spec, "external_corpus", None)
    if corpus is None:
        return trial, None
    if corpus != WARMUP_CORPUS:
        path = Path(corpus)
        if not path.is_file():
            raise ValueError(f"spec.external_corpus: {corpus!r} is not a file; give a JSONL corpus path, "
                             f"{WARMUP_CORPUS!r} for the warm-up split, or null")
        body = path.read_bytes()
        return trial, CorpusFile(str(path), sum(1 for line in body.splitlines() if line.strip()), len(body),
                                 hashlib.sha1(body).hexdigest())
    docs = corpus_documents(warmup, tokenizer)
    key = hashlib.sha1(json.dumps(docs, ensure_ascii=False).encode("utf-8")).hexdigest()[:12]
    written = write_corpus(docs, Path(out_dir) / "corpora" / f"warmup-{key}.jsonl")
    new_spec = spec.model_copy(update={"external_corpus": written.path})
    return trial.model_copy(update={"spec": new_spec}), written


def corpus_record(server_info: dict[str, Any], corpus: CorpusFile | None) -> dict[str, float]:
    """Metrics a trial logs for its corpus: documents, bytes, tokens loaded, load seconds (empty without one)."""
    if corpus is None:
        return {}
    states = server_info.get("internal_states") or [{}]
    loaded = (states[0] or {}).get("external_corpora") or {}
    load_s = (server_info.get("startup_time") or {}).get("load_external_corpus")
    record = {"corpus_documents": float(corpus.documents), "corpus_bytes": float(corpus.bytes),
              "corpus_tokens": float(sum(loaded.values()))}
    if isinstance(load_s, (int, float)):
        record["corpus_load_s"] = float(load_s)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.corpus",
                                     description="write a workload (e.g. a merged traffic capture) as a corpus JSONL")
    parser.add_argument("workload", help="bundled name or JSONL/Parquet/JSON workload file")
    parser.add_argument("out", help="corpus JSONL to write")
    parser.add_argument("--target", default="smollm2-135m", help="model whose chat template renders chat prompts")
    args = parser.parse_args(argv)
    from pipeline.load import target_tokenizer
    from pipeline.workloads import WorkloadError, read_prompts

    try:
        prompts, _ = read_prompts(args.workload)
        tokenizer = target_tokenizer(args.target) if any(p.messages for p in prompts) else None
        written = write_corpus(corpus_documents(prompts, tokenizer), args.out)
    except (WorkloadError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{written.documents} documents, {written.bytes} bytes -> {written.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
