"""`python -m serve.production`: start (or join) Ray, deploy the production app, follow the registry alias.

Auth, the capture directory, the registry (model, alias or version, and a tracking URI that answers), the config
file and the Ray address are checked before Ray starts (exit 2 with one line naming the value and the fix,
`serve.production.preflight`), and the banner reports what the running ingress enforces (docs/security.md). The
HTTP proxy gets the connection limits of `serve.production.connection_guard` (header deadline, per-client and total
caps). A promotion or rollback moves the alias; `follow` rolls the app to it (`serve.production.roll`), and a roll
that fails or does not finish in time is rolled back to the version that served before: a failed roll never leaves
the endpoint down, and the failed version is not tried again until the alias moves on.

Stopping: SIGTERM (a service manager, `kill PID`) and Ctrl-C both stop the endpoint gracefully: Serve drains each
replica (in-flight requests finish, buffered capture rows are written) and stops the engines. The handler is
installed once Ray and Serve have started (`ray.init` installs its own, which exits at once).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from serve.closed_loop.capture import private_dir_problem
from serve.engines.base import ENDPOINT_MALLOC_MARKER
from serve.production.app import deploy
from serve.production.connection_guard import ConnectionLimits, proxy_environment
from serve.production.preflight import start_problem
from serve.production.settings import ProductionSettings, auth_problem, load_admin_keys, load_api_keys

# Set by the stop signals' handler before it raises KeyboardInterrupt, and checked by `follow` every second: a
# KeyboardInterrupt raised while the main thread was inside Ray (a Ctrl-C during the start, under load) can be lost
# there, and the endpoint then served on through its own Ctrl-C (seen in CI: "serving ..." printed after the
# signal, then no "stopping" line in 120 s).
STOP_REQUESTED = threading.Event()
SCRIPT = "specdec-serve"
PRINT_VERSION = object()  # what a bare --version parses to


def _parser() -> Any:
    import argparse

    import sys
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("specdec-tuner")
    except PackageNotFoundError:
        installed = "unknown (not installed: pip install -e .)"
    # the usage line names the way it was started: the console script, or `python -m`
    started = os.path.basename(sys.argv[0])
    parser = argparse.ArgumentParser(prog=SCRIPT if started == SCRIPT else "python -m serve.production",
                                     description="Serve the promoted config behind an OpenAI-compatible endpoint. "
                                                 "--tracking-uri defaults to $MLFLOW_TRACKING_URI.")
    for name, field in ProductionSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "version":
            # `--version N` pins a registered version (as it always has); a bare `--version` prints the program's
            parser.add_argument(flag, dest=name, nargs="?", const=PRINT_VERSION, default=None, metavar="N",
                                help=f"{field.description}; alone: print the installed specdec-tuner version "
                                     f"({installed}) and exit")
        elif field.annotation in (bool, bool | None):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=field.description)
        else:
            parser.add_argument(flag, dest=name, default=None, help=f"{field.description or name} "
                                f"(default: {field.default})")
    parser.add_argument("--ray-address", default=None, help="join a Ray cluster instead of starting a local one")
    parser.set_defaults(installed_version=installed)
    return parser


def console_main() -> int:
    """The `specdec-serve` console script: what `python -m serve.production` sets before `main`."""
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    return main()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = vars(parser.parse_args(argv))
    if args.get("version") is PRINT_VERSION:
        print(f"{parser.prog} {parser.get_default('installed_version')}")
        return 0
    args.pop("installed_version", None)
    address = args.pop("ray_address")
    if args.get("tracking_uri") is None and os.environ.get("MLFLOW_TRACKING_URI", "").strip():
        args["tracking_uri"] = os.environ["MLFLOW_TRACKING_URI"].strip()  # MLflow's own variable, below the flag
    try:
        settings = ProductionSettings.model_validate({k: v for k, v in args.items() if v is not None})
        settings.source_uri()
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    # The same rule the ingress enforces, checked here first: a refused start says why in this terminal, at once,
    # instead of after Serve's retries with the reason only in Ray's logs.
    problem: str | None
    try:
        keys, admin_keys = load_api_keys(settings), load_admin_keys(settings)
    except OSError as exc:
        which = "--admin-key-file" if exc.filename == settings.admin_key_file else "--api-key-file"
        problem = f"{which}: cannot read {exc.filename!r}: {exc.strerror}"
    else:
        problem = auth_problem(settings, settings.host, keys, admin_keys)
    if problem is None and settings.capture is not None:
        found = private_dir_problem(Path(settings.capture.dir))
        problem = f"--capture: the capture directory {found}" if found else None
    if not problem:
        # The registry, the config and the cluster, each within a deadline: a typo or a dead service is one line
        # here, not a traceback after Ray and Serve have started (or minutes of MLflow's retries).
        problem = start_problem(settings, address)
    if problem:
        print(f"error: {problem}", flush=True)
        return 2
    # The proxy's connection limits (serve.production.connection_guard): uvicorn under Serve never times out a
    # half-sent header and accepts sockets until its open-file limit, so one client could hold them all. Ray's
    # processes read this environment when they start: a cluster joined with --ray-address needs it on its nodes.
    note = proxy_environment(os.environ, connection_limits(settings))
    if note:
        print(f"warning: {note}", flush=True)
    if not address:
        local_ray_environment(os.environ)
    import ray
    from ray import serve

    ray.init(address=address or "local", include_dashboard=False)  # help: "instead of starting a local one"
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        # SIGTERM stops the endpoint as Ctrl-C does: installed only now, since ray.init replaced any earlier handler
        # with one that exits at once (no drain, buffered capture rows lost); both remember the stop
        # (STOP_REQUESTED). A SIGKILL runs nothing here: the
        # engine watchdog's owner link stops the engine then.
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)
        try:
            served = deploy(settings)
        except (RuntimeError, TimeoutError) as exc:
            print(f"error: {exc}", flush=True)
            serve.shutdown()
            return 1
        origin = served["origin"]
        # Ask the running ingress, not the settings: it knows the bind address and the keys it actually loaded.
        auth = serve.get_app_handle(settings.app_name).auth_summary.remote().result(timeout_s=60)
        print(f"serving {origin['source']} (version {origin['version']}) at http://{settings.host}:{settings.port}"
              f"/v1 -- auth {auth}; Ctrl-C stops", flush=True)
        follow(settings, origin.get("version"))
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the drain short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping: draining the endpoint's requests, then shutting it and its engines down", flush=True)
        drain(settings.app_name)
        serve.shutdown()
        ray.shutdown()
    return 0


def drain(app_name: str) -> None:
    """Stop the app gracefully before Serve itself: new requests get 503 + Retry-After, the requests in flight
    finish (Serve drains each replica; its proxy, which `serve.shutdown` stops at once, still carries them), and each
    ingress replica writes its buffered capture rows as it stops."""
    from ray import serve

    try:
        serve.get_app_handle(app_name).announce_gap.remote("the endpoint is stopping").result(timeout_s=30)
    except Exception:  # noqa: BLE001 - not deployed (a failed start): nothing to drain
        return
    try:
        serve.delete(app_name)  # blocking: until every replica has drained and stopped
    except Exception as exc:  # noqa: BLE001 - serve.shutdown below stops whatever is left
        print(f"draining {app_name}: {type(exc).__name__}: {exc}", flush=True)


def local_ray_environment(env: MutableMapping[str, str]) -> None:
    """The environment of a local Ray that serves this machine only (set in `env` unless it is set already; Ray's
    processes read it when they start, this one when it imports Ray):
    - Ray's single-machine mode binds every Ray listener, its metrics exporter (which answers without auth) included,
      to 127.0.0.1 (Ray 2.60 turns an explicit 127.0.0.1 node address into the machine's routable one). Serve's HTTP
      proxy binds --host regardless.
    - a fixed glibc mmap threshold (128 KiB): request bodies pass through Serve's proxy and the ingress replica in
      buffers of up to megabytes, and with glibc's default (a threshold that rises to the largest buffer freed) the
      freed ones stay in the heap among live allocations. Under streaming traffic, refused 64 MiB uploads grew the
      proxy's and the ingress's private memory by ~60 MiB each (benchmarks/soak.py); fixed, by none. Engines get
      glibc's default back (`serve.engines.base.child_env`)."""
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "MALLOC_MMAP_THRESHOLD_" not in env:
        env["MALLOC_MMAP_THRESHOLD_"] = env[ENDPOINT_MALLOC_MARKER] = str(128 * 1024)


def connection_limits(settings: ProductionSettings) -> ConnectionLimits:
    return ConnectionLimits(header_timeout_s=settings.header_timeout_s,
                            max_connections_per_client=settings.max_connections_per_client,
                            max_connections=settings.max_connections)


def _interrupt(signum: int, _frame: Any) -> None:
    STOP_REQUESTED.set()
    raise KeyboardInterrupt(f"signal {signum}")


def current_version(settings: ProductionSettings) -> str | None:
    """The version the alias points at now (None when serving a pinned version or a file)."""
    if settings.config_file or settings.version or not settings.registered_model:
        return None
    from mlflow.tracking import MlflowClient

    return str(MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri).get_model_version_by_alias(
        settings.registered_model, settings.alias).version)


