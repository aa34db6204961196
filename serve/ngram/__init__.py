"""SGLang 0.5.23's NGRAM draft source in pure Python (no torch, no model): the global trie (`trie`), the external
corpora's suffix automata (`sam`, `corpus`), the draft tree (`drafttree`) and the multi-request schedule
(`schedule`), with parity tests against SGLang's C++ (tests/unit/test_ngram_*).

It sits on the ground floor beside `serve.spec`: what an NGRAM spec makes an engine draft. The embedded CPU engine
drafts with it (`serve.engines.cpu.speculators`), and the pipeline's acceptance simulator (`pipeline.simulate`)
replays a baseline's recorded tokens through the same code, so a simulated draft is the engine's draft by
construction rather than by a second implementation kept in step. The one exception is speed: the simulator replays
a whole space, so it runs the trie compiled (`compiled`, a C++ port held to the Python trie by tests that compare
every tree, and to SGLang's own C++ by the parity tests) where a C++ compiler is present."""

__all__ = ["compiled", "corpus", "drafttree", "sam", "schedule", "stdheap", "trie"]
