"""The exported engine command binds this machine only (issue #31 item 10): the engine has no auth, and
`deploy/engine_command.sh` and `promote --show` print the same command."""

from __future__ import annotations

import shlex

from serve.engines.base import ReplicaConfig
from serve.serving import COMMAND_FILE, Provenance, ServingConfig, deploy_files, engine_command


def _serving() -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(model="smollm2-135m"), provenance=Provenance(
        study="s", decision="keep_baseline", source="baseline", workload="w", workload_digest="0123456789abcdef"))


def test_the_exported_engine_command_binds_localhost_and_says_how_to_serve_others():
    argv = shlex.split(engine_command(_serving()))
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    script = deploy_files(_serving(), {"config_file": "serving_config.json"}, "1")[COMMAND_FILE]
    assert "0.0.0.0" not in script.split("exec ", 1)[1]
    assert "python -m serve.production" in script and "docs/security.md" in script
