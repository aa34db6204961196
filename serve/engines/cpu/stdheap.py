"""libstdc++'s priority queue order for SGLang's PROB drafting, kept in `serve.ngram.stdheap` (torch-free). This
name stays for the engine's modules and tests."""

from serve.ngram.stdheap import heap_pop, heap_push

__all__ = ["heap_pop", "heap_push"]
