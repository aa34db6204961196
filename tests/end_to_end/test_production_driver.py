"""`python -m serve.production` ended by SIGTERM, SIGINT or SIGKILL leaves no engine behind (issue #31 item 5), and
its local Ray listens on 127.0.0.1 only (item 12: Ray's metrics exporter answered on every interface without auth).
Ended by Ctrl-C, the capture rows its ingress still buffered are on disk (issue 42 item 5: 7 of 7 were lost on
SIGINT; SIGTERM to the driver alone, as `kill PID` and a service manager in `KillMode=mixed` send it, is checked with
a stream in flight in test_production_roll.py). A SIGKILL runs nothing, and a SIGTERM to the whole process group
reaches Ray's workers too, which exit without a drain: rows buffered then are lost (docs/security.md).

A real driver each time: it starts its own local Ray and Serve, deploys a serving-config file and serves; the test
finds its engine process among the driver's descendants, signals the driver alone, and waits (bounded) until the
engine, its watchdog and the driver are gone. Before the fix a SIGKILLed driver left the engine serving, with PPID 1
and no watchdog (Ray kills a dying worker's child processes with SIGKILL, which took the watchdog only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from serve.engines.base import ReplicaConfig, child_env
from serve.ports import free_port
from serve.serving import Provenance, ServingConfig
from tests.integration.production_endpoint import capture_rows
from tests.integration.production_helpers import alive, app_processes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


# How a driver ends: a service manager's stop (SIGTERM to the process group, SIGKILL to it 5 s later if still up),
# Ctrl-C in its terminal (SIGINT to the foreground process group), and `kill -9` of the driver alone.
ENDINGS = {"SIGTERM-group-then-SIGKILL": (signal.SIGTERM, True, 5.0), "SIGINT-group": (signal.SIGINT, True, None),
           "SIGKILL-driver": (signal.SIGKILL, False, None)}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_engine_dies_with_the_driver_however_it_ends(tmp_path, ending):
    sig, group, escalate_after_s = ENDINGS[ending]
    config = ServingConfig(replica=ReplicaConfig(model="smollm2-135m", threads=1),
                           provenance=Provenance(study="driver", decision="keep_baseline", source="baseline",
                                                 workload="w", workload_digest="0123456789abcdef"))
    (tmp_path / "serving.json").write_text(config.model_dump_json())
    port = free_port()
    env = {k: v for k, v in child_env().items() if k != "SPECDEC_API_KEYS"}
    capture = {"dir": str(tmp_path / "capture"), "sample_rate": 1, "flush_rows": 64, "flush_s": 3600}
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen([sys.executable, "-m", "serve.production", "--config-file",
                                   str(tmp_path / "serving.json"), "--port", str(port), "--threads", "1",
                                   "--follow-alias-s", "0", "--capture", json.dumps(capture)], cwd=REPO, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    everything: list[psutil.Process] = []
    try:
        def healthy() -> bool:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "the endpoint serving", 600, period_s=0.5)
        for prompt in ("One,", "Two,"):  # buffered in the ingress: fewer than flush_rows, younger than flush_s
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                json={"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert answer.status_code == 200, answer.text
        assert capture_rows(tmp_path / "capture", 0) == []
        found = app_processes("production", root=driver.pid)
        assert len(found["engine"]) == 1 and len(found["watchdog"]) == 1, found
        everything = psutil.Process(driver.pid).children(recursive=True)
        # Ray's own listeners, its unauthenticated metrics exporter above all, bind this machine only (item 12); the
        # exception is Serve's inter-deployment gRPC port of each replica, which Ray 2.60 binds to [::] in its code
        # (docs/security.md, "Ray's own listeners")
        ours = {proc.pid: proc.name() for proc in everything} | {driver.pid: "driver"}
        public = sorted(f"{c.laddr.ip}:{c.laddr.port} ({ours[c.pid]})" for c in psutil.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.pid in ours and c.laddr.ip not in LOOPBACK
                        and not (c.laddr.ip == "::" and ours[c.pid].startswith("ray::ServeReplica")))
        assert public == [], f"listening beyond 127.0.0.1: {public}"
        (os.killpg if group else os.kill)(driver.pid, sig)
        if escalate_after_s is not None:
            try:
                driver.wait(timeout=escalate_after_s)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, signal.SIGKILL)
        wait_for(lambda: driver.poll() is not None, "the driver exiting", 120)
        wait_for(lambda: not alive(found["engine"] + found["watchdog"]), "the engine and its watchdog gone", 60)
        if sig == signal.SIGINT:
            assert sorted(r["prompt"] for r in capture_rows(tmp_path / "capture", 2)) == ["One,", "Two,"], \
                (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        for proc in alive(everything):
            proc.kill()  # whatever a failing run left: never leak a Ray or an engine into the next test
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
