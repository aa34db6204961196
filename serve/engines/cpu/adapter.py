"""The embedded CPU engine as an engine kind: its command line and its replica's resources.

Its flags are SGLang's names (rendered from the one table, `serve/engines/spec_flags.py`), so the same search space
means the same thing here and on SGLang. It validates its flags itself in well under a second at start, so it needs no
separate preflight; a refused flag set exits with code 2 and the reason, which the replica reports.
"""

from __future__ import annotations

from typing import Any

from serve.engines.base import Engine, ReplicaConfig, python_module_argv
from serve.engines.spec_flags import render_spec


class CpuEngine(Engine):
    kind = "cpu"
    label = "the CPU engine"
    spec_details = True
    algorithms = frozenset({"none", "ngram", "standalone"})
    context_limited = True  # it answers 400 to a prompt past the model's context

    def build_ahead(self) -> list[str] | None:
        # The GGUF kernel's first build takes ~30 s on 2 cores; torch's file lock in its build folder makes an engine
        # start that comes while it runs wait and then import it, and a kept build makes this a ~3 s no-op.
        return [*python_module_argv("serve.engines.cpu.gguf_linear"), "build"]

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        argv = python_module_argv("serve.engines.cpu") + [
            "--model-path", config.model, "--host", host, "--port", str(port), "--dtype", config.dtype,
            "--weights", config.weights]
        if config.threads is not None:
            argv += ["--threads", str(config.threads)]
        return argv + render_spec(config.spec, config.max_running_requests) + list(config.extra_flags)

    replays_drafts = True

    def draft_replay_argv(self, draft_model: str, dtype: str, weights: str, threads: int | None) -> list[str]:
        # the engine's own forward, weights mode and thread count: the draft's trees are the engine's
        argv = python_module_argv("serve.engines.cpu.draft_replay") + [
            "--draft", draft_model, "--dtype", dtype, "--weights", weights]
        return argv + (["--threads", str(threads)] if threads is not None else [])

    def start_env(self, config: ReplicaConfig) -> dict[str, str]:
        """The base environment, less the replica's `OMP_NUM_THREADS` when `threads` is unset: Ray sets it to 1 in an
        actor with a fractional CPU (this replica's 0.1), and passed on it would pin the engine to one thread where
        `threads: None` means every core (torch's own default, as for an engine started by hand). `env` may still set
        it explicitly."""
        env = super().start_env(config)
        if config.threads is None and "OMP_NUM_THREADS" not in config.env:
            env.pop("OMP_NUM_THREADS", None)
        return env

    def deterministic_flags(self, config: ReplicaConfig) -> list[str] | None:
        # In fp32 its kernels are batch- and thread-invariant (docs/cpu-engine.md): a greedy output is the same in any
        # batch, so deterministic equivalence is exact equivalence on the engines the trials measured. bf16 is not.
        return [] if config.dtype == "float32" else None

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        # The engine process uses every core of its node; the actor that owns it only proxies.
        cpus = config.replica_cpus if config.replica_cpus is not None else 0.1
        return {"num_cpus": cpus, "num_gpus": 0, "resources": dict(config.replica_resources)}

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """One per node that can host it: two CPU engines on one node would time-share its cores and measure noise."""
        fits = [cluster_resources.get(k, 0) // v for k, v in config.replica_resources.items() if v > 0]
        return max(1, int(min(fits))) if fits else 1
