"""Idle half-header sockets do not take the endpoint down (issue #63 item 1): one address holding thousands of
sockets that each sent `GET /health HTTP/1.1\\r\\n` and nothing more exhausted the proxy's open files, and every
other client's `/health` and completion then failed until those sockets closed.

A real `python -m serve.production` (its own local Ray, the CPU engine) whose processes get an open-file limit of
1024, so that 2,000 idle sockets are more than the proxy could hold without the limits; the idle sockets come from
127.0.0.2, the real clients (`/health`, an `openai` completion) from 127.0.0.1. With the limits, the idle address
keeps at most `--max-connections-per-client`, the rest are refused at once, and the kept ones are closed by the
header deadline. The 20,000-socket soak: benchmarks/idle_sockets.py (docs/security.md).
"""

from __future__ import annotations

import time

import openai
import httpx
import pytest

from benchmarks.idle_sockets import IdleTally, attempt, start_endpoint, stop_endpoint, sweep, wait_healthy
from serve.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
IDLE = 2000
PER_CLIENT = 200


def test_idle_half_header_sockets_leave_other_clients_served(tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    driver = start_endpoint(tmp_path, port, ["--max-connections-per-client", str(PER_CLIENT),
                                             "--header-timeout-s", "5"], open_files=1024)
    idle = IdleTally()
    try:
        wait_healthy(driver, base_url, tmp_path / "driver.log")
        attempt(port, IDLE, idle)
        assert idle.attempted == IDLE
        # the idle address holds what it may, and no more: every other socket was refused (closed) at once
        deadline = time.monotonic() + 30
        while len(idle.open) > PER_CLIENT:
            assert time.monotonic() < deadline, f"the idle address holds {len(idle.open)} sockets after 30 s"
            time.sleep(0.2)  # polling a condition under a deadline
            sweep(idle)
        assert idle.refused >= IDLE - PER_CLIENT - idle.connect_failed, idle
        # other clients are served while the idle sockets are open
        assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        answer = api.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0)
        assert answer.choices[0].text is not None
        # and the kept half headers do not stay open: the header deadline closes them (408)
        deadline = time.monotonic() + 120
        while idle.open:
            assert time.monotonic() < deadline, f"{len(idle.open)} half-header sockets still open after 120 s"
            time.sleep(0.5)  # polling a condition under a deadline
            sweep(idle)
        assert idle.timed_out > 0, idle
    finally:
        for sock in idle.open:
            sock.close()
        stop_endpoint(driver)
