"""Issue 63 item 6: SIGTERM to `python -m pipeline.tune --engine sglang` (SGLang's own server on this CPU) while an
engine is starting leaves no engine process behind. SGLang's scheduler and detokenizer and a multiprocessing resource
tracker are the engine's own children: when Ray SIGKILLs a dying worker's children (the engine's watchdog among
them), the kernel's death signal took the engine but not them, and `sglang::detokenizer` (800 MB) ran on under init.
That path, a SIGKILLed watchdog, is forced in tests/unit/test_watchdog_reaper.py; here the whole study is signalled
during its baseline's SGLang start and every process of its engine must be gone. The study runs as a user runs it from a shell (tests/cli_run.py: a clean environment with a HOME of its own, which
every process it starts inherits; that is how the test tells its processes from any other's). Skipped without
SGLang's CPU venv (bash infra/install-sglang-cpu.sh)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli_run import QUICK, REPO, clean_env
from tests.sglang_servers import needs_sglang_cpu

pytestmark = [pytest.mark.integration, pytest.mark.engines, needs_sglang_cpu]
SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\n"
         "branches:\n  ngram:\n    num_draft_tokens: {type: fixed, value: 4}\n"
         "    max_bfs_breadth: {type: fixed, value: 2}\n    capacity: {type: fixed, value: 100000}\n")


def engine_processes(home: Path) -> list[psutil.Process]:
    """This study's engine processes: its HOME in their environment, and SGLang's or an engine's in their name or
    command line (the watchdog, SGLang's server, scheduler, detokenizer, multiprocessing's resource tracker)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.environ().get("HOME") != str(home) or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "sglang" in text or "serve.engines" in text or "resource_tracker" in text:
            found.append(proc)
    return found


def detokenizers(procs: list[psutil.Process]) -> set[int]:
    out = set()
    for proc in procs:
        try:
            if proc.name().startswith("sglang::detok"):
                out.add(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def test_sigterm_to_the_driver_during_an_engine_start_leaves_no_engine_process(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    env = clean_env(tmp_path / "home")
    home = Path(env["HOME"])
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipeline.tune", "--engine", "sglang", "--name", "cli-sglang-sigterm",
         "--output", str(tmp_path / "out"), "--search-space", str(space), *QUICK,
         "--set", "engine.device=cpu", "--set", "engine.start_timeout_s=600"],
        cwd=REPO, env=env, stdout=(tmp_path / "tune.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 1500  # Ray, the replica, the preflight, then SGLang spawns its detokenizer
        while not detokenizers(engine_processes(home)):
            assert driver.poll() is None, \
                f"the study ended before its engine started: {(tmp_path / 'tune.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no SGLang engine started"
            time.sleep(0.5)  # polling a condition under a deadline
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=300)
        deadline = time.monotonic() + 120  # the watchdog's grace for SGLang's own shutdown, then the group's SIGKILL
        left = engine_processes(home)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)  # polling a condition under a deadline
            left = engine_processes(home)
        assert left == [], [(p.pid, p.name(), p.ppid()) for p in left]
    finally:
        if driver.poll() is None:
            driver.kill()
        for proc in engine_processes(home):
            proc.kill()
