"""Issue #63 item 2: `engine.env` names reach a shell only as variable names, and the deploy script's comments
cannot start a command."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.errors import ConfigError
from pipeline.trial.replica_config import replica_config
from serve.serving import COMMAND_FILE, Provenance, RoutingPolicy, deploy_files, engine_command, serving_config
from serve.spec import NgramSpec

BAD_NAMES = ["X$(touch PWNED)", "A\ntouch PWNED", "1X", "A-B", "A B", "", "É"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_outside_the_shell_alphabet_is_refused_at_load_naming_the_key(name):
    with pytest.raises(ConfigError) as caught:
        load_study(None, {"engine.env": {"GOOD_1": "v", name: "v"}})
    message = str(caught.value)
    assert "engine.env" in message and repr(name) in message and "[A-Za-z_][A-Za-z0-9_]*" in message
    assert "GOOD_1" not in message


def test_shell_names_load():
    study = load_study(None, {"engine.env": {"HF_TOKEN": "v", "_x9": "w"}})
    assert sorted(study.engine.env) == ["HF_TOKEN", "_x9"]


def provenance(source: str = "final-0") -> Provenance:
    return Provenance(study="s", decision="promote", source=source, workload="templated",
                      workload_digest="0123456789abcdef")


def served(tmp_path: Path, source: str = "final-0", policy_text: str = "one config"):
    study = load_study(None, {"engine.env": {"HF_TOKEN": "secret"}})
    replica = replica_config(study, TrialConfig(spec=NgramSpec(num_draft_tokens=4)), tmp_path / "trials")
    return serving_config(replica, provenance(source), RoutingPolicy(text=policy_text, source="final-0"))


def test_the_writer_refuses_a_name_it_cannot_reference(tmp_path):
    # A serving config from elsewhere (a registry, a hand-edited file) skips the study's validation.
    serving = served(tmp_path)
    bad = serving.model_copy(update={"replica": serving.replica.model_copy(
        update={"env_from": ["OK", "X$(touch PWNED)"]})})
    with pytest.raises(ValueError, match=r"env_from: 'X\$\(touch PWNED\)' is not a shell variable name"):
        deploy_files(bad, {"config_file": "c.json"}, "v1")
    with pytest.raises(ValueError, match="not a shell variable name"):
        engine_command(bad)


def test_running_the_deploy_script_runs_only_the_engine(tmp_path):
    # Newlines in the texts the comment lines carry: each would start a command on its own line.
    serving = served(tmp_path, source="final-0\ntouch PWNED_SOURCE", policy_text="serve it\ntouch PWNED_POLICY")
    script = tmp_path / COMMAND_FILE
    script.write_text(deploy_files(serving, {"config_file": "c.json"}, "v1")[COMMAND_FILE])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"  # stands in for the engine: records that it ran and with which environment
    fake.write_text('#!/bin/sh\necho "$HF_TOKEN" > ENGINE_RAN\n')
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HF_TOKEN": "from-env"}
    subprocess.run(["sh", str(script)], cwd=work, env=env, check=True, timeout=30)
    assert sorted(p.name for p in work.iterdir()) == ["ENGINE_RAN"]
    assert (work / "ENGINE_RAN").read_text() == "from-env\n"
    for line in script.read_text().splitlines():
        assert line.startswith(("#", "HF_TOKEN=\"$HF_TOKEN\" exec ", "cd ")), line
