"""Where a trial's engine runs: one Serve app per study and trial process, reused from trial to trial.

A new Serve app costs a new replica actor (a Ray worker importing Serve and FastAPI) plus the controller's reconcile,
about 4.4 s on 2 cores, and deleting one blocks until replica and engine are gone, about 2.3 s. So each process that
runs trials (a Tune worker, which Tune reuses across trials; the driver for the finalist re-runs) keeps its study's
app alive after a trial, and the next trial only restarts the engine process inside that replica
(`POST /replica/engine`, serve/replica.py): the old engine's process group is stopped and waited for (on a GPU it holds
memory), the new one started and waited for. Every trial still measures a fresh engine process.

A study's first trial would also pay a fresh replica, after a fresh Tune worker's start (~2 s): so before the search
the driver deploys a standby replica without an engine (`start_standby`, only where replicas hold no GPU: an idle
replica must not keep GPUs from a trial), and a trial process holding no app claims it (`claim_standby`, one claimant
wins) and starts its engine there; its `serve_replica` tag says `standby`.

A fresh app is deployed instead when the process holds none (and no standby is left), when the trial needs other `ray_actor_options` than the
live replica has (resources and node placement belong to the actor), and when the live replica does not answer as
expected. After any failure of the engine or the replica the app is deleted (`release`), so one broken trial never
breaks the next. A study's apps are deleted by its driver when the search ends and again when the study ends
(`delete_study_apps`), and a driver deletes leftovers of its own study at start (`pipeline.study.driver.connect_ray`).

Serve's `reconfigure`/`user_config` is not used: Ray 2.60's `serve.run` deploys each call under a random version,
which replaces the replica (a user_config change keeps the actor only through `serve deploy`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from serve.engines.base import ReplicaConfig


@dataclass(frozen=True)
class LiveApp:
    """This process's live trial app of one study: its Serve name, the Serve URL it answers under, its replica's
    `ray_actor_options`."""

    name: str
    serve_url: str
    options: dict[str, Any]

    @property
    def url(self) -> str:
        return f"{self.serve_url}/{self.name}"


# Per process, by study name. A Tune worker runs one trial at a time, so one live app per study suffices.
LIVE: dict[str, LiveApp] = {}


class ReplicaUnusable(RuntimeError):
    """The live replica did not answer a restart as expected (app gone, other actor options): deploy a fresh one."""


def app_name(study_name: str, label: str) -> str:
    """Serve app (and route) of the trial that deploys it. Study names cannot contain '~', so `<study>~` marks a
    study's apps and a driver touches no other study's apps on a shared cluster."""
    return f"{study_name}~trial-{label}"


def study_apps(study_name: str, names: Any) -> list[str]:
    """This study's trial apps among Serve's application names."""
    return [n for n in names if n.startswith(f"{study_name}~trial-")]


def standby_name(study_name: str) -> str:
    return app_name(study_name, "standby")


def start_standby(study_name: str, config: ReplicaConfig) -> bool:
    """Deploy the study's standby replica (no engine) without waiting; False where replicas hold GPUs (none is
    deployed). The study's apps are deleted at the end of the search, the standby with them if nobody claimed it."""
    from ray import serve

    from serve.replica import EngineReplica, actor_options

    options = actor_options(config)
    if options.get("num_gpus"):
        return False
    target = EngineReplica.options(ray_actor_options=options).bind(  # type: ignore[attr-defined]
        config.to_replica(), standby=True)
    name = standby_name(study_name)
    serve.run_many([serve.RunTarget(target, name=name, route_prefix=f"/{name}")], wait_for_applications_running=False)
    return True


def claim_standby(study_name: str, serve_url: str, options: dict[str, Any], timeout_s: float) -> LiveApp | None:
    """The study's standby replica, claimed for this process (waiting while it deploys), or None: there is none, it
    failed, another process claimed it, or it has other `ray_actor_options` (then it is deleted: nobody can use it)."""
    from ray import serve

    name = standby_name(study_name)
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "MISSING"
        if status.endswith("RUNNING"):
            break
        if not (status.endswith("DEPLOYING") or status.endswith("NOT_STARTED")) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    try:
        response = httpx.post(f"{serve_url}/{name}/replica/claim", json=options, timeout=30)
        answer = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    if response.status_code == 409:  # other actor options: of no use to this study's trials
        teardown(name, wait=False)
        return None
    if response.status_code != 200 or not isinstance(answer, dict) or not answer.get("ok"):
        return None
    return LiveApp(name, serve_url, options)


def can_reuse(live: LiveApp | None, serve_url: str, options: dict[str, Any]) -> bool:
    """Whether the next trial may restart the engine in `live` rather than deploy a fresh app. Pure."""
    return live is not None and live.serve_url == serve_url and live.options == options


