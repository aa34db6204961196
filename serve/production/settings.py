"""Settings of the production endpoint and the pure rules about them: where the config comes from, limits, and
who must authenticate. Shared by `serve.production` (the driver, which checks before deploying) and `serve.production.ingress`
(the replica, which enforces); neither imports the other for these.

Auth rule (`auth_required`): keys are required when the endpoint is reachable beyond this machine, judged from the
address Serve's HTTP proxy really binds (with `serve deploy` that comes from the config's `http_options`, not from
the app's arguments), or when `require_auth` is true; `require_auth: false` is the only way to serve off-localhost
without keys. Whenever keys are configured they are enforced, on localhost too. Keys that are placeholders
(`change-me...`, shipped in example files) or shorter than `MIN_KEY_CHARS` are refused at start.

Admin keys (`SPECDEC_ADMIN_KEYS`, `--admin-key-file`; `admin_access`): the closed loop's control routes (the
capture's parts, `POST /v1/drift`, the canary) take only an admin key, never a user key; an admin key also works
wherever a user key does. Without admin keys those routes answer 403, except on an endpoint bound to localhost with
no keys at all.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from serve.closed_loop.control import ADMIN_KEYS_ENV
from serve.closed_loop.capture import CaptureSettings
from serve.spec import FrozenModel

__all__ = ["ProductionSettings", "PRODUCTION", "LOCAL_HOSTS", "MIN_KEY_CHARS", "load_api_keys", "auth_required",
           "auth_problem", "key_problem", "load_admin_keys", "admin_access"]

PRODUCTION = "production"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
MIN_KEY_CHARS = 16
_PLACEHOLDERS = ("change-me", "changeme", "change_me", "placeholder", "your-key", "your_key", "example", "secret",
                 "password", "replace-me")


class ProductionSettings(FrozenModel):
    """Where the config comes from and how the endpoint behaves. Every field can be given on the command line."""

    registered_model: str | None = Field(None, description="registry name, e.g. specdec-default")
    alias: str = Field(PRODUCTION, description="registry alias to serve (ignored when version is set)")
    version: str | None = Field(None, description="a registered version number instead of an alias")
    config_file: str | None = Field(None, description="a serving-config JSON/YAML file instead of the registry")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI of the registry")
    host: str = Field("127.0.0.1", description="HTTP bind address (python -m serve.production); with `serve deploy` "
                                               "the config's http_options decide")
    port: int = Field(8000, ge=1, le=65535)
    app_name: str = PRODUCTION
    num_replicas: int = Field(1, ge=1)
    require_auth: bool | None = Field(None, description="None: required when the endpoint binds beyond localhost")
    api_keys_env: str = Field("SPECDEC_API_KEYS", description="env var with comma-separated API keys")
    api_key_file: str | None = Field(None, description="file with one API key per line")
    admin_key_file: str | None = Field(None, description=f"file with one admin key per line (besides "
                                                         f"{ADMIN_KEYS_ENV}): the capture, drift and canary routes")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="bigger bodies get 413")
    max_tokens_limit: int = Field(2048, ge=1, description="max_tokens above this gets 422; absent max_tokens "
                                                          "becomes this (chat) or min(16, this) (completions)")
    max_ongoing_requests: int = Field(512, ge=1, description="requests one ingress replica handles at once; more "
                                                            "wait in Serve's queue (max_queued_requests)")
    max_queued_requests: int = Field(256, ge=1, description="requests waiting in Serve per deployment before 429 "
                                                           "with Retry-After")
    retry_after_s: int = Field(2, ge=0, description="Retry-After of a 429")
    request_timeout_s: float = Field(300.0, gt=0, description="a request still running after this is cut: 504, "
                                                              "or an error event on a stream")
    health_timeout_s: float = Field(10.0, gt=0, description="GET /health asks each engine for at most this long: "
                                                            "504 after it (a paused or wedged engine), 503 when an "
                                                            "engine is gone")
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads")
    capture: CaptureSettings | None = Field(None, description="traffic capture to Parquet (opt-in; a directory or "
                                                            "JSON settings; see serve/closed_loop/capture.py and the PII "
                                                            "warning in docs/security.md)")
    live_records: int = Field(10_000, ge=1, description="live records (GET /v1/live) each ingress replica holds; "
                                                       "older ones are dropped")
    header_timeout_s: float = Field(10.0, gt=0, description="python -m serve.production: a connection whose request "
                                                          "headers are not complete this long after it opened (or "
                                                          "after its request began) is closed with 408")
    max_connections_per_client: int = Field(1000, ge=1, description="python -m serve.production: connections one "
                                                                   "client address may hold at the HTTP proxy; more "
                                                                   "get 503 and are closed")
    max_connections: int | None = Field(None, ge=1, description="python -m serve.production: connections the HTTP "
                                                                "proxy holds in all (default: its open-file limit "
                                                                "less a quarter, at most 2048 kept)")
    follow_alias_s: float = Field(10.0, ge=0, description="python -m serve.production: poll the registry alias this "
                                                          "often and roll to a new version (0 = off)")

    def auth_required(self, bind_host: str | None = None) -> bool:
        """See the module docstring; `bind_host` None means the settings' own host."""
        return auth_required(self, bind_host if bind_host is not None else self.host)

    def source_uri(self) -> str:
        if self.config_file:
            return str(Path(self.config_file).resolve())
        if not self.registered_model:
            raise ValueError("give registered_model (e.g. specdec-default) or config_file")
        if self.version:
            return f"models:/{self.registered_model}/{self.version}"
        return f"models:/{self.registered_model}@{self.alias}"


