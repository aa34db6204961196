"""The outside services a study uses, checked before anything is written: the Ray cluster (`ray.address`), the MLflow
tracking server (`tracking.uri`) and the Optuna database (`storage.url`), with its Python driver.

Each check has a deadline (`DEADLINE_S`), so a dead service costs seconds, not Ray's or MLflow's minutes of retries,
and each problem is one `PipelineError` line naming the setting, the URL (password masked) and the fix. They run
before the output folder exists, so the corrected command is not refused with "pass --resume". Local defaults
(a new local Ray, SQLite under the output folder) are not services and are not checked here
(`pipeline/preflight.py` checks that SQLite paths are writable).

The decisions (which check a URL needs, the words of a problem) are pure; `check_services` does the I/O.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pipeline.config import StudyConfig
from pipeline.errors import PipelineError
from pipeline.redact import mask_url

DEADLINE_S = 10.0  # per service; three services stay well inside a minute
RAY_CLIENT_PORT = 10001  # ray://host without a port
RAY_GCS_PORT = 6379  # host without a port (Ray's default GCS port)
# SQLAlchemy dialects whose drivers take libpq/MySQL's `connect_timeout` (seconds) as a connect argument
TIMEOUT_ARG_BACKENDS = ("postgresql", "mysql", "mariadb")
# tracking URIs MLflow serves from a database server (others: sqlite, preflight's; databricks and plugins: theirs)
GATEWAY_ERRORS = (502, 503, 504)  # what a proxy answers for a server behind it that does not
DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle")


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) a `ray.address` connects to first, or None when nothing outside is joined ("local") or Ray
    finds the cluster itself ("auto": `resolve_auto`). Raises ValueError for a malformed address. Pure."""
    if address in ("local", "auto"):
        return None
    client = address.startswith("ray://")
    rest = address[len("ray://"):] if client else address
    if "://" in rest or not rest:
        raise ValueError("not host:port, ray://host:port, auto or local")
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = rest, str(RAY_CLIENT_PORT if client else RAY_GCS_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("not host:port, ray://host:port, auto or local")
    return host.strip("[]"), int(port)


def postgres_driver_hint(drivername: str, installed: Callable[[str], bool]) -> str:
    """The fix for a missing PostgreSQL driver: SQLAlchemy 2.1's bare `postgresql://` means psycopg (3); name the
    installed one in the URL, or install psycopg. Pure apart from `installed` (is a module importable)."""
    if drivername == "postgresql" and installed("psycopg2"):
        return ("SQLAlchemy 2.1's postgresql:// means psycopg (3), which is not installed; psycopg2 is. Fix: write "
                "postgresql+psycopg2://..., or pip install 'psycopg[binary]'")
    return "Fix: install that driver, or name an installed one in the URL (e.g. postgresql+psycopg2://...)"


def first_line(exc: BaseException) -> str:
    """An exception's own words, one line, without SQLAlchemy's "(Background on this error ...)" tail."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split()) or type(orig).__name__
    return text.split(" (Background on this error")[0][:300]


def within(deadline_s: float, work: Callable[[], Any]) -> tuple[bool, BaseException | None]:
    """Run `work` in a daemon thread for at most `deadline_s`: (finished, its exception). A driver call that
    ignores its own timeout is left behind in the thread; the process exits soon after a failed check."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which words it
            box[0] = exc

    thread = threading.Thread(target=run, name="service-check", daemon=True)
    thread.start()
    thread.join(deadline_s)
    return not thread.is_alive(), box[0]


def check_tcp(what: str, shown: str, host: str, port: int, fix: str, deadline_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=deadline_s):
            return
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
    raise PipelineError(f"{what}: cannot reach {shown} ({host}:{port}: {reason}, {deadline_s:g} s deadline). {fix}")


def check_ray(address: str | None, deadline_s: float = DEADLINE_S) -> None:
    """A given `ray.address` answers (its GCS or Ray Client port accepts a connection); "auto" names a cluster."""
    what, fix = "ray.address (--ray-address)", ("Fix: start the cluster (ray start --head) or correct the address; "
                                                "leave it unset to start a local Ray")
    if address is None or address == "local":
        return
    try:
        endpoint = ray_endpoint(address)
    except ValueError as exc:
        raise PipelineError(f"{what}: {address!r} is {exc}. {fix}") from None
    if endpoint is None:  # "auto": the cluster `ray start` last recorded on this machine, or RAY_ADDRESS
        # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            found = canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as exc:
            raise PipelineError(f"{what}: 'auto' found no running Ray cluster on this machine ({first_line(exc)}). "
                                f"{fix}") from None
        endpoint = ray_endpoint(found)
        if endpoint is None:
            return
    check_tcp(what, repr(address), *endpoint, fix, deadline_s)


def check_tracking_server(uri: str, deadline_s: float = DEADLINE_S) -> None:
    """An http(s) tracking URI answers HTTP at all (any status: a proxy's 401 is a live server)."""
    what = "tracking.uri (--tracking-uri)"
    parts = urlsplit(uri)
    host = parts.hostname or ""
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    probe = f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}/health"  # MLflow's liveness route; no credentials
    try:
        with urllib.request.urlopen(probe, timeout=deadline_s):  # noqa: S310 - the scheme is http(s), checked
            return
    except urllib.error.HTTPError as exc:
        if exc.code not in GATEWAY_ERRORS:
            return  # the server answered (a 401 or 404 from a live server is still a live server)
        text = f"HTTP {exc.code} from a proxy on the way"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        text = "no answer" if isinstance(reason, TimeoutError) else str(getattr(reason, "strerror", None) or reason)
    raise PipelineError(f"{what}: cannot reach the MLflow server {mask_url(uri)} ({text}, {deadline_s:g} s "
                        "deadline). Fix: start it (mlflow server ...) or correct the URI; leave it unset for SQLite "
                        "under the output folder")


