"""Real SGLang servers for tests, started exactly as a replica starts them (`serve.replica.deployment.EngineProcess`: the
adapter's argv, its preflight, the watchdog, its environment), from an owner process of their own so that a test can
also kill the owner and watch the watchdog free the whole process group.

SGLang on CPU needs its venv (`bash infra/install-sglang-cpu.sh`); `needs_sglang_cpu` skips with that command."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import PROJECT_ROOT, ReplicaConfig


@contextlib.contextmanager
def unkept_verdicts() -> Iterator[None]:
    """SGLang asked afresh and its answers not kept (`SPECDEC_SGLANG_VERDICTS=0`), for questions that name a test's
    temporary folder: no later question can ever match them, and the machine's store
    (`serve.engines.sglang.verdicts`) drops its oldest-written half past 4,000 answers -- the long-kept ones that
    studies and engine starts read back at every run -- so each of them would only push a useful answer out
    (the test of every bundled point wrote 866 per run). Questions without a temporary path (`server_arg_fields`)
    still read the store."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_SGLANG_VERDICTS", "0")
        yield


needs_sglang_cpu = pytest.mark.skipif(
    sglang_cpu.venv_python() is None,
    reason=f"SGLang's CPU venv is absent ({sglang_cpu.venv_dir()}): run bash infra/install-sglang-cpu.sh")

_OWNER = textwrap.dedent("""
    import json, sys
    from serve.engines.base import ReplicaConfig
    from serve.replica.deployment import EngineProcess
    process = EngineProcess(ReplicaConfig.model_validate_json(sys.argv[1]))
    process.wait_ready()
    print(json.dumps({"url": process.url, "log": str(process.log_path), "watchdog": process.process.pid,
                      "argv": process.argv, "prepared": process.prepared, "startup_s": process.startup_s}),
          flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills this owner)
    process.stop()
""")


@dataclass
class OwnedEngine:
    """An engine started by an owner process: `.url` and `.log_path` as EngineProcess has them."""

    url: str
    log_path: Path
    watchdog_pid: int
    argv: list[str]
    prepared: dict
    startup_s: float
    owner: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def owned_engine(config: ReplicaConfig, timeout_s: float = 600.0) -> Iterator[OwnedEngine]:
    """Start `config`'s engine under an owner process; stop it (closing the owner's stdin) afterwards."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, config.model_dump_json()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=PROJECT_ROOT)
    try:
        try:
            line, err = owner.stdout.readline(), ""  # type: ignore[union-attr]
            if not line:
                _, err = owner.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            owner.kill()
            pytest.fail(f"engine not ready after {timeout_s:.0f} s")
        if not line:
            pytest.fail(f"the engine did not start (owner exited {owner.poll()}):\n{err[-4000:]}")
        info = json.loads(line)
        yield OwnedEngine(info["url"], Path(info["log"]), info["watchdog"], info["argv"], info["prepared"],
                          info["startup_s"], owner)
    finally:
        if owner.poll() is None:
            owner.stdin.close()  # type: ignore[union-attr]
            try:
                owner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                owner.kill()