def live_app(study_name: str) -> LiveApp | None:
    return LIVE.get(study_name)


def start_engine(study_name: str, label: str, serve_url: str, config: ReplicaConfig,
                 timeout_s: float) -> tuple[LiveApp, str]:
    """This trial's engine running and healthy, in this process's live app of the study ("reused"), in the study's
    standby replica ("standby") or in a fresh app named after `label` ("new"). Raises like `deploy`: TimeoutError,
    RuntimeError with the engine's reason (ConfigRejected's marker when the engine refused the config). On a raise
    the app tried stays `live_app`, so the caller can fetch its engine log before `release`."""
    from serve.replica import actor_options

    options = actor_options(config)
    live = LIVE.get(study_name)
    how = "reused"
    if live is None:
        live = claim_standby(study_name, serve_url, options, timeout_s)
        how = "standby"
        if live is not None:
            LIVE[study_name] = live
    if live is not None and can_reuse(live, serve_url, options):
        try:
            restart(live, config, timeout_s)
            return live, how
        except ReplicaUnusable:
            release(study_name)
    elif live is not None:
        release(study_name)
    fresh = LiveApp(app_name(study_name, label), serve_url, options)
    LIVE[study_name] = fresh
    deploy(fresh.name, config, timeout_s)
    return fresh, "new"


def restart(live: LiveApp, config: ReplicaConfig, timeout_s: float) -> None:
    """Ask the live replica to replace its engine with one for `config`; see `start_engine` for the raises."""
    try:
        response = httpx.post(f"{live.url}/replica/engine", json=config.to_replica(), timeout=timeout_s)
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"engine restart in Serve app {live.name} not done after {timeout_s:.0f} s") from exc
    except httpx.HTTPError as exc:
        raise ReplicaUnusable(f"{type(exc).__name__}: {exc}") from exc
    try:
        answer = response.json() if response.status_code == 200 else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "ok" not in answer:  # Serve's 404/503, not our replica's answer
        raise ReplicaUnusable(f"Serve app {live.name} answered {response.status_code}: {response.text[:300]}")
    if not answer["ok"]:
        raise RuntimeError(f"engine restart in Serve app {live.name} failed: {answer.get('error')}")


def release(study_name: str) -> None:
    """Forget and delete this process's live app of the study. Without a GPU the delete does not wait for the replica
    to go (nothing the next engine needs is held: Serve places a fresh replica once resources are free); with one it
    waits, so the next engine never starts beside the old one's memory."""
    live = LIVE.pop(study_name, None)
    if live is not None:
        teardown(live.name, wait=bool(live.options.get("num_gpus")))


def delete_study_apps(study_name: str) -> None:
    """Delete every trial app of the study (any process's), waiting for each; forget this process's. The driver calls
    it when the search ends (the Tune workers' apps) and when the study ends (its own, from the finalist re-runs)."""
    from ray import serve

    LIVE.pop(study_name, None)
    try:
        for name in study_apps(study_name, serve.status().applications):
            teardown(name)
    except Exception:  # noqa: BLE001 - cleanup must never hide the study's own result
        pass


def app_failure(name: str) -> str:
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return "application vanished"
    parts = [app.message] + [d.message for d in app.deployments.values() if d.message]
    return "\n".join(p for p in parts if p)


def deploy(name: str, config: ReplicaConfig, timeout_s: float) -> None:
    """Start app `name` without blocking Serve forever (serve.run has no timeout); raise RuntimeError/TimeoutError."""
    from ray import serve

    from serve.replica import EngineReplica, actor_options

    # @serve.deployment made the class a Deployment (mypy sees the class)
    target = EngineReplica.options(ray_actor_options=actor_options(config)).bind(  # type: ignore[attr-defined]
        config.to_replica())
    serve.run_many([serve.RunTarget(target, name=name, route_prefix=f"/{name}")], wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "MISSING"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
            raise RuntimeError(f"Serve app {name} is {status.split('.')[-1]}: {app_failure(name)}")
        time.sleep(0.2)
    raise TimeoutError(f"Serve app {name} not RUNNING after {timeout_s:.0f} s")


def teardown(name: str, wait: bool = True) -> None:
    """Delete the app if it exists (idempotent). `wait=False` returns once the controller has the request
    (`serve.delete`'s `_blocking`, Ray 2.60, which we pin)."""
    from ray import serve

    try:
        if name in serve.status().applications:
            serve.delete(name, _blocking=wait)
    except Exception:  # noqa: BLE001 - cleanup must never hide the trial's own outcome
        pass


def cluster_cannot_host(config: ReplicaConfig) -> str | None:
    """Checked from the cluster's totals before deploying, not on a node: a replica no node can host would wait for
    resources until the deploy timeout."""
    import ray

    from serve.replica import actor_options, unplaceable

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    return unplaceable(actor_options(config), nodes)
