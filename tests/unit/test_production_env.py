"""The environment `python -m serve.production` gives its local Ray (issue #31 items 2 and 12): Ray's single-machine
mode (every Ray listener on 127.0.0.1) and a fixed glibc mmap threshold for the proxy and replicas; the engines
started under it get glibc's default back. Checked live by tests/end_to_end/test_production_driver.py (listeners)
and benchmarks/soak.py (memory back to its start level after oversize uploads)."""

from __future__ import annotations

from serve.engines.base import ENDPOINT_MALLOC_MARKER, child_env
from serve.production.cli import local_ray_environment


def test_the_local_ray_environment_and_what_engines_inherit_of_it(monkeypatch):
    env: dict[str, str] = {}
    local_ray_environment(env)
    assert env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
                   ENDPOINT_MALLOC_MARKER: str(128 * 1024)}
    for name, value in env.items():  # as the Ray processes (the replica that starts the engine) have it
        monkeypatch.setenv(name, value)
    engine = child_env()
    assert "MALLOC_MMAP_THRESHOLD_" not in engine and ENDPOINT_MALLOC_MARKER not in engine
    assert engine["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def test_an_operators_own_threshold_is_kept_for_ray_and_engines(monkeypatch):
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    local_ray_environment(env)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536" and ENDPOINT_MALLOC_MARKER not in env
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert child_env()["MALLOC_MMAP_THRESHOLD_"] == "65536"
