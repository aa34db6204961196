"""The CPU engine's external-corpus suffix automaton, kept in `serve.ngram.sam` (torch-free, shared with the
pipeline's acceptance simulator). This name stays for the engine's modules and the parity tests."""

from serve.ngram.sam import SEPARATOR_TOKEN, SuffixAutomaton

__all__ = ["SEPARATOR_TOKEN", "SuffixAutomaton"]
