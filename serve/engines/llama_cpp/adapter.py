"""llama.cpp's `llama-server` as an engine kind: the shim's command line (with llama-server's after `--`), the
replica's resources, and the node checks (binary built, GGUF files present)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from serve.engines.base import ConfigRejected, Engine, ReplicaConfig, python_module_argv
from serve.engines.llama_cpp import flags, models
from serve.spec import LLAMA_CPP_ALGORITHMS, LlamaDraftSpec, validate_spec

LLAMA_SERVER_COMMAND_FILE = "llama_server_command.sh"
DYNAMIC_CACHE_FILE = "lookup-dynamic.bin"


class LlamaCppEngine(Engine):
    kind = "llama_cpp"
    # llama.cpp's tokenizer split a code-edit prompt into 257 tokens where the model's HF tokenizer made 258
    retokenizes = True
    label = "llama.cpp's llama-server"
    algorithms = frozenset({"none", *LLAMA_CPP_ALGORITHMS})
    extend_api = "completion"  # the shim forwards llama-server's own /completion as it is
    model_forms = "a path to a .gguf file (llama-server loads GGUF only; append @f32 for an F32 copy)"
    recommended_space = "llama-cpp-ngram.yaml"  # its own n-gram types, not SGLang's NGRAM
    # 113.9 / 53.8 = 2.12x the CPU engine's e2e tok/s (docs/benchmarks.md, "llama.cpp: plain decode"); its start is
    # not measured there, the CPU engine's is taken
    cpu_speed = 113.9 / 53.8
    cpu_basis = "llama-server on SmolLM2-135M{size}, the CPU engine's start"

    def model_name(self, model: str) -> str:
        return model.removesuffix(models.F32_SUFFIX)

    def installed(self, device: str) -> Path | None:
        try:
            return models.require_server()
        except models.LlamaCppMissing:
            return None

    def install_problem(self, device: str, installed: Path | None) -> str | None:
        if installed is not None:
            return None
        return (f"engine.kind llama_cpp: llama-server {models.VERSION} is not built at {models.server_binary()}. Fix: "
                f"build it once with {models.INSTALL_COMMAND} (minutes to tens of minutes on 2 cores; needs cmake and "
                "g++)")

    def server_argv(self, config: ReplicaConfig) -> list[str]:
        """llama-server's own command line for `config` (without host/port): what production would run."""
        draft = models.gguf_path(config.spec.draft_model) if isinstance(config.spec, LlamaDraftSpec) \
            and config.spec.draft_model else None
        return flags.server_argv(models.server_binary(), models.gguf_path(config.model), config.spec,
                                 config.threads, config.max_running_requests, list(config.extra_flags), draft,
                                 alias=config.model)

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        shim = python_module_argv("serve.engines.llama_cpp") + [
            "--host", host, "--port", str(port), "--spec", json.dumps(config.spec.model_dump(mode="json")),
            "--ready-timeout", str(config.start_timeout_s)]
        if flags.needs_dynamic_cache(config.spec):
            shim.append("--dynamic-lookup-cache")
        return shim + ["--"] + self.server_argv(config)

    def native_deploy_files(self, config: ReplicaConfig, host: str, port: int) -> dict[str, str]:
        """`llama_server_command.sh`: the winner's llama-server alone (no shim, no Python), serving llama-server's
        own routes (`/v1/completions`, `/v1/chat/completions`, `/completion`) on host:port."""
        argv = [*self.server_argv(config), "--host", host, "--port", str(port)]
        setup = ""
        if flags.needs_dynamic_cache(config.spec):
            # llama-server aborts on a missing dynamic lookup file; the trial started from an empty one
            argv += ["--lookup-cache-dynamic", DYNAMIC_CACHE_FILE]
            setup = f"touch {DYNAMIC_CACHE_FILE}\n"
        env_note = "".join(f"#   {name} must be set in llama-server's environment\n"
                           for name in config.env_from)
        return {LLAMA_SERVER_COMMAND_FILE: (
            "#!/bin/sh\n# llama-server exactly as the winning trial ran it behind the shim. The binary and GGUF paths "
            "are those of the\n# machine that ran the study (bash infra/install-llama-cpp.sh builds the binary; the "
            "model store\n# fetches the GGUF files).\n" + env_note + setup + "exec " + shlex.join(argv) + "\n")}

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        # llama-server uses its node's cores; the replica actor only proxies (as for the CPU engine).
        cpus = config.replica_cpus if config.replica_cpus is not None else 0.1
        return {"num_cpus": cpus, "num_gpus": 0, "resources": dict(config.replica_resources)}

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """One per node that can host it: two llama-servers on one node would time-share its cores."""
        fits = [cluster_resources.get(k, 0) // v for k, v in config.replica_resources.items() if v > 0]
        return max(1, int(min(fits))) if fits else 1

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """On the replica's node: the spec's rules, llama-server built, the GGUF files fetched/converted."""
        problems = validate_spec(config.spec)
        if config.spec.algorithm not in self.algorithms:
            raise ConfigRejected(f"spec.algorithm={config.spec.algorithm!r}: {self.label} implements only "
                                 f"{sorted(self.algorithms)}")
        if problems:
            raise ConfigRejected("; ".join(map(str, problems)))
        static = getattr(config.spec, "static_cache", None)
        if static and not Path(static).expanduser().is_file():
            # llama-server aborts at start on a missing lookup file
            raise ConfigRejected(f"spec.static_cache={static!r}: no such file; give an existing lookup cache or unset it")
        binary = models.require_server()
        found: dict[str, Any] = {"llama_server": str(binary), "model_gguf": str(models.ensure_gguf(config.model))}
        if isinstance(config.spec, LlamaDraftSpec) and config.spec.draft_model:
            found["draft_gguf"] = str(models.ensure_gguf(config.spec.draft_model))
        return found
