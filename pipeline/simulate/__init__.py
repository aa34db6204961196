"""Simulate: predict a draft-free config's figures without launching it (docs/design.md, "Search"). Under greedy decoding a
lossless NGRAM config emits exactly the baseline's tokens, so its accepted length at every step follows from the
draft trees the n-gram structures propose: `replay` runs the baseline's recorded prompt and output ids through
SGLang 0.5.23's drafting schedule (`serve.ngram`, the code the CPU engine drafts with) on the engine's rounds;
`chains` drafts the stateless lookups in a request's own tokens (llama-server's `ngram-simple`, vLLM's `ngram`) that
the replay walks the same way; `cost` is the step-cost model T(batch rows, query tokens, context) fitted to the
launches; `predict` times the rounds and summarizes them like a measurement; `prefix` counts the prompt tokens an
engine's prefix cache (SGLang's radix cache) leaves a prefill to compute; `workload` arranges the answers as a trial
sends them; `simulator` holds one study's pieces together; `solo` replays and prices a whole space's NGRAM configs in
bulk at concurrency 1, to the same figures. Pure: no engine, no I/O beyond reading a corpus file. The search that
uses it is `pipeline.search.simulate_first`."""

__all__ = ["chains", "cost", "predict", "prefix", "replay", "simulator", "solo", "workload"]