class Follower:
    """Rolls the endpoint to wherever the alias points, one `step` per poll; a roll that fails (the new config does
    not deploy, or not within the serving config's timeouts) is rolled back to the version served before, and that
    version stays served until the alias points at another one. `step` never raises for a failed roll: production
    must outlive it. `deploy` and `current` are the I/O (`serve.production.app.deploy`, `current_version`)."""

    def __init__(self, settings: ProductionSettings, serving_version: str | None,
                 deploy: Callable[[ProductionSettings], dict[str, Any]] = deploy,
                 current: Callable[[ProductionSettings], str | None] | None = None,
                 say: Callable[[str], None] = lambda text: print(text, flush=True)) -> None:
        self.settings, self.serving, self.deploy, self.say = settings, serving_version, deploy, say
        self.current = current or current_version
        self.failed: str | None = None  # the version whose roll failed (not tried again until the alias moves)
        self.restore = False  # the rollback itself failed: try it again at the next step

    def step(self) -> None:
        try:
            wanted = self.current(self.settings)
        except Exception as exc:  # noqa: BLE001 - a registry hiccup must not take the endpoint down
            self.say(f"registry check failed, still serving version {self.serving}: {exc}")
            return
        if self.restore:
            self._roll_back()
        if wanted is None or wanted in (self.serving, self.failed):
            return
        self.failed = None
        self.say(f"alias {self.settings.alias} moved to version {wanted}: rolling")
        try:
            served = self.deploy(self.settings)
        except Exception as exc:  # noqa: BLE001 - whatever failed, production must keep serving
            self.say(f"roll to version {wanted} failed: {exc}")
            self.failed = wanted
            self._roll_back()
            return
        self.serving = str(served["origin"].get("version") or wanted)
        self.say(f"now serving version {self.serving}")

    def _roll_back(self) -> None:
        if self.serving is None:
            self.restore = False
            return
        self.say(f"rolling back to version {self.serving}; version {self.failed} is not tried again until alias "
                 f"{self.settings.alias} moves")
        try:
            self.deploy(self.settings.model_copy(update={"version": self.serving}))
        except Exception as exc:  # noqa: BLE001 - tried again at the next poll
            self.restore = True
            self.say(f"rollback to version {self.serving} failed ({exc}); trying again at the next poll")
            return
        self.restore = False
        self.say(f"serving version {self.serving} again")


def follow(settings: ProductionSettings, serving_version: str | None) -> None:
    """Promotion and rollback move a registry alias; this loop rolls the app to wherever the alias points."""
    follower = Follower(settings, serving_version)
    while True:
        # In slices of a second: a Ctrl-C or SIGTERM that the kernel hands to one of Ray's threads only marks the
        # signal for the main thread, which acts on it when it next runs Python; one long sleep (an hour without
        # --follow-alias-s) kept the endpoint serving through its own stop signal.
        wake_at = time.monotonic() + (settings.follow_alias_s or 3600)
        while (left := wake_at - time.monotonic()) > 0:
            if STOP_REQUESTED.is_set():  # a stop whose KeyboardInterrupt something caught on the way
                raise KeyboardInterrupt("a stop signal arrived earlier")
            time.sleep(min(1.0, left))
        if settings.follow_alias_s:
            follower.step()
