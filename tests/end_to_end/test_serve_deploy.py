"""The Serve config a study writes for its winner (deploy/serve_config.yaml) deploys with `serve deploy` on a cluster
started with `ray start --head` (the dashboard's agent takes the config), and the endpoint answers the real `openai`
client with the config it was given (issue #20). The CPU engine with the smallest model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from serve.engines.base import ReplicaConfig
from serve.ports import free_port
from pipeline.records.provenance import hardware_text, machine
from serve.serving import (COMMAND_FILE, ENGINE_HOST, ENGINE_PORT, SERVE_CONFIG_FILE, SERVING_FILE, Provenance,
                           deploy_files, serving_config, write_deploy_folder)

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODEL = "smollm2-135m"


def test_the_exported_serve_config_deploys_and_answers_openai(ray_head, tmp_path):
    dashboard, env = ray_head.dashboard, ray_head.env
    serving = serving_config(
        ReplicaConfig(model=MODEL, spec={"algorithm": "ngram", "num_draft_tokens": 4}, max_running_requests=4,
                      start_timeout_s=300.0, log_dir=str(tmp_path / "trial")),
        Provenance(study="deploy", decision="promote", source="final-0", workload="templated",
                   workload_digest="0123456789abcdef", engine="cpu test", hardware=hardware_text(machine()),
                   measurement="disturbed"))
    folder = tmp_path / "deploy"
    http_port = free_port()
    files = deploy_files(serving, {"config_file": str(folder / SERVING_FILE)}, "1")
    write_deploy_folder(folder, files)  # as a study writes them
    config = yaml.safe_load(files[SERVE_CONFIG_FILE])
    config["http_options"]["port"] = http_port  # the file's 8000 may be taken on a shared test machine
    (folder / SERVE_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))

    # The head is shared with other tests of this worker (ray_head): a Serve they started keeps its own HTTP port, and
    # a config's http_options apply only to a new Serve instance.
    subprocess.run([str(BIN / "serve"), "shutdown", "--address", dashboard, "--yes"], env=env, cwd=REPO,
                   capture_output=True, timeout=120)
    done = subprocess.run([str(BIN / "serve"), "deploy", str(folder / SERVE_CONFIG_FILE), "--address", dashboard],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    base_url = f"http://127.0.0.1:{http_port}"
    deadline, status = time.monotonic() + 600, None
    while time.monotonic() < deadline:  # the engine starts inside the cluster: poll /v1/config with a deadline
        try:
            status = httpx.get(f"{base_url}/v1/config", timeout=10)
            if status.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    assert status is not None and status.status_code == 200, getattr(status, "text", "no answer")
    shown = status.json()
    assert {k: shown[k] for k in ("replica", "provenance")} == serving.model_dump(mode="json")

    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused-on-localhost", max_retries=0, timeout=120)
    answer = api.completions.create(model=MODEL, prompt="def add(a, b):\n    return", max_tokens=8, temperature=0)
    assert answer.choices[0].text
    subprocess.run([str(BIN / "serve"), "shutdown", "--address", dashboard, "--yes"], env=env, cwd=REPO,
                   capture_output=True, timeout=120)


def test_the_exported_engine_command_runs_as_written(tmp_path):
    """`deploy/engine_command.sh` exactly as a study writes it, run by its path (its mode and shebang, no `sh`
    before it): the engine starts on the port the file names and answers /health; then it is stopped."""
    serving = serving_config(
        ReplicaConfig(model=MODEL, spec={"algorithm": "ngram", "num_draft_tokens": 4}, start_timeout_s=300.0),
        Provenance(study="deploy", decision="promote", source="final-0", workload="templated",
                   workload_digest="0123456789abcdef"))
    folder = tmp_path / "deploy"
    write_deploy_folder(folder, deploy_files(serving, {"config_file": str(folder / SERVING_FILE)}, "1"))
    health = f"http://{ENGINE_HOST}:{ENGINE_PORT}/health"
    try:  # the file names a fixed port: another engine there would answer for this one
        httpx.get(health, timeout=2)
        pytest.fail(f"something already answers on {ENGINE_HOST}:{ENGINE_PORT}; the exported command binds it")
    except httpx.HTTPError:
        pass
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # `python` is the user's
    log = open(tmp_path / "engine.log", "w")
    engine = subprocess.Popen([str(folder / COMMAND_FILE)], cwd=tmp_path, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, answered = time.monotonic() + 600, None
        while time.monotonic() < deadline and engine.poll() is None:
            try:
                answered = httpx.get(health, timeout=5)
                if answered.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
        assert answered is not None and answered.status_code == 200, (tmp_path / "engine.log").read_text()[-3000:]
    finally:
        engine.terminate()  # the script exec'd the engine: this is the engine's own process
        try:
            engine.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait(timeout=30)
        log.close()
