"""SGLang 0.5.23's STANDALONE (draft-model) tree in pure Python (no torch, no model): how the draft's top-k
expansions become a tree (`tree`), and how a greedy verifier's accepted length follows from it when the target's
tokens are known (`acceptance`).

It sits beside `serve.ngram`, for the same reason: the embedded CPU engine builds its draft trees with `tree`
(`serve.engines.cpu.speculators.StandaloneSpeculator`), and the draft replay (`serve.engines.cpu.draft_replay`, run
over a baseline's recorded tokens for the pipeline's simulator) builds the same trees with the same code, so a
replayed tree is the engine's tree by construction rather than by a second implementation kept in step."""

__all__ = ["acceptance", "tree"]