def check_database(url: str, what: str, deadline_s: float = DEADLINE_S) -> None:
    """A SQLAlchemy database URL (not SQLite): its dialect and Python driver load, and a connection opens."""
    # lazy: SQLAlchemy only when a database URL is checked
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    from sqlalchemy.pool import NullPool

    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise PipelineError(f"{what}: {shown!r} is not a database URL. Fix: dialect+driver://user:password@host/"
                            "name, e.g. postgresql+psycopg2://...") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return
    try:
        parsed.get_dialect().import_dbapi()
    except NoSuchModuleError:
        raise PipelineError(f"{what}: {shown}: SQLAlchemy has no dialect {parsed.drivername!r}. Fix: a URL such as "
                            "postgresql+psycopg2://user:password@host/name") from None
    except ImportError as exc:
        hint = postgres_driver_hint(parsed.drivername, lambda m: importlib.util.find_spec(m) is not None) \
            if backend == "postgresql" else "Fix: install that driver, or name an installed one in the URL"
        raise PipelineError(f"{what}: {shown} needs the Python module {exc.name or 'its driver'!r}, which is not "
                            f"installed. {hint}") from None
    connect_args = {"connect_timeout": max(1, int(deadline_s))} if backend in TIMEOUT_ARG_BACKENDS else {}
    engine = create_engine(parsed, poolclass=NullPool, connect_args=connect_args)

    def connect() -> None:
        with engine.connect():
            pass

    # the driver's own timeout first; the thread's deadline for a driver without one (a second more, for it to win)
    finished, error = within(deadline_s + 1, connect)
    if finished and error is None:
        engine.dispose()
        return
    reason = first_line(error) if error is not None else "no answer"
    raise PipelineError(f"{what}: cannot connect to {shown} ({reason}, {deadline_s:g} s deadline). Fix: start the "
                        "database or correct the URL (host, port, user, password, database name)")


def bounded(what: str, shown: str, deadline_s: float, check: Callable[[], None]) -> None:
    """`check` with a deadline of its own: a socket's timeout does not bound the host name's lookup."""
    finished, error = within(deadline_s + 2, check)
    if error is not None:
        raise error
    if not finished:
        raise PipelineError(f"{what}: no answer from {shown} within {deadline_s:g} s (its host name's lookup or "
                            "connection hangs). Fix: correct the address, or check the network to it")


def check_services(study: StudyConfig, deadline_s: float = DEADLINE_S) -> None:
    """Every outside service the study names; raises PipelineError (one line) at the first that does not answer."""
    address = study.ray.address
    if address is not None:
        bounded("ray.address (--ray-address)", repr(address), deadline_s, lambda: check_ray(address, deadline_s))
    uri = study.tracking.uri
    if uri:
        scheme = urlsplit(uri).scheme.lower()
        shown = str(mask_url(uri))
        if scheme in ("http", "https"):
            bounded("tracking.uri (--tracking-uri)", shown, deadline_s,
                    lambda: check_tracking_server(uri, deadline_s))
        elif scheme.split("+")[0] in DATABASE_SCHEMES:  # MLflow's SQLAlchemy store on a database server
            bounded("tracking.uri (--tracking-uri)", shown, deadline_s,
                    lambda: check_database(uri, "tracking.uri (--tracking-uri)", deadline_s))
    url = study.storage.url
    if url:
        bounded("storage.url (--storage)", str(mask_url(url)), deadline_s,
                lambda: check_database(url, "storage.url (--storage)", deadline_s))
