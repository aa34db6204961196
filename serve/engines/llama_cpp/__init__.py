"""llama.cpp's `llama-server` as an engine kind ("llama_cpp"): an engine we do not control, behind our contract.

- `models.py`: where llama-server is (infra/install-llama-cpp.sh builds it into a cache) and which GGUF it loads;
- `flags.py`: the typed `LlamaCppSpec` (serve/spec.py) -> llama-server's command line (pure);
- `protocol.py`: SGLang's `/generate` <-> llama-server's `/completion`, spec counters from `timings` (pure);
- `server.py`: the shim process in front of llama-server that serves the tuner's routes;
- `adapter.py`: the `Engine` (argv, resources, prepare).
"""
