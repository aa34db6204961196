"""The Ray Serve deployment that owns one engine process. Trials and the production endpoint share it.

Two deployments share one engine-owning base: `EngineReplica` (HTTP ingress: every engine route under the app's
prefix; one per trial) and `EngineBackend` (handle-only, behind the production ingress). Lifecycle: the constructor
writes a corpus shipped in its config, runs the engine kind's node checks and preflight (here, where the engine will
run), starts the engine on a free port in its own process group under a watchdog, with its output in a log file, and
waits for `GET /health` up to `start_timeout_s`. If the engine exits or never gets ready, the constructor raises with
the log tail, so Serve marks the app DEPLOY_FAILED and the trial can record LAUNCH_FAILED with the reason. Every
route is proxied to the engine (streaming included). Serve's health check asks the process and `/health`. Shutdown
kills the whole process group.

A trial replica is reused from trial to trial (pipeline/trial/replicas.py): `POST /replica/engine` with the next trial's
config stops this replica's engine (its whole process group, waited for: on a GPU it holds memory) and starts the new
one in the same actor, which saves a new replica actor (a Ray worker importing Serve and FastAPI) and Serve's
deploy/delete round trip. Serve's own `reconfigure`/`user_config` cannot do this from `serve.run`: Ray 2.60 deploys
every `serve.run` under a random version, which replaces the replica.

That start runs in a thread and reports its phases (serve/engines/phases.py: stopping, preflight, waiting for GPUs,
loading, corpus) at `GET /replica/start`, each with its limit, so the trial's deadline follows the phase; their
durations are written to the engine log and returned with `/replica/argv`. When the running engine's launch fits the
next config (serve/replica/sharing.py: equal flags; corpora are loaded over HTTP, never as a flag, in a trial replica) the
engine is kept and only its corpus swapped ("launch shared"); the trial flushes and warms it up as a fresh one.
"""


import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from serve.replica import engine_client
from serve.engines import engine_for
from serve.engines.base import (CORPUS_FOLDER, ConfigRejected, ReplicaConfig, corpus_file_name, corpus_jsonl,
                                python_module_argv)
from serve.engines.load_failures import repeating_cause, with_cause
from serve.engines.phases import StartState
from serve.ports import free_port
from serve.replica.engine_start import TrialStarts, engine_env
from serve.replica.placement import START_TIMEOUT_MARKER, actor_options, log_tail
from serve.replica.usage import read_usage

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}
STOP_GRACE_S = 10.0  # x2 (SIGTERM wait, then SIGKILL wait) stays inside graceful_shutdown_timeout_s below


def write_shipped_corpus(config: ReplicaConfig, folder: str | Path) -> ReplicaConfig:
    """Runs on the engine's node before its command line is built: a corpus shipped in the config
    (`corpus_documents`) is written as JSONL to `<folder>/corpora/<name of spec.external_corpus>` and the returned
    config points `spec.external_corpus` (hence the engine's corpus-path flag) there. The driver that wrote the corpus
    may be another node without a filesystem in common. Without shipped documents the config is returned unchanged.

    A trial's driver names the same path (its own trial folder, `log_dir`), so on a single node both write the same
    bytes there and the engine reports the path the trial asked for."""
    if config.corpus_documents is None:
        return config
    spec = config.spec
    target = Path(folder) / CORPUS_FOLDER / corpus_file_name(str(getattr(spec, "external_corpus", "")))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: the driver (same node) or another replica may be writing the same content-addressed file right now.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(corpus_jsonl(config.corpus_documents))
    os.replace(tmp, target)
    return config.model_copy(update={"spec": spec.model_copy(update={"external_corpus": str(target)}),
                                     "corpus_documents": None})


