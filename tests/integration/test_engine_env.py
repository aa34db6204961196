"""The engine process does not inherit the endpoint's keys (issue #63 item 9): `SPECDEC_API_KEYS` and
`SPECDEC_ADMIN_KEYS` reach the replica that starts the engine (Ray passes the driver's environment on), and the
CPU engine's process environment carried them. A real engine started by `EngineProcess` (what both replicas run),
its environment read from /proc."""

from __future__ import annotations

import psutil
import pytest

from serve.engines.base import ReplicaConfig
from serve.replica.deployment import EngineProcess
from serve.replica.engine_start import ENDPOINT_SECRETS, engine_env
from tests.integration.production_helpers import wait_for

pytestmark = pytest.mark.integration


def environ_names(pid: int) -> set[str]:
    with open(f"/proc/{pid}/environ", "rb") as raw:
        return {entry.split(b"=", 1)[0].decode() for entry in raw.read().split(b"\0") if entry}


def test_the_engine_process_has_no_endpoint_keys(monkeypatch, tmp_path):
    for name in ENDPOINT_SECRETS:
        monkeypatch.setenv(name, "key-0123456789abcdefgh")
    engine = EngineProcess(ReplicaConfig(model="smollm2-135m", threads=1, log_dir=str(tmp_path)))
    try:
        watchdog = psutil.Process(engine.process.pid)
        child = wait_for(lambda: watchdog.children(), "the watchdog starting the engine", 60)[0]
        for pid in (watchdog.pid, child.pid):
            names = environ_names(pid)
            assert names and not names & set(ENDPOINT_SECRETS), (pid, sorted(names & set(ENDPOINT_SECRETS)))
    finally:
        engine.stop()


def test_a_config_that_names_one_keeps_it():
    env = {"SPECDEC_API_KEYS": "k", "SPECDEC_ADMIN_KEYS": "a", "PATH": "/bin"}
    assert engine_env(env, ReplicaConfig(model="m", env_from=["SPECDEC_API_KEYS"])) == {"SPECDEC_API_KEYS": "k",
                                                                                       "PATH": "/bin"}
