"""The CPU engine's external n-gram corpora (SGLang 0.5.23's loading and drafting beside the trie), kept in
`serve.ngram.corpus` (torch-free, shared with the pipeline's acceptance simulator). This name stays for the engine's
modules, its corpus routes and the parity tests."""

from serve.ngram.corpus import (CHUNK_SIZE, Encode, ExternalCorpora, corpus_file_chunks, document_chunks,
                                draft_with_corpora)

__all__ = ["CHUNK_SIZE", "Encode", "ExternalCorpora", "corpus_file_chunks", "document_chunks", "draft_with_corpora"]
