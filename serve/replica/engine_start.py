"""A trial replica's engine starts (the `EngineReplica` side of `POST /replica/engine`, serve/replica/deployment.py): run in a
thread, reported phase by phase (serve/engines/phases.py), sharing the running engine's launch when the next config
can (serve/replica/sharing.py), and loading an NGRAM corpus over SGLang's runtime route instead of a start flag.
"""

from __future__ import annotations

import tempfile
import time
from typing import TYPE_CHECKING, Any

import httpx

from serve.engines.base import ReplicaConfig
from serve.engines.phases import StartState, reporting
from serve.replica.sharing import can_share, launch_config, runtime_corpus
from serve.spec import NgramSpec

__all__ = ["TrialStarts", "PREFLIGHT_LIMIT_S", "CORPUS_LIMIT_S", "ENDPOINT_SECRETS", "engine_env"]

# The production endpoint's key variables (`serve.production.settings`): the replica that starts an engine inherits
# them from the driver through Ray, and an engine (no auth of its own, a process anyone on the node may inspect)
# has no use for them.
ENDPOINT_SECRETS = ("SPECDEC_API_KEYS", "SPECDEC_ADMIN_KEYS")

# Limits of the start phases (serve/engines/phases.py) besides stopping (the host's) and loading (start_timeout_s).
PREFLIGHT_LIMIT_S = 600.0  # the engine's own bounds inside: SGLang's preflight 300 s, its GPU wait 120 s
CORPUS_LIMIT_S = 600.0


def engine_env(env: dict[str, str], config: ReplicaConfig) -> dict[str, str]:
    """The engine process's environment: `env` less the endpoint's key variables, unless the serving config names
    one itself (`env` / `env_from`). Pure."""
    named = set(config.env) | set(config.env_from)
    return {name: value for name, value in env.items() if name not in ENDPOINT_SECRETS or name in named}


def _engine_json(method: str, url: str, body: dict[str, Any] | None = None,
                 timeout_s: float = 60.0) -> dict[str, Any] | None:
    """One JSON call to the engine from a replica's start thread: the answer's body (also a 400's), None when the
    engine did not answer JSON."""
    try:
        response = httpx.request(method, url, json=body, timeout=timeout_s)
        answer = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


class TrialStarts:
    """Mixin of the trial replica. The host has `engine`, `config`, `refused`, `client`, `replacing`, `start` (a
    StartState), `launched` (the running engine's launch config), `corpus` (its runtime corpus record),
    `stop_limit_s`, and `_engine_client()`, `_spawn(config)` (a started engine process, after the node checks),
    `_stop_engine(engine)` and `_write_corpus(config)` (a shipped corpus written on this node)."""

    engine: Any
    config: ReplicaConfig
    refused: str | None
    client: Any
    replacing: bool
    start: StartState
    launched: ReplicaConfig | None
    corpus: dict[str, Any] | None
    stop_limit_s: float

    if TYPE_CHECKING:  # the host's; not defined here, so the host's own methods are not shadowed
        def _engine_client(self) -> Any: ...
        def _spawn(self, config: ReplicaConfig) -> Any: ...
        def _stop_engine(self, engine: Any) -> None: ...
        def _write_corpus(self, config: ReplicaConfig) -> ReplicaConfig: ...

    def _run_start(self, config: ReplicaConfig, fresh: bool) -> None:
        reporting(self.start.enter)  # this thread's context: the engine kind's prepare may report a later phase
        error: str | None
        try:
            error = self._replace(config, fresh)
        except Exception as exc:  # noqa: BLE001 - the poller must get an answer whatever went wrong
            error = f"{type(exc).__name__}: {exc}"
        self.client = self._engine_client()
        self.start.finish(error)
        self.replacing = False
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.start.phases.items())
        self._log_line(f"start {'failed' if error else 'done'}: {phases or 'no phase'}"
                       + (" (launch shared)" if self.start.shared else ""))

    def _log_line(self, text: str) -> None:
        """A line of the replica's own in the engine's log (the trial's record of what this start did)."""
        if self.engine is not None and self.refused is None:
            with open(self.engine.log_path, "a", encoding="utf-8") as log:
                log.write(f"[replica] {text}\n")

    def _replace(self, config: ReplicaConfig, fresh: bool) -> str | None:
        """Share the running engine's launch when the config can (serve/replica/sharing.py), else stop it fully first (GPU
        memory) and start a new one; then load the corpus. The error text, else None.
        A new engine that fails to start stays `self.engine` (dead), so `/replica/log` shows its log.
        An engine without GPUs is killed at once (its log was read, it serves nothing, and a graceful exit cost
        ~0.25 s of every trial); one with GPUs gets SIGTERM first, as its own shutdown frees device memory."""
        if config.log_dir is None:
            config = config.model_copy(update={"log_dir": tempfile.mkdtemp(prefix="specdec-engine-")})
        # The corpus is written on this node now (it may be shipped in the config); the engine never gets it as a flag.
        config = self._write_corpus(config)
        engine = self.engine
        if (not fresh and engine is not None and self.refused is None and engine.alive()
                and self.launched is not None and can_share(self.launched, config)):
            self.start.shared = True
            self._log_line(f"launch shared: the next config runs on this engine (pid {engine.process.pid}), "
                           f"flushed by the trial; log folder of that config: {config.log_dir}")
            self.config = config
            return self._swap_corpus(runtime_corpus(config))
        self.start.enter("stopping", self.stop_limit_s)
        if engine is not None:
            self._stop_engine(engine)
        self.start.enter("preflight", PREFLIGHT_LIMIT_S)
        self.corpus, self.launched = None, None
        try:
            engine = self._spawn(launch_config(config))
        except Exception as exc:  # noqa: BLE001 - as the constructor's would: prepare refused it, or the node cannot
            self.refused = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
            return self.refused
        self.engine, self.config, self.refused = engine, config, None
        self.start.enter("loading", engine.kind.start_timeout_s(engine.config))  # with a cold node's allowance
        try:
            engine.wait_ready()
        except RuntimeError as exc:
            engine.stop()
            return str(exc)
        self.launched = config
        return self._swap_corpus(runtime_corpus(config))

    def _swap_corpus(self, wanted: str | None) -> str | None:
        """Make `wanted` (a corpus file on this node, its path as its id, as SGLang names a start-up corpus) the one
        corpus the engine holds: others removed, it added and timed. The error text, else None."""
        engine = self.engine
        if engine is None or not isinstance(self.config.spec, NgramSpec):
            self.corpus = None
            return None
        url = engine.url
        loaded = _engine_json("GET", f"{url}/list_external_corpora")
        held = list((loaded or {}).get("corpus_token_counts") or {})
        if wanted is None and not held:
            self.corpus = None
            return None
        self.start.enter("corpus", CORPUS_LIMIT_S)
        for corpus_id in held:
            _engine_json("POST", f"{url}/remove_external_corpus", {"corpus_id": corpus_id})
        self.corpus = None
        if wanted is None:
            return None
        started = time.monotonic()
        answer = _engine_json("POST", f"{url}/add_external_corpus", {"corpus_id": wanted, "file_path": wanted},
                              timeout_s=CORPUS_LIMIT_S)
        if not answer or not answer.get("success"):
            return f"the engine did not load the external corpus {wanted}: {(answer or {}).get('message') or answer}"
        self.corpus = {"id": wanted, "load_s": round(time.monotonic() - started, 3),
                       "loaded_token_count": answer.get("loaded_token_count")}
        return None

