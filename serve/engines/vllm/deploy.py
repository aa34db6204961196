"""The deploy folder's vLLM files: each served engine's bare vLLM command (no shim), exactly as its trial ran it, and
for a study of several concurrency levels the per-level decision in vLLM's own form (`dynamic.level_table`).

- `vllm_command.sh`: the served config (the policy's engine at low concurrency);
- `vllm_command_high.sh`: a two-engine policy's engine above its switch, on the next port (as `engine_command_high.sh`
  is for the shim form);
- `vllm_per_batch_size.json`: the K served at each measured level, the table where one server can express it, and
  why not where it cannot;
- `vllm_command_per_batch_size.sh`: with a table, one vLLM server carrying it in `--speculative-config`: the served
  config's command with `num_speculative_tokens_per_batch_size` added (and K raised to the table's largest, which vLLM
  sizes for). Each range's K was measured at its level on a server of its own; this one server was not measured, and
  its header says so. The serve config runs the policy as measured (the shim's engines, routed by requests in flight).
Pure: the command lines and the environment come from the adapter.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping

from serve.engines.base import ReplicaConfig
from serve.engines.vllm import install
from serve.engines.vllm.dynamic import level_table, with_per_batch_size

VLLM_COMMAND_FILE = "vllm_command.sh"
HIGH_COMMAND_FILE = "vllm_command_high.sh"
TABLE_FILE = "vllm_per_batch_size.json"
TABLE_COMMAND_FILE = "vllm_command_per_batch_size.sh"
SPEC_FLAG = "--speculative-config"

Argv = Callable[[ReplicaConfig], list[str]]
Env = Callable[[ReplicaConfig], dict[str, str]]


def command_script(config: ReplicaConfig, argv: list[str], env: dict[str, str], what: str) -> str:
    """A script that runs `argv` with vLLM's variables the tuner set (`env`), the study's `engine.env` by name only.
    `what`: the header's first line."""
    env_lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items()
                        if name not in config.env)
    env_note = "".join(f"#   {name} must be set in vLLM's environment (engine.env / env_from)\n"
                       for name in [*config.env, *config.env_from])
    return (f"#!/bin/sh\n# {what}\n# The interpreter and model folder are those of the machine that ran the study "
            f"({install.INSTALL_COMMAND} makes the venv; the\n# model store converts the folder).\n" + env_note
            + env_lines + "exec " + shlex.join(argv) + "\n")


def winner_files(config: ReplicaConfig, argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """`vllm_command.sh`: the served config's vLLM server exactly as its trial ran it behind the shim."""
    return {VLLM_COMMAND_FILE: command_script(config, argv, env, "vLLM's server exactly as the winning trial ran it "
                                              "behind the shim.")}


def level_files(served: Mapping[int, ReplicaConfig], argv_of: Argv, env_of: Env, host: str,
                port: int) -> dict[str, str]:
    """The files of a several-level policy (module docstring); `served`: the replica served at each measured level,
    `argv_of`: a replica's vLLM argv without host/port, `env_of`: the variables the tuner sets for it."""
    levels = sorted(served)
    low, top = served[levels[0]], served[levels[-1]]
    files: dict[str, str] = {}
    if top != low:
        switch = max(level for level in levels if served[level] == low)
        files[HIGH_COMMAND_FILE] = command_script(
            top, [*argv_of(top), "--host", host, "--port", str(port + 1)], env_of(top),
            f"vLLM's server for more than {switch} requests in flight, exactly as its trial ran it behind the shim.")
    found = level_table(served)
    files[TABLE_FILE] = json.dumps({"k_per_level": {str(level): k for level, k in found.ks.items()},
                                    "num_speculative_tokens_per_batch_size": found.table,
                                    "note": found.reason}, indent=2) + "\n"
    if found.table is None or found.replica is None:
        return files
    replica = found.replica
    argv = [*argv_of(replica), "--host", host, "--port", str(port)]
    at = argv.index(SPEC_FLAG) + 1
    config = with_per_batch_size(json.loads(argv[at]), found.ks, found.table[-1][1])
    argv[at] = json.dumps(config, separators=(",", ":"))
    files[TABLE_COMMAND_FILE] = command_script(
        replica, argv, env_of(replica),
        f"The per-level decision as one vLLM server: {found.reason}.\n# NOT measured as one server: each range's K "
        "was measured at its level on a server of its own, K 0 on the\n# baseline (no speculative config); here K 0 "
        "means no drafts scheduled for that batch size. The measured form: vllm_command.sh\n# and, above the "
        "switch, vllm_command_high.sh (the serve config routes between them).")
    return files
