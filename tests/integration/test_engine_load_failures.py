"""Issue 59: an engine load failure that a retry would repeat (a missing file, an architecture the engine does not
know) is recorded with its cause and not retried; any other failed start is. The replica's start
(`serve.replica.deployment.start_ready_engine`, what a production engine replica's constructor runs with
`ENGINE_START_ATTEMPTS`), with the real CPU engine: each start writes its own engine log, so the logs count the
starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from serve.engines.base import ReplicaConfig
from serve.engines.load_failures import cause_in_reason, repeating_cause
from serve.production.engine_app import ENGINE_START_ATTEMPTS
from serve.replica.deployment import start_ready_engine
from tests.integration.conftest import TEST_THREADS

pytestmark = pytest.mark.integration


def config(model: str, log_dir: Path, *flags: str) -> ReplicaConfig:
    # a failed start exits in seconds; the timeout only bounds a machine too busy to start one at all
    return ReplicaConfig(model=model, threads=TEST_THREADS, log_dir=str(log_dir), start_timeout_s=600,
                         extra_flags=["--verify-probe-seconds", "0", *flags])


def starts(log_dir: Path) -> int:
    return len(list(log_dir.glob("engine-*.log")))


def failed_start(replica: ReplicaConfig) -> str:
    with pytest.raises(RuntimeError) as raised:
        start_ready_engine(replica, ENGINE_START_ATTEMPTS)
    return str(raised.value)


def test_a_missing_weights_file_is_one_start_with_its_cause(tmp_path, smol_dir):
    model = tmp_path / "no-weights"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smol_dir) / name, model / name)  # a checkpoint whose weights file is missing
    message = failed_start(config(str(model), tmp_path / "logs"))
    assert starts(tmp_path / "logs") == 1  # not retried
    assert cause_in_reason(message) == "a missing file", message
    assert "not retried" in message and "model.safetensors" in message  # the engine's own words come along


def test_an_architecture_the_engine_does_not_know_is_one_start(tmp_path, smol_dir):
    model = tmp_path / "foreign"
    shutil.copytree(smol_dir, model)
    data = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**data, "architectures": ["NoSuchForCausalLM"],
                                                   "model_type": "no_such_type"}))
    message = failed_start(config(str(model), tmp_path / "logs"))
    assert starts(tmp_path / "logs") == 1
    assert cause_in_reason(message) == "an unsupported architecture", message


def test_a_start_that_failed_without_such_a_cause_is_tried_again(tmp_path):
    # exit-at-start: the engine exits before loading, naming no cause a retry would repeat (a node's flake)
    message = failed_start(config("smollm2-135m", tmp_path / "logs", "--test-fault", "exit-at-start"))
    assert starts(tmp_path / "logs") == ENGINE_START_ATTEMPTS
    assert repeating_cause(message) is None and cause_in_reason(message) is None
    assert "engine exited with code 3" in message
