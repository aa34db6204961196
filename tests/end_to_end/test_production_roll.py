"""`python -m serve.production` rolling to a new registry version when two copies of the engine do not fit (issue 40
item 5), and the capture rows a replaced ingress held (issue 42 item 5).

"Two copies do not fit" is forced, not hoped for: the driver's local Ray has one `engine_slot` (RAY_OVERRIDE_RESOURCES)
and every version's replica reserves it (`replica_resources`), as 8 GPUs and tp 8 are on an 8-GPU node. A surge
roll (the new replica before the old one stops) could never place the new replica. Checked, in one endpoint:
- alias 1 -> 2: the driver says it stops then starts; the gap is answered 503 + Retry-After; version 2 then serves;
  the two rows the replaced ingress held in its capture buffer (flush_rows 64, flush_s 1 h) are on disk;
- alias 2 -> 3, a version whose engine cannot start: the roll fails, the driver rolls back to version 2 and keeps
  serving it (before: the TimeoutError ended `follow` and with it the process that serves production);
- SIGTERM to the driver alone (`kill PID`, a service manager's stop) drains: a stream in flight when the signal
  comes ends with its `[DONE]`, and the rows still buffered are written (issue 42 items 5 and 6).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.soak_faults import sse_outcome
from pipeline.records.registry import CANDIDATE, register_config, set_production
from pipeline.records.tracking import Tracker
from serve.engines.base import ReplicaConfig, child_env
from serve.ports import free_port
from serve.serving import Provenance, ServingConfig
from tests.integration.production_endpoint import capture_rows
from tests.integration.production_helpers import alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
NAME = "specdec-roll"
KEY = "roll-key-0123456789abcdef"
SLOT = {"engine_slot": 1.0}


def version(tracker: Tracker, run_id: str, replica: ReplicaConfig, production: bool) -> str:
    config = ServingConfig(replica=replica, provenance=Provenance(
        study="roll", decision="keep_baseline", source="baseline", workload="w", workload_digest="0123456789abcdef"))
    found = register_config(tracker, run_id, NAME, config, move_production=production,
                            alias="production" if production else CANDIDATE)
    assert found is not None
    return found


def test_a_roll_that_cannot_place_two_copies_stops_then_starts_and_a_failed_roll_is_rolled_back(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "roll-test", artifact_dir=tmp_path / "artifacts")
    run_id = tracker.client().create_run(tracker.experiment_id(), run_name="study-roll").info.run_id
    base = ReplicaConfig(model="smollm2-135m", threads=1, replica_resources=SLOT, start_timeout_s=300)
    assert version(tracker, run_id, base.model_copy(update={"max_running_requests": 4}), True) == "1"
    assert version(tracker, run_id, base.model_copy(update={"max_running_requests": 2}), False) == "2"
    # version 3's engine exits before loading the model (a CPU-engine test switch): its roll can only fail
    assert version(tracker, run_id, base.model_copy(update={"extra_flags": ["--test-fault", "exit-at-start"]}),
                   False) == "3"
    (tmp_path / "keys.txt").write_text(KEY + "\n")
    capture = tmp_path / "capture"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    env = {**child_env({"RAY_OVERRIDE_RESOURCES": json.dumps(SLOT)}), "SPECDEC_API_KEYS": ""}
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "serve.production", "--registered-model", NAME, "--tracking-uri", uri, "--port",
             str(port), "--api-key-file", str(tmp_path / "keys.txt"), "--threads", "1", "--follow-alias-s", "1",
             "--capture", json.dumps({"dir": str(capture), "sample_rate": 1, "flush_rows": 64, "flush_s": 3600})],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    everything: list[psutil.Process] = []

    def said() -> str:
        return log_path.read_text(errors="replace")

    def says(text: str) -> bool:  # the driver printed `text` (and is still serving)
        assert driver.poll() is None, said()[-4000:]
        return text in said()

    def served() -> str | None:
        assert driver.poll() is None, said()[-4000:]
        try:
            answer = httpx.get(f"{base_url}/v1/config", headers=auth, timeout=30)
        except httpx.HTTPError:
            return None
        return answer.json().get("version") if answer.status_code == 200 else None

    def ready(version: str) -> bool:  # serving `version` with its engine up (a roll's gap is over)
        if served() != version:
            return False
        try:
            return httpx.get(f"{base_url}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def ask(prompt: str) -> str:
        answer = httpx.post(f"{base_url}/v1/completions", headers=auth, timeout=120, json={
            "model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    try:
        wait_for(lambda: ready("1"), "the endpoint serving version 1", 600, period_s=0.5)
        everything = psutil.Process(driver.pid).children(recursive=True)
        ask("One,")
        ask("Two,")
        assert capture_rows(capture, 0) == []  # buffered: 2 rows < flush_rows, younger than flush_s

        # 1 -> 2: stop then start, the gap announced
        set_production(tracker, NAME, "2")
        gap: list[httpx.Response] = []

        def in_the_gap() -> bool:
            assert driver.poll() is None, said()[-4000:]
            try:
                health = httpx.get(f"{base_url}/health", timeout=30)
            except httpx.HTTPError:
                return False
            if health.status_code == 503:
                gap.append(health)
            return bool(gap)

        wait_for(in_the_gap, "the gap answered 503", 300, period_s=0.1)
        assert gap[0].headers["retry-after"] and "switching to version 2" in gap[0].json()["error"]["message"]
        refused = httpx.post(f"{base_url}/v1/completions", headers=auth, timeout=60,
                             json={"model": "m", "prompt": "Three,", "max_tokens": 2})
        assert refused.status_code in (200, 503)  # the gap may have ended meanwhile; never queued to a timeout
        answered = ["Three,"] if refused.status_code == 200 else []
        if refused.status_code == 503:
            assert refused.headers["retry-after"]
        wait_for(lambda: ready("2"), "version 2 serving", 600, period_s=0.5)
        assert "two copies of the engine do not fit" in said()
        rows = capture_rows(capture, 2)
        assert [row["prompt"] for row in rows] == ["One,", "Two,"]  # written by the replaced ingress as it stopped
        ask("Four,")

        # 2 -> 3: the roll fails; production comes back on version 2 and the driver serves on
        set_production(tracker, NAME, "3")
        wait_for(lambda: says("serving version 2 again"), "the rollback to version 2", 900, period_s=1.0)
        assert "roll to version 3 failed" in said()
        wait_for(lambda: ready("2"), "version 2 serving after the failed roll", 300, period_s=0.5)
        ask("Five,")
        assert driver.poll() is None

        # SIGTERM to the driver alone: a stream in flight ends whole, the buffered rows are written
        done: list[list[str]] = []
        first_chunk = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{base_url}/v1/completions", headers=auth, timeout=300, json={
                    "model": "m", "prompt": "Six,", "max_tokens": 48, "temperature": 0, "stream": True,
                    "ignore_eos": True}) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    first_chunk.set()
                done.append(lines)

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        assert first_chunk.wait(300)
        os.kill(driver.pid, signal.SIGTERM)
        streaming.join(timeout=300)
        ended, error, chunks = sse_outcome(done[0])
        assert ended and error is None and chunks > 1, done[0][-5:]  # drained, not cut
        wait_for(lambda: driver.poll() is not None, "the driver exiting", 300)
        assert driver.returncode == 0, said()[-4000:]
        kept = sorted(["One,", "Two,", "Four,", "Five,", "Six,", *answered])
        assert sorted(row["prompt"] for row in capture_rows(capture, len(kept))) == kept
    finally:
        for proc in alive(everything + psutil.Process(driver.pid).children(recursive=True)
                          if driver.poll() is None else everything):
            proc.kill()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=60)
