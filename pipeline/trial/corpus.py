"""Corpus files for trials: the workload's warm-up split (or a traffic capture) written as SGLang's external corpus.

A corpus is a JSONL file of JSON strings (SGLang 0.5.23's `--speculative-ngram-external-corpus-path` format). The
search space's corpus dimension (`external_corpus`) takes:
- null: no corpus;
- `warmup` (`WARMUP_CORPUS`): the study's warm-up split, written into the folder of each trial that samples it
  (content-addressed name, so a changed workload gets a new file);
- `shared:<path>` (`SHARED_PREFIX`): a corpus file every engine node can read at `<path>` (a shared filesystem),
  passed to the engine as it is and never shipped: the way to use a corpus above `MAX_SHIPPED_CORPUS_BYTES`;
- any other string: a user's corpus file, read on the driver and shipped like the warm-up split.

The engine may run on another node than the trial (a Ray Serve replica placed anywhere on the cluster), so a corpus
is not passed as a driver-side path: `corpus_for_trial` resolves the setting to documents and a file in the trial's
folder (the trial's record of what it loaded), and `ship_corpus` puts the documents in the `ReplicaConfig`; the
replica writes them on its own node (`serve.replica.deployment.write_shipped_corpus`) at the same path under its `log_dir`, and
the served config of a winner carries them the same way. In a trial the replica loads the corpus over SGLang's
runtime route (`POST /add_external_corpus`, serve/replica/deployment.py) and times it; `corpus_record` checks what the engine
holds where SGLang lists it (`GET /list_external_corpora`, `corpus_token_counts`) and records the corpus tokens and
that load time, a cost paid at every start (SGLang reports no start-up time of its own for a corpus). Documents are what the engine sees: a plain prompt's text; a chat prompt rendered with the
chat template (decoded from its rendered ids, special tokens kept, so the engine tokenizes them back to the same ids)
followed by its recorded answer when the workload has one (`output`, e.g. in a capture).

`python -m pipeline.trial.corpus WORKLOAD OUT.jsonl [--target MODEL]` writes a whole workload (e.g. a merged capture) as a
corpus, for the search space's corpus choices or `--speculative-ngram-external-corpus-path`.

The study's "corpus vs no corpus" answer over the recorded trials is the report's (`pipeline.records.corpus_table`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.workloads import WorkloadError, read_prompts
from serve.engines.base import MAX_SHIPPED_CORPUS_BYTES, ReplicaConfig, corpus_jsonl

__all__ = ["main", "WARMUP_CORPUS", "SHARED_PREFIX", "CorpusFile", "CorpusCell", "corpus_documents", "write_corpus",
           "read_corpus", "corpus_for_trial", "ship_corpus", "listed_corpora", "corpus_record"]

WARMUP_CORPUS = "warmup"
SHARED_PREFIX = "shared:"


@dataclass(frozen=True)
class CorpusFile:
    """A trial's corpus: its file, size and digest (None: a `shared:` file the driver cannot read), and the documents
    that travel with the replica (empty: not shipped, the engine's node reads `path` itself)."""

    path: str
    documents: int | None
    bytes: int | None
    sha1: str | None
    texts: tuple[str, ...] = field(default=(), repr=False)


def corpus_documents(items: Iterable[Any], tokenizer: Any = None) -> list[str]:
    """One document per distinct warm-up item, in order (a cycled split repeats prompts: the corpus need not).

    `items` are `pipeline.measure.load.LoadRequest`s or `pipeline.workloads.Prompt`s. Chat items (`input_ids` set) need the
    tokenizer to turn the rendered ids back into text; without one their readable text is used."""
    docs: list[str] = []
    seen: set[str] = set()
    for item in items:
        ids = getattr(item, "input_ids", None)
        if ids is None and getattr(item, "messages", None) and tokenizer is not None:
            # lazy: keeps `python -m pipeline.trial.corpus --help` light (httpx, numpy, pyarrow)
            from pipeline.measure.load import chat_input_ids

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
    body = corpus_jsonl(documents)  # the bytes the replica writes from shipped documents: the same file on one node
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(body)
    os.replace(tmp, target)
    return CorpusFile(str(target), len(documents), len(body), hashlib.sha1(body).hexdigest(), tuple(documents))


def read_corpus(path: str | Path) -> list[str]:
    """The documents of a corpus JSONL file (one JSON string per non-blank line, as SGLang reads it); a bad line is a
    ValueError naming the file and the line."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"spec.external_corpus: {str(path)!r} line {number} is not JSON ({err.msg}); a "
                                 "corpus is JSONL with one JSON string per line") from None
            if not isinstance(doc, str):
                raise ValueError(f"spec.external_corpus: {str(path)!r} line {number} holds a {type(doc).__name__}, "
                                 "not a JSON string; a corpus is JSONL with one JSON string per line")
            docs.append(doc)
    return docs


def _too_big(corpus: str, documents: Sequence[str], fix: str) -> None:
    size = len(corpus_jsonl(documents))
    if size > MAX_SHIPPED_CORPUS_BYTES:
        raise ValueError(f"spec.external_corpus: {corpus!r} is {size} bytes as a corpus, more than the "
                         f"{MAX_SHIPPED_CORPUS_BYTES} bytes shipped with an engine replica. Fix: {fix}, or put the "
                         f"corpus on a filesystem every engine node sees and give it as '{SHARED_PREFIX}<path>'")


def _shared(corpus: str) -> CorpusFile:
    """A `shared:` corpus: its size when the driver sees the file too (recorded), else unknown."""
    path = Path(corpus[len(SHARED_PREFIX):])
    if not path.is_absolute():
        raise ValueError(f"spec.external_corpus: {corpus!r} is relative; an engine on another node resolves it "
                         f"against its own working folder. Fix: give an absolute path, '{SHARED_PREFIX}/shared/x.jsonl'")
    try:
        body = path.read_bytes()
    except OSError:
        return CorpusFile(str(path), None, None, None)
    return CorpusFile(str(path), sum(1 for line in body.splitlines() if line.strip()), len(body),
                      hashlib.sha1(body).hexdigest())


def corpus_for_trial(trial: Any, warmup: Sequence[Any], out_dir: str | Path,
                     tokenizer: Any = None, target: str | None = None) -> tuple[Any, CorpusFile | None]:
    """(trial whose `spec.external_corpus` is the corpus file the engine is to load, the corpus) — the trial unchanged
    and None when it has no corpus. `warmup` and a user file become a file under `out_dir/corpora/` (content-addressed
    name) whose documents the corpus carries for `ship_corpus`; `shared:<path>` becomes `<path>`, not shipped. A
    corpus that cannot be used (missing, malformed, empty, too big to ship) is a ValueError naming the field, the
    value and the fix. `trial` is a `pipeline.config.TrialConfig`. Chat warm-up items are rendered with `tokenizer`,
    else with the tokenizer of the `target` model (loaded only for chat items)."""
    spec = trial.spec
    corpus = getattr(spec, "external_corpus", None)
    if corpus is None:
        return trial, None
    if corpus.startswith(SHARED_PREFIX):
        shared = _shared(corpus)
        return trial.model_copy(update={"spec": spec.model_copy(update={"external_corpus": shared.path})}), shared
    if corpus == WARMUP_CORPUS:
        if tokenizer is None and target is not None and any(getattr(i, "input_ids", None) is not None
                                                             for i in warmup):
            # lazy: keeps `python -m pipeline.trial.corpus --help` light (httpx, numpy, pyarrow)
            from pipeline.measure.load import target_tokenizer

            # Without it a chat prompt's document would be its readable view ("user: ..."), not what the engine sees.
            tokenizer = target_tokenizer(target)
        docs = corpus_documents(warmup, tokenizer)
        _too_big(corpus, docs, "lower workload.warmup_prompts")
        stem = "warmup"
    else:
        if not Path(corpus).is_file():
            raise ValueError(f"spec.external_corpus: {corpus!r} is not a file on the driver's node. Fix: give a JSONL "
                             f"corpus path the driver can read (it is shipped to the engine's node), "
                             f"'{SHARED_PREFIX}<path>' for a file every engine node has, {WARMUP_CORPUS!r} for the "
                             "warm-up split, or null")
        docs = read_corpus(corpus)
        if not docs:
            raise ValueError(f"spec.external_corpus: {corpus!r} holds no documents (SGLang refuses an empty corpus). "
                             "Fix: one JSON string per line, or null")
        _too_big(corpus, docs, "use a smaller corpus")
        stem = Path(corpus).stem
    key = hashlib.sha1(json.dumps(docs, ensure_ascii=False).encode("utf-8")).hexdigest()[:12]
    written = write_corpus(docs, Path(out_dir) / "corpora" / f"{stem}-{key}.jsonl")
    new_spec = spec.model_copy(update={"external_corpus": written.path})
    return trial.model_copy(update={"spec": new_spec}), written


def ship_corpus(config: ReplicaConfig, corpus: CorpusFile | None) -> ReplicaConfig:
    """`config` carrying the corpus's documents (`ReplicaConfig.corpus_documents`), so the replica can write the
    corpus on whatever node it runs; unchanged without a corpus or for a `shared:` one. Validated (size limit)."""
    if corpus is None or not corpus.texts:
        return config
    return ReplicaConfig.model_validate({**config.to_replica(), "corpus_documents": list(corpus.texts)})


def listed_corpora(client: Any) -> dict[str, int] | None:
    """`GET /list_external_corpora`'s `corpus_token_counts` from an engine (an httpx client on its base URL); None
    when it lists none (not NGRAM: SGLang answers 400 "Ngram speculative decoding is not enabled.")."""
    answer = client.get("/list_external_corpora").json()  # httpx errors and bad JSON: the caller's UNHEALTHY
    if not isinstance(answer, dict) or not answer.get("success"):
        return None
    counts = answer.get("corpus_token_counts") or {}
    return {str(k): int(v) for k, v in counts.items()}


def corpus_record(listed: dict[str, int] | None, loaded: dict[str, Any] | None,
                  corpus: CorpusFile | None) -> tuple[dict[str, float], str | None]:
    """(metrics a trial logs for its corpus: documents, bytes, tokens loaded, load seconds; why the engine does not
    hold what the trial asked for, or None). `listed`: `listed_corpora`; `loaded`: the replica's record of the
    corpus it loaded (`/replica/argv`'s `corpus`: id, load_s). Without a corpus the engine must hold none."""
    held = listed or {}
    if corpus is None:
        return {}, (f"the engine holds external corpora the trial did not ask for: {sorted(held)}" if held else None)
    wanted = str((loaded or {}).get("id") or corpus.path)
    if set(held) != {wanted}:
        return {}, (f"the engine does not hold the trial's corpus alone: it lists {sorted(held)}, the trial asked for "
                    f"{wanted!r} (GET /list_external_corpora)")
    record = {"corpus_tokens": float(held[wanted])}
    if corpus.documents is not None and corpus.bytes is not None:  # unknown for a shared file the driver cannot see
        record.update(corpus_documents=float(corpus.documents), corpus_bytes=float(corpus.bytes))
    load_s = (loaded or {}).get("load_s")
    if isinstance(load_s, (int, float)):
        record["corpus_load_s"] = float(load_s)
    return record, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.trial.corpus",
                                     description="write a workload (e.g. a merged traffic capture) as a corpus JSONL")
    parser.add_argument("workload", help="bundled name or JSONL/Parquet/JSON workload file")
    parser.add_argument("out", help="corpus JSONL to write")
    parser.add_argument("--target", default="smollm2-135m", help="model whose chat template renders chat prompts")
    args = parser.parse_args(argv)
    # lazy: keeps `python -m pipeline.trial.corpus --help` light (httpx, numpy, pyarrow)
    from pipeline.measure.load import target_tokenizer

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
