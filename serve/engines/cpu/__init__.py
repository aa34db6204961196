"""The embedded CPU engine: a real small LM with real speculative decoding behind SGLang 0.5.23's HTTP protocol.

Modules (torch is imported lazily, only by the ones that run a model):
- `models`: the model store (PyPI packages carrying GGUF files -> cached safetensors dirs); torch-free at import.
- `convert`: GGUF -> dequantized HF safetensors dir, and loading a model dir.
- `runner`: one causal LM driven by hand: prefill, tree forward with a 4D mask, KV pruning, logits on demand.
- `llama`: the fast forward `runner` uses for Llama-family models (fused weights, preallocated KV cache).
- `gguf_linear`: decode/verify matmuls on the model's GGUF Q4_1/Q8_0 blocks (a C++ kernel in `csrc/`, built once per
  machine; `--weights`), exact to the fp32 weights.
- `verify`: tree acceptance (greedy and target-only sampling) and the sampling transforms.
- `speculators`: draft sources producing `ngram.DraftTree`s (the shared n-gram trie, a standalone draft model).
- `decode`: one request's state machine (prefill, draft+verify steps, stop rules, SGLang meta_info counters).
- `scheduler`: the FIFO queue and the worker thread that steps the running requests together (one batched forward).
- `command_line`: the command line (SGLang flag names) and the resolved engine config.
- `server`, `openai_api`: the HTTP surface (`python -m serve.engines.cpu`); `streaming`: what both share (a request
  seen from the event loop, cancel on disconnect, SSE and error bodies).
- `probe`: the verify-cost curve, measured once per model/dtype/threads/machine and cached on disk.
"""
