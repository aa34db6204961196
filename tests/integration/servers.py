"""A real HTTP server process for integration tests: start it, wait for GET /health, stop its process group."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve.replica.deployment import stop_group


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def http_server(what: str, cmd: list[str], *, port: int, cwd: Path, env: dict[str, str], log_path: Path,
                timeout_s: float) -> Iterator[ServerProcess]:
    """Run `cmd` (which serves on 127.0.0.1:`port`) in its own session with its output in `log_path`; yield once
    /health answers 200; fail the test naming `what` if it exits or never gets healthy; SIGTERM (then SIGKILL) its
    process group after."""
    import httpx

    with open(log_path, "wb") as log_file:
        # Under the engines' watchdog, as a replica starts them: a killed test run leaves no engine behind.
        proc = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", *cmd], cwd=cwd, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited with {proc.returncode} before /health; cmd={cmd}\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"{what} not healthy after {timeout_s:.0f} s; cmd={cmd}\n{server.log()}")
            time.sleep(0.5)  # polling interval of a condition with a deadline, not a wait-and-hope
        yield server
    finally:
        stop_group(proc, 20.0)