def load_api_keys(settings: ProductionSettings) -> list[str]:
    keys = [k.strip() for k in os.environ.get(settings.api_keys_env, "").split(",") if k.strip()]
    if settings.api_key_file:
        keys += [line.strip() for line in Path(settings.api_key_file).read_text().splitlines() if line.strip()]
    return keys


def load_admin_keys(settings: ProductionSettings) -> list[str]:
    keys = [k.strip() for k in os.environ.get(ADMIN_KEYS_ENV, "").split(",") if k.strip()]
    if settings.admin_key_file:
        keys += [line.strip() for line in Path(settings.admin_key_file).read_text().splitlines() if line.strip()]
    return keys


def admin_access(bind_host: str, user_keys: int, admin_keys: int, given: str | None) -> int | None:
    """None when a request may use an admin route, else the status to answer. `given`: "admin" or "user" (the
    kind of valid key the request sent), None for no valid key. With admin keys configured: an admin key passes,
    a user key is 403, no valid key 401. Without: 403, except on a localhost endpoint without any key. Pure."""
    if admin_keys:
        return None if given == "admin" else 403 if given == "user" else 401
    if bind_host in LOCAL_HOSTS and not user_keys:
        return None
    return 403


def auth_required(settings: ProductionSettings, bind_host: str) -> bool:
    if settings.require_auth is not None:
        return settings.require_auth
    return bind_host not in LOCAL_HOSTS


def key_problem(key: str) -> str | None:
    """Why a key must not be used (never echoing the key), or None."""
    lowered = key.lower()
    if any(p in lowered for p in _PLACEHOLDERS):
        return "a placeholder key (as shipped in example files)"
    if len(key) < MIN_KEY_CHARS:
        return f"a key shorter than {MIN_KEY_CHARS} characters"
    return None


def auth_problem(settings: ProductionSettings, bind_host: str, keys: list[str],
                 admin_keys: list[str] | None = None) -> str | None:
    """Why the endpoint must not start with these keys on this bind address, or None. Names the fix."""
    where = f"{settings.api_keys_env} / --api-key-file"
    admin_where = f"{ADMIN_KEYS_ENV} / --admin-key-file"
    for source, listed in ((where, keys), (admin_where, admin_keys or [])):
        for index, key in enumerate(listed, 1):
            problem = key_problem(key)
            if problem:
                return (f"{'admin' if source == admin_where else 'API'} key #{index} from {source} is {problem}; "
                        "generate one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if auth_required(settings, bind_host) and not keys and not admin_keys:
        return (f"API keys are required when the endpoint binds {bind_host!r} (beyond localhost): set "
                f"{settings.api_keys_env}=key1,key2 or --api-key-file, or pass --no-require-auth to serve without "
                "keys on purpose")
    return None
