"""The end-to-end tier: the closed loop (capture, re-tune, canary, promotion), the level study, distributed mode on
PostgreSQL, a 2-node cluster, `serve deploy`, the production driver, and whole studies of a feature (open loop,
corpus, every fault kind). Not in the default test run: `python -m pytest -q -n 2 --dist loadfile tests` runs every
tier. The integration tier's fixtures apply here too, and `ray_head` (a `ray start --head` for a test file) serves the
files that need a cluster."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve.ports import free_port
from tests.integration.conftest import cpu_server, smol, smol_dir  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RayHead:
    address: str  # host:port of the GCS, for ray.init / study files (`ray.address`)
    dashboard: str  # the dashboard's URL, whose agent takes `serve deploy`
    env: dict[str, str]  # the environment a driver or `serve` client needs to join it (its token, the project)


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory) -> Iterator[RayHead]:
    """One `ray start --head` per test file that uses it, owned by this fixture (a head kept for the session idled
    at ~7% of a core with its dashboard and Serve's controller from the first file's end to the run's, longer than a
    second start costs): `--block` keeps it in the foreground and SIGTERM
    stops its own processes (`ray stop` would stop every Ray on the machine, killing other test sessions' drivers).
    Its own token in the environment the drivers inherit (~/.ray/auth_token exists only once something generated it,
    so relying on it made tests pass or fail with the machine's history). No drain on SIGTERM: Ray 2.60 waits up to
    30 s for the node to go idle, which Serve's detached controller and proxy never let it do."""
    port, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    log = tmp_path_factory.mktemp("ray-head") / "ray-start.log"
    with open(log, "w") as out:
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
                                 "--num-cpus=2", "--include-dashboard=true", f"--dashboard-port={dashboard}",
                                 "--disable-usage-stats", "--block"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while not (accepts(port) and accepts(dashboard)):
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "ray head not reachable after 240 s:\n" + log.read_text()[-3000:]
            time.sleep(0.5)  # polling a port under a deadline
        yield RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env)
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the group this fixture started, and nothing else
            head.wait(timeout=30)
