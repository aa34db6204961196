"""vLLM's OpenAI server as an engine kind: the shim's command line (with vLLM's after `--`), the replica's resources,
the node checks (vLLM's venv installed, the model folder, vLLM's own verdict on the command line) and the deploy
folder's bare vLLM command."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve.engines.base import ConfigRejected, Engine, ReplicaConfig, python_module_argv
from serve.engines.sglang.cpu.launch import model_folder
from serve.engines.vllm import check, deploy, flags, install
from serve.spec import VLLM_ALGORITHMS, VllmSuffixSpec, validate_spec

VLLM_COMMAND_FILE = deploy.VLLM_COMMAND_FILE


class VllmEngine(Engine):
    kind = "vllm"
    label = "vLLM"
    algorithms = frozenset({"none", *VLLM_ALGORITHMS})
    model_forms = ("a local HF folder (with config.json and the model's own safetensors only) or a model id of the "
                   "CPU engine's store (converted once)")
    recommended_space = "vllm-ngram.yaml"
    # the verify-cost probe's dialect (pipeline/measure/shape.py): vLLM's own `/v1/completions` (token-id prompts in
    # one call, prompt logprobs), reached through the shim's forward; its prefix-cache hits from `/metrics`
    extend_api = "openai"
    # docs/vllm.md, "Measured": ready after 53 s to 4 min on the 2-vCPU reference box shared with other work (26 s of
    # it vLLM's config check); its decode speed against the CPU engine's is not measured on a quiet box yet, so the
    # CPU engine's is taken
    cpu_start_s = 180.0
    cpu_basis = "vLLM's CPU server on SmolLM2-135M{size} (its start measured, its speed the CPU engine's)"

    def installed(self, device: str) -> Path | None:
        return install.venv_python()

    def install_problem(self, device: str, installed: Path | None) -> str | None:
        if installed is not None:
            return None
        return (f"engine.kind vllm needs vLLM's own venv ({install.VERSION}), and {install.venv_dir()} has none. "
                f"Fix: {install.INSTALL_COMMAND} (about 3 GB; vLLM's CPU build)")

    def cpus(self, config: ReplicaConfig) -> list[int]:
        """The CPUs vLLM's OpenMP threads are bound to: the config's, else those this process may run on."""
        return sorted(config.cpus) if config.cpus else sorted(os.sched_getaffinity(0))

    def server_argv(self, config: ReplicaConfig, python: Path | str | None = None) -> list[str]:
        """vLLM's own command line for `config` (without host/port): what production would run."""
        interpreter = python or install.venv_python() or install.venv_dir() / "bin" / "python"
        try:
            return flags.server_argv(interpreter, model_folder(config.model), config.model, config.dtype,
                                     config.spec, config.max_running_requests, config.extra_flags)
        except ValueError as exc:  # a flag the tuner owns, an algorithm vLLM does not have
            raise ConfigRejected(str(exc)) from None

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        shim = python_module_argv("serve.engines.vllm") + [
            "--host", host, "--port", str(port), "--spec", json.dumps(config.spec.model_dump(mode="json")),
            "--model-name", config.model, "--ready-timeout", str(config.start_timeout_s)]
        return shim + ["--"] + self.server_argv(config)

    def engine_settings(self, config: ReplicaConfig) -> dict[str, str]:
        """vLLM's variables for `config`, the study's `engine.env` over them."""
        return {**flags.engine_env(self.cpus(config), config.threads), **config.env}

    def start_env(self, config: ReplicaConfig) -> dict[str, str]:
        """The base environment with vLLM's variables, less the replica's `OMP_NUM_THREADS` (Ray sets 1 in an actor
        with a fractional CPU; vLLM sizes its OpenMP pool from VLLM_CPU_OMP_THREADS_BIND)."""
        env = super().start_env(config.model_copy(update={"env": self.engine_settings(config)}))
        if "OMP_NUM_THREADS" not in config.env:
            env.pop("OMP_NUM_THREADS", None)
        return env

    def native_deploy_files(self, config: ReplicaConfig, host: str, port: int) -> dict[str, str]:
        """`vllm_command.sh`: the winner's vLLM server alone (no shim), serving vLLM's own OpenAI routes on host:port
        with the environment the trial gave it (values of `engine.env` by name only)."""
        argv = [*self.server_argv(config), "--host", host, "--port", str(port)]
        return deploy.winner_files(config, argv, self.tuned_env(config))

    def level_deploy_files(self, served: Mapping[int, ReplicaConfig], host: str, port: int) -> dict[str, str]:
        """A several-level policy's vLLM files: the second engine's bare command, the per-level K and, where one
        server can express it, vLLM's per-batch-size table and its command (serve/engines/vllm/deploy.py)."""
        return deploy.level_files(served, self.server_argv, self.tuned_env, host, port)

    def tuned_env(self, config: ReplicaConfig) -> dict[str, str]:
        """vLLM's variables as the tuner sets them for `config` (without the study's `engine.env`)."""
        return flags.engine_env(self.cpus(config), config.threads)

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        # vLLM uses its node's cores; the replica actor only proxies (as for the CPU engine and llama.cpp).
        cpus = config.replica_cpus if config.replica_cpus is not None else 0.1
        return {"num_cpus": cpus, "num_gpus": 0, "resources": dict(config.replica_resources)}

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """One per node that can host it: two vLLM servers on one node would time-share its cores."""
        fits = [cluster_resources.get(k, 0) // v for k, v in config.replica_resources.items() if v > 0]
        return max(1, int(min(fits))) if fits else 1

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """On the replica's node: the spec's rules, vLLM installed, the model folder, then vLLM's own parser and config
        classes on the exact server command line (a refusal is ConfigRejected, with vLLM's words)."""
        if config.spec.algorithm not in self.algorithms:
            raise ConfigRejected(f"spec.algorithm={config.spec.algorithm!r}: {self.label} implements only "
                                 f"{sorted(self.algorithms)}")
        problems = validate_spec(config.spec)
        if problems:
            raise ConfigRejected("; ".join(map(str, problems)))
        python = install.require_python()
        arctic = install.arctic_problem() if isinstance(config.spec, VllmSuffixSpec) else None
        if arctic:  # the node lacks a package, the config is fine: a launch failure, not INVALID
            raise install.VllmMissing(arctic)
        server = argv[argv.index("--") + 1:]
        folder = Path(server[server.index("--model") + 1])
        if not (folder / "config.json").is_file():
            raise RuntimeError(f"model: {config.model!r} resolved to {folder}, which has no config.json; give a local "
                               "HF folder or a model id of the CPU engine's store")
        verdict = check.verdict(python, server, self.start_env(config))
        if verdict.get("error"):
            raise ConfigRejected(f"vLLM {install.VERSION} refuses the command line: {verdict['error']}")
        return {"vllm_python": str(python), "model_folder": str(folder), "vllm_resolved": verdict}