class EngineProcess:
    """One engine process: node checks, start, wait for readiness, stop. Usable without Ray (tests, benchmarks).

    The constructor first writes a corpus shipped in the config (`write_shipped_corpus`), then runs the engine kind's
    `prepare` here, on the node that will run the engine (GPUs Ray assigned, driver, compiler, free GPU memory, the
    engine's own parser on the exact argv): it raises ConfigRejected when the engine refuses the config and
    RuntimeError when this node cannot run it. The engine is started through
    `serve.engines.watchdog`, which kills its process group if this process dies without running `stop`."""

    def __init__(self, config: ReplicaConfig, host: str = "127.0.0.1") -> None:
        self.kind = engine_for(config.engine)
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="specdec-engine-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        # The corpus travels in the config: written here, on the engine's node, before the command line names it.
        config = write_shipped_corpus(config, log_dir)
        self.config = config
        self.log_path = log_dir / f"engine-{self.port}.log"
        self.argv = self.kind.argv(config, host, self.port)
        self.prepared = self.kind.prepare(config, self.argv)
        self.startup_s: float | None = None  # spawn -> first healthy /health (model load, probe, server up)
        self._spawned = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            # Own session = own process group, led by the watchdog: teardown kills the engine and its children.
            pinned = ["--cpus", ",".join(map(str, config.cpus))] if config.cpus else []
            self.process = subprocess.Popen(python_module_argv("serve.engines.watchdog") + [*pinned, "--", *self.argv],
                                            stdout=log, stderr=subprocess.STDOUT,
                                            env=engine_env(self.kind.start_env(config), config),
                                            start_new_session=True, cwd=os.getcwd())

    def wait_ready(self) -> None:
        """Poll /health until 200; raise RuntimeError with the log tail on exit or timeout. The timeout is the engine
        kind's for this node (`Engine.start_timeout_s`: a node's first start may get a cold-cache allowance)."""
        timeout_s = self.kind.start_timeout_s(self.config)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited with code {self.process.returncode} before it was ready; "
                                   f"command: {' '.join(self.argv)}\n--- engine log tail ---\n{log_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - self._spawned
                    self.kind.note_started(self.config)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a refused connect costs ~1 ms; a coarser poll adds its half-period to every start
        self.stop()
        raise RuntimeError(f"{START_TIMEOUT_MARKER} {timeout_s:.0f} s (start_timeout_s); "
                           f"--- engine log tail ---\n{log_tail(self.log_path)}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL after `grace_s`; bounded, so it fits in Serve's graceful shutdown."""
        stop_group(self.process, grace_s)


def stop_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a process started in its own session (it leads its group, e.g. the engine watchdog): SIGTERM to the
    group, SIGKILL after `grace_s` (at once when `grace_s` is 0), then wait for it. Used by replicas, test servers
    and benchmarks alike."""
    if process.poll() is not None:
        return
    if grace_s > 0:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=STOP_GRACE_S)


def start_ready_engine(config: ReplicaConfig, attempts: int = 1) -> EngineProcess:
    """`config`'s engine started and ready, tried up to `attempts` times. A refused config, or a load failure a
    retry would repeat (out of memory at load, a missing file, an unsupported architecture:
    `serve.engines.load_failures`), fails at once with its cause: another start would cost the same minutes of the
    replica's GPUs and end the same way."""
    for attempt in range(1, attempts + 1):
        engine: EngineProcess | None = None
        try:
            engine = EngineProcess(config)
            engine.wait_ready()
            return engine
        except ConfigRejected:
            raise
        except RuntimeError as exc:
            if engine is not None:
                engine.stop()
            cause = repeating_cause(str(exc))
            if cause:
                raise RuntimeError(f"{with_cause(str(exc), cause)} (start {attempt} of at most {attempts}: "
                                   "not retried)") from None
            if attempt == attempts:
                raise
            print(f"engine start {attempt} of {attempts} failed, starting it again: {str(exc).splitlines()[0]}",
                  flush=True)
    raise ValueError(f"start_attempts={attempts}: at least 1")


app = FastAPI()
_DEPLOYMENT_OPTIONS: dict[str, Any] = dict(
    max_ongoing_requests=256,  # the engine queues (FIFO, max_running_requests); the replica must not
    max_constructor_retry_count=1,  # a config that cannot start fails fast instead of 20 retries
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=1,
    graceful_shutdown_timeout_s=2 * STOP_GRACE_S + 5,
)


class _EngineOwner:
    """One engine process owned by a Serve replica: start in the constructor, health, handle calls, kill on exit."""

    def __init__(self, config: dict[str, Any], standby: bool = False, start_attempts: int = 1) -> None:
        """`standby`: start no engine; the replica waits for a `POST /replica/engine` (a study's first trial, which
        claims it through `POST /replica/claim`). Its actor is up, so that trial skips a fresh replica's start.
        `start_attempts`: how many times the engine is started before the constructor fails (`start_ready_engine`)."""
        self.config = ReplicaConfig.model_validate(config)
        self.replacing = False  # an engine restart is under way: no engine to check
        self.refused: str | None = None  # why the last restart started no engine (its old one is stopped)
        self.claimed = False
        self.engine: EngineProcess | None = None
        if standby:
            self.refused = "standby replica: no engine started yet (a trial's POST /replica/engine starts one)"
        else:
            self.engine = start_ready_engine(self.config, start_attempts)
        self.client = self._engine_client()

    def _engine_client(self) -> httpx.AsyncClient:
        # a standby has no engine yet: its client points nowhere, and the proxy answers "connection refused"
        url = self.engine.url if self.engine is not None else "http://127.0.0.1:9"
        return engine_client.new_client(url)

    def _engine_down(self) -> str | None:
        """Why there is no engine to ask now (the engine client answers EngineUnavailable at once), else None."""
        if self.engine is None:
            return self.refused or "no engine is running"
        if not self.engine.alive():
            return f"the engine exited with code {self.engine.process.returncode}; Serve is replacing this replica"
        return None

    async def check_health(self) -> None:
        # During a restart (it has its own deadline, start_timeout_s) or after one that started nothing, there is no
        # engine to check, and the caller deletes or restarts the replica: Serve must not replace the actor meanwhile.
        if self.replacing or self.refused or self.engine is None:
            return
        if not self.engine.alive():
            raise RuntimeError(f"engine exited with code {self.engine.process.returncode}")
        response = await self.client.get("/health", timeout=20)
        if response.status_code != 200:
            raise RuntimeError(f"engine /health answered {response.status_code}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()

    async def call(self, method: str, path: str, body: bytes = b"",
                   headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """One engine request, whole response: (status, content type, body). EngineUnavailable when the engine is
        gone (serve.replica.engine_client: a reset idle connection is retried once)."""
        return await engine_client.call(self.client, self._engine_down, method, path, body, headers)

    async def call_stream(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """Streaming engine request: yields (status, content type) first, then the raw body chunks
        (serve.replica.engine_client, as `call`)."""
        async for item in engine_client.call_stream(self.client, self._engine_down, method, path, body, headers):
            yield item


@serve.deployment(**_DEPLOYMENT_OPTIONS)
class EngineBackend(_EngineOwner):
    """Handle-only engine replica, behind the production ingress (an app may have one HTTP ingress only)."""


@serve.deployment(**_DEPLOYMENT_OPTIONS)
@serve.ingress(app)
class EngineReplica(TrialStarts, _EngineOwner):
    """An engine replica with every engine route proxied over HTTP under the app's prefix (one per trial). Its engine
    starts (`POST /replica/engine`) are `TrialStarts` (serve/replica/engine_start.py)."""

    stop_limit_s = 2 * STOP_GRACE_S + 5

    def __init__(self, config: dict[str, Any], standby: bool = False) -> None:
        super().__init__(config, standby)
        self.start = StartState()  # the trial-driven starts (POST /replica/engine), polled at GET /replica/start
        self.launched: ReplicaConfig | None = self.config if self.engine is not None else None  # the running
        # engine's launch config (serve/replica/sharing.py): a later config that can share it runs on this engine
        self.corpus: dict[str, Any] | None = None  # the runtime-loaded corpus: id, load seconds, tokens

    def _spawn(self, config: ReplicaConfig) -> EngineProcess:
        return EngineProcess(config)

    def _stop_engine(self, engine: EngineProcess) -> None:
        engine.stop(STOP_GRACE_S if actor_options(self.config).get("num_gpus") else 0.0)

    def _write_corpus(self, config: ReplicaConfig) -> ReplicaConfig:
        return write_shipped_corpus(config, str(config.log_dir))

    @app.get("/replica/log")
    async def engine_log(self) -> PlainTextResponse:
        """The engine log's tail: trials attach it to their MLflow run. 404 when the last restart started no engine
        (the previous engine's log is not this config's)."""
        if self.refused or self.engine is None:
            return PlainTextResponse(self.refused or "no engine", status_code=404)
        return PlainTextResponse(log_tail(self.engine.log_path, 200_000))

    @app.get("/replica/argv")
    async def engine_command(self) -> dict[str, Any]:
        """What ran where: the engine's argv, its start-up time (None when this config shares an earlier config's
        launch), the node checks' findings, the Ray node, the replica actor's own pid (the same across engine
        restarts), the last start's phases, the launch (shared or not, the config it was launched for) and the
        corpus loaded at runtime."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        status = self.start.snapshot()
        launch = {"shared": status["shared"], "launched": self.launched.model_dump(mode="json")
                  if self.launched is not None else None}
        if self.engine is None:
            return {"argv": None, "pid": None, "startup_s": None, "prepared": {}, "replica_pid": os.getpid(),
                    "node_id": node, "phases": status["phases"], "launch": launch, "corpus": None}
        return {"argv": self.engine.argv, "pid": self.engine.process.pid,
                "startup_s": None if status["shared"] else self.engine.startup_s,
                "prepared": self.engine.prepared, "node_id": node, "replica_pid": os.getpid(),
                "phases": status["phases"], "launch": launch, "corpus": self.corpus}

    @app.get("/replica/usage")
    async def usage(self) -> dict[str, Any]:
        """The engine's and this node's CPU counters now (serve/replica/usage.py): a trial reads them around its
        measurement window to tell whether the engine had the CPU it wanted."""
        engine = self.engine
        group = engine.process.pid if engine is not None and engine.alive() else None  # the engine leads its group
        return (await asyncio.to_thread(read_usage, group)).model_dump(mode="json")

    @app.post("/replica/engine")
    async def replace_engine(self, request: Request, fresh: bool = False) -> JSONResponse:
        """Start the engine for the posted `ReplicaConfig` (a study's next trial) and answer at once: 200
        {"ok": true} when the start began (follow it at `GET /replica/start`), {"ok": false, "error"} while another
        start is under way, 409 when the config needs other `ray_actor_options` (the caller deploys a fresh app:
        resources are the actor's). The running engine is kept when the config can share its launch
        (serve/replica/sharing.py) and `fresh` is not asked; else it is stopped and a new one started. The actor and its app
        stay either way."""
        config = ReplicaConfig.model_validate(await request.json())
        if actor_options(config) != actor_options(self.config):
            return JSONResponse({"ok": False, "error": "the config needs other ray_actor_options than this replica "
                                 f"has: {actor_options(config)} vs {actor_options(self.config)}"}, status_code=409)
        if self.replacing:
            return JSONResponse({"ok": False, "error": "another engine start is under way in this replica"})
        self.replacing = True
        self.start.begin()
        await self.client.aclose()
        # Blocking work (process-group stop, node checks, polling /health, corpus load) off the event loop: Serve's
        # health check and the log and start routes keep answering.
        threading.Thread(target=self._run_start, args=(config, fresh), daemon=True).start()
        return JSONResponse({"ok": True})

    @app.get("/replica/start")
    async def start_status(self, since: int = -1, wait: float = 0.0) -> dict[str, Any]:
        """The current or last start (`StartState.snapshot`); with `wait`, answers once its `seq` differs from
        `since` (a phase change or the end) or after `wait` seconds, whichever is first."""
        deadline = time.monotonic() + min(max(wait, 0.0), 30.0)
        while self.start.seq == since and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.start.snapshot()

    @app.post("/replica/claim")
    async def claim(self, request: Request) -> JSONResponse:
        """Hand this replica to one caller: {"ok": true} to the first whose posted `ray_actor_options` are this
        replica's, {"ok": false, "error": ...} to a later one (several trial processes may ask for one standby), and
        409 when the options differ (as `POST /replica/engine`: nobody with those options can use it)."""
        options = await request.json()
        if options != actor_options(self.config):
            return JSONResponse({"ok": False, "error": f"this replica has ray_actor_options "
                                 f"{actor_options(self.config)}, the caller needs {options}"}, status_code=409)
        if self.claimed:
            return JSONResponse({"ok": False, "error": "claimed already"})
        self.claimed = True  # no await since the check: one claim wins
        return JSONResponse({"ok": True})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(self, path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        upstream = self.client.build_request(request.method, f"/{path}", params=request.query_params,
                                             content=await request.body(), headers=headers)
        response = await self.client.send(upstream, stream=True)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        if "text/event-stream" in response.headers.get("content-type", ""):
            async def relay():
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()

            return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)
        body = await response.aread()
        await response.aclose()
        return Response(body, status_code=response.status_code, headers=out_headers)
