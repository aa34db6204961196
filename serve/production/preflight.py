"""What `python -m serve.production` checks before it starts Ray: the registry it serves from, the config it names,
and the Ray cluster it joins. Each problem is one line naming the value and the fix, found within a deadline.

Without these, a misspelled `--registered-model` or `--alias` started Ray and Serve and then died with a traceback;
a misspelled SQLite path made MLflow create an empty `mlflow.db` there; and a tracking server that does not answer
(`--tracking-uri http://127.0.0.1:1`) took 263 s of MLflow's retries before its traceback.
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from serve.production.settings import ProductionSettings

__all__ = ["CHECK_DEADLINE_S", "sqlite_path", "tracking_problem", "registry_problem", "ray_address_problem",
           "start_problem"]

CHECK_DEADLINE_S = 10.0  # per outside service: a live one answers in milliseconds


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (None for other schemes and for an in-memory database). Pure."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):]
    if not rest.startswith("///"):
        return None  # sqlite:// (in memory) or a form MLflow refuses itself
    path = rest[3:].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def tracking_problem(uri: str, timeout_s: float = CHECK_DEADLINE_S) -> str | None:
    """Why the tracking URI cannot be the registry to serve from, or None. A SQLite file must exist (MLflow would
    create an empty one); an HTTP server must answer within `timeout_s`."""
    path = sqlite_path(uri)
    if path is not None:
        if not path.is_file():
            return (f"--tracking-uri {uri}: no MLflow database at {path.resolve()} (MLflow would create an empty one "
                    "there); give the study's existing mlflow.db, e.g. sqlite:///runs/<study>/mlflow.db")
        return None
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                return None
        except urllib.error.HTTPError:
            return None  # something answered: MLflow's own calls will say what is wrong with it
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return (f"--tracking-uri {uri}: no tracking server answered within {timeout_s:g} s ({reason}); start "
                    "the MLflow server or fix the URI")
    return None


def registry_problem(settings: ProductionSettings) -> str | None:
    """Why `--registered-model` / `--alias` / `--version` name nothing in the registry, or None (the names found
    are listed, so a typo is visible)."""
    if settings.config_file or not settings.registered_model:
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri)
    where = f"the registry at {settings.tracking_uri}"
    try:
        model = client.get_registered_model(settings.registered_model)
    except MlflowException:
        try:
            names = sorted(m.name for m in client.search_registered_models(max_results=50))
        except MlflowException:
            names = []
        known = ", ".join(names) if names else "none"
        return (f"--registered-model {settings.registered_model!r}: no such model in {where} (registered models: "
                f"{known}); fix the name or the --tracking-uri")
    if settings.version:
        try:
            client.get_model_version(settings.registered_model, settings.version)
        except MlflowException:
            return (f"--version {settings.version!r}: model {settings.registered_model!r} has no such version in "
                    f"{where}; give one of its versions")
        return None
    aliases = dict(model.aliases or {})
    if settings.alias not in aliases:
        known = ", ".join(f"{name} (version {version})" for name, version in sorted(aliases.items())) or "none"
        return (f"--alias {settings.alias!r}: model {settings.registered_model!r} has no such alias in {where} "
                f"(aliases: {known}); promote a version first (python -m pipeline.promote) or fix the alias")
    return None


def ray_address_problem(address: str, timeout_s: float = CHECK_DEADLINE_S) -> str | None:
    """Why the Ray cluster at `address` (host:port or ray://host:port) cannot be joined, or None; "auto" and
    "local" are left to Ray."""
    if address in ("auto", "local"):
        return None
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    if not parsed.hostname or parsed.port is None:
        return f"--ray-address {address!r}: expected host:port (or ray://host:port, auto)"
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            return None
    except OSError as exc:
        return (f"--ray-address {address}: nothing answers there within {timeout_s:g} s ({exc.strerror or exc}); "
                "start the cluster (ray start --head) or fix the address")


def start_problem(settings: ProductionSettings, ray_address: str | None) -> str | None:
    """The first problem the checks above find, in the order a user fixes them."""
    if settings.config_file:
        if not Path(settings.config_file).is_file():
            return f"--config-file {settings.config_file}: no such file; give a serving-config JSON/YAML file"
    elif settings.registered_model:
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            return ("--tracking-uri: not given (nor MLFLOW_TRACKING_URI); give the study's, e.g. "
                    "sqlite:///runs/<study>/mlflow.db")
        problem = tracking_problem(uri)
        if problem is None:
            problem = registry_problem(settings.model_copy(update={"tracking_uri": uri}))
        if problem:
            return problem
    return ray_address_problem(ray_address) if ray_address else None
