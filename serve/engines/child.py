"""An engine's own HTTP server run as the child of the engine's shim (llama.cpp's llama-server, vLLM's OpenAI server):
started on a private port of this host, awaited until its `/health` answers 200, stopped.

Both shims ran their server the same way, each with its own copy of the code; one class keeps a fix to how a child is
started, awaited or ended from reaching one engine only. What differs stays in the engine's module: the server's name
in messages and the shim's log lines (`name`, `say`), how often readiness is polled and how long a stop waits, a run's
own arguments (`run_argv`: llama.cpp's fresh dynamic lookup cache) and its environment (`environment`: vLLM's
without the project on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from serve.ports import free_port

__all__ = ["ChildServer"]


class ChildServer:
    """One run at a time of an engine's server, its output in the shim's (= the engine log) and in the shim's process
    group (the replica's and the watchdog's `killpg` end both). `starts` counts the runs; `argv` and `url` are the
    current run's."""

    def __init__(self, argv: list[str], *, name: str, say: Callable[[str], None], ready_poll_s: float,
                 stop_grace_s: float) -> None:
        self.base_argv = argv
        self.name = name
        self.say = say
        self.ready_poll_s = ready_poll_s
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen | None = None
        self.argv: list[str] = []
        self.url = ""
        self.starts = 0

    def run_argv(self) -> list[str]:
        """This run's own arguments, after the base argv and the port (called once per start, `starts` counting
        it): none unless the engine's subclass adds them."""
        return []

    def environment(self) -> dict[str, str] | None:
        """The child's environment; None: the shim's own."""
        return None

    def start(self) -> None:
        port = free_port()
        self.starts += 1
        self.argv = [*self.base_argv, "--host", "127.0.0.1", "--port", str(port), *self.run_argv()]
        self.url = f"http://127.0.0.1:{port}"
        self.say("starting: " + " ".join(self.argv))
        self.process = subprocess.Popen(self.argv, stdout=sys.stdout, stderr=sys.stderr, env=self.environment())

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the child's `/health` answers 200; RuntimeError when it exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise RuntimeError(f"{self.name} exited with code {code} before it was ready")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        return
                await asyncio.sleep(self.ready_poll_s)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s")

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `grace_s` (the engine's `stop_grace_s` unless given); nothing if not running."""
        if self.process is None or self.process.poll() is not None:
            return
        grace = self.stop_grace_s if grace_s is None else grace_s
        self.process.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=grace)
