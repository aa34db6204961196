"""The draft tree every draft source hands the verifier, kept in `serve.ngram.drafttree` (torch-free). This name
stays for the engine's modules and tests."""

from serve.ngram.drafttree import DraftTree, layout

__all__ = ["DraftTree", "layout"]
