"""The CPU engine's NGRAM trie: SGLang 0.5.23's n-gram corpus, kept in `serve.ngram.trie` (torch-free, shared with
the pipeline's acceptance simulator). This name stays for the engine's modules and the parity tests."""

from serve.ngram.trie import DraftTree, MatchState, NgramCache, layout

__all__ = ["DraftTree", "MatchState", "NgramCache", "layout"]
