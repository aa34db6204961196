"""Where a trial's engine runs: one Serve app per study and trial process, reused from trial to trial.

A new Serve app costs a new replica actor (a Ray worker importing Serve and FastAPI) plus the controller's reconcile,
about 4.4 s on 2 cores, and deleting one blocks until replica and engine are gone, about 2.3 s. So each process that
runs trials (a Tune worker, which Tune reuses across trials; the driver for the finalist re-runs) keeps its study's
app alive after a trial, and the next trial only restarts the engine process inside that replica
(`POST /replica/engine`, serve/replica/deployment.py): the old engine's process group is stopped and waited for (on a GPU it holds
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

Every engine start, in a fresh app too (deployed as a standby first), goes through `POST /replica/engine`, which
answers at once; `wait_started` then follows the start's phases at `GET /replica/start` (serve/engines/phases.py).
The deadline follows the phase the replica reports: it gives up only when a phase runs past its own limit (stopping
the old engine, the engine's preflight, waiting for GPUs, `start_timeout_s` for loading, the corpus load) by
`PHASE_GRACE_S`, or when the replica stops answering, never on one total that a slow preflight or GPU wait would eat
before the load begins. The replica keeps the running engine when the next config can share its launch
(serve/replica/sharing.py); `launch_fresh` makes the next start in this process launch anyway (a finalist's re-runs each
measure a freshly started engine; its levels within one run share it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from serve.engines.base import Engine, ReplicaConfig
from serve.replica.placement import actor_options, unplaceable
from serve.replica.status import MISSING, STARTING, app_state, wait_for_app


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
FRESH: set[str] = set()  # studies whose next engine start in this process must not share a launch
PHASE_GRACE_S = 60.0  # past a phase's own limit before the trial gives up on a start
UNANSWERED_S = 60.0  # a replica that does not answer its start route this long is unusable
START_POLL_S = 10.0


def serve_api() -> Any:
    """Ray Serve, imported on first use with its client's INFO lines quieted (its import sets that logger to INFO: a
    "Deleting app"/"Connecting" line per deploy, which Ray forwards to the driver's terminal between the progress
    lines). A Tune worker that drives a standby or reused replica over HTTP never imports it (~0.6 s of its first
    trial, before the engine can start)."""
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    return serve


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
    serve = serve_api()

    # lazy: the deployment imports Ray Serve; only a deploy pays for it
    from serve.replica.deployment import EngineReplica

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
    name = standby_name(study_name)
    # Asked over HTTP first: the standby has usually been up for seconds, and a Tune worker that never needs Serve's
    # API never imports it. Serve's own 404/503 (still deploying) or silence: wait until the app settles, ask again.
    status, answer = _claim(serve_url, name, options)
    if not (isinstance(answer, dict) and "ok" in answer):
        if _app_status_when_settled(name, timeout_s) != "RUNNING":
            return None
        status, answer = _claim(serve_url, name, options)
    if status == 409:  # other actor options: of no use to this study's trials
        teardown(name, wait=False)
        return None
    if status != 200 or not isinstance(answer, dict) or not answer.get("ok"):
        return None
    return LiveApp(name, serve_url, options)


def _claim(serve_url: str, name: str, options: dict[str, Any]) -> tuple[int, Any]:
    """(HTTP status, JSON answer or None) of the standby's claim route."""
    try:
        response = httpx.post(f"{serve_url}/{name}/replica/claim", json=options, timeout=30)
    except httpx.HTTPError:
        return 0, None
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, None


def can_reuse(live: LiveApp | None, serve_url: str, options: dict[str, Any]) -> bool:
    """Whether the next trial may restart the engine in `live` rather than deploy a fresh app. Pure."""
    return live is not None and live.serve_url == serve_url and live.options == options


def live_app(study_name: str) -> LiveApp | None:
    return LIVE.get(study_name)


def launch_fresh(study_name: str) -> None:
    """The next `start_engine` of this study in this process launches a new engine even where the running one could
    be shared."""
    FRESH.add(study_name)


def start_engine(study_name: str, label: str, serve_url: str, config: ReplicaConfig,
                 timeout_s: float, engine: Engine) -> tuple[LiveApp, str]:
    """This trial's engine running and healthy, in this process's live app of the study ("reused"), in the study's
    standby replica ("standby") or in a fresh app named after `label` ("new"); `timeout_s` bounds a replica actor's
    placement (the engine's start follows its phases, `wait_started`). Raises like `deploy`: TimeoutError,
    RuntimeError with the engine's reason (ConfigRejected's marker when the engine refused the config). On a raise
    the app tried stays `live_app`, so the caller can fetch its engine log before `release`. `engine`: `config`'s,
    as the trial holds it (`TrialContext.engine`): the replica's options come from it, not from its kind again."""
    options = engine.actor_options(config)
    fresh_launch = study_name in FRESH
    FRESH.discard(study_name)
    live = LIVE.get(study_name)
    how = "reused"
    if live is None:
        live = claim_standby(study_name, serve_url, options, timeout_s)
        how = "standby"
        if live is not None:
            LIVE[study_name] = live
    if live is not None and can_reuse(live, serve_url, options):
        try:
            restart(live, config, fresh=fresh_launch)
            return live, how
        except ReplicaUnusable:
            release(study_name)
    elif live is not None:
        release(study_name)
    fresh = LiveApp(app_name(study_name, label), serve_url, options)
    LIVE[study_name] = fresh
    deploy(fresh, config, timeout_s)
    return fresh, "new"


def restart(live: LiveApp, config: ReplicaConfig, fresh: bool = False) -> dict[str, Any]:
    """Ask the live replica to start the engine for `config` (sharing the running launch unless `fresh`) and wait for
    it (`wait_started`); returns the start's final status. See `start_engine` for the raises."""
    try:
        response = httpx.post(f"{live.url}/replica/engine", params={"fresh": str(fresh).lower()},
                              json=config.to_replica(), timeout=60)
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
    return wait_started(live)


def overdue(status: dict[str, Any], grace_s: float = PHASE_GRACE_S) -> str | None:
    """Why a start still under way is given up on (its phase ran past its own limit by `grace_s`), else None. Pure."""
    phase, elapsed, limit = status.get("phase"), float(status.get("phase_elapsed_s") or 0), status.get("phase_limit_s")
    if phase is None or not isinstance(limit, (int, float)) or elapsed <= limit + grace_s:
        return None
    done = ", ".join(f"{k} {v:.0f} s" for k, v in (status.get("phases") or {}).items())
    return (f"engine start stuck in phase {phase} for {elapsed:.0f} s, past its limit of {limit:.0f} s"
            + (f" (before it: {done})" if done else ""))


def wait_started(live: LiveApp, poll_s: float = START_POLL_S) -> dict[str, Any]:
    """Follow the live replica's start until it ends: its final status when the engine is ready; RuntimeError with
    the replica's error when the start failed; TimeoutError when a phase outlives its limit (`overdue`);
    ReplicaUnusable when the replica does not answer for `UNANSWERED_S`."""
    seq, silent_since = -1, None
    while True:
        try:
            response = httpx.get(f"{live.url}/replica/start", params={"since": seq, "wait": poll_s},
                                 timeout=poll_s + 30)
            status = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            status = None
        if not isinstance(status, dict) or "seq" not in status:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > UNANSWERED_S:
                raise ReplicaUnusable(f"Serve app {live.name} stopped answering its start route for "
                                      f"{UNANSWERED_S:.0f} s")
            time.sleep(0.5)
            continue
        silent_since = None
        if status.get("done"):
            if status.get("ok"):
                return status
            raise RuntimeError(f"engine restart in Serve app {live.name} failed: {status.get('error')}")
        problem = overdue(status)
        if problem:
            raise TimeoutError(f"Serve app {live.name}: {problem}")
        seq = int(status["seq"])


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
    serve = serve_api()

    LIVE.pop(study_name, None)
    try:
        for name in study_apps(study_name, serve.status().applications):
            teardown(name)
    except Exception:  # noqa: BLE001 - cleanup must never hide the study's own result
        pass


def app_failure(name: str) -> str:
    serve_api()  # Serve's client quieted before its first call
    state = app_state(name)
    if not state.exists:
        return "application vanished"
    return "\n".join(p for p in [state.message, *(d.message for d in state.deployments)] if p)


def deploy(live: LiveApp, config: ReplicaConfig, timeout_s: float) -> None:
    """Start app `live` without blocking Serve forever (serve.run has no timeout): its replica deploys without an
    engine (up to `timeout_s` for Serve to place and start it), then starts `config`'s engine like any restart
    (`restart`, its phases followed). Raises RuntimeError/TimeoutError."""
    serve = serve_api()

    # lazy: the deployment imports Ray Serve; only a deploy pays for it
    from serve.replica.deployment import EngineReplica

    name = live.name
    # @serve.deployment made the class a Deployment (mypy sees the class); the options `live` was named with, copied:
    # Serve keeps the dict it is given, and `can_reuse` compares `live.options` with the next trial's
    target = EngineReplica.options(ray_actor_options=dict(live.options)).bind(  # type: ignore[attr-defined]
        config.to_replica(), standby=True)
    serve.run_many([serve.RunTarget(target, name=name, route_prefix=f"/{name}")], wait_for_applications_running=False)
    # just deployed: MISSING (not registered yet) and DELETING (a previous app of the name going) are still starting
    status = _app_status_when_settled(name, timeout_s, (*STARTING, MISSING, "DELETING"))
    if status is None:
        raise TimeoutError(f"Serve app {name} not RUNNING after {timeout_s:.0f} s")
    if status != "RUNNING":
        raise RuntimeError(f"Serve app {name} is {status}: {app_failure(name)}")
    try:
        restart(live, config, fresh=True)
    except ReplicaUnusable as exc:
        raise RuntimeError(f"Serve app {name} did not take its engine: {exc}") from exc


def _app_status_when_settled(name: str, timeout_s: float, starting: tuple[str, ...] = STARTING) -> str | None:
    """App `name`'s Serve status (RUNNING, DEPLOY_FAILED, UNHEALTHY, MISSING, ...) once it is not one of `starting`,
    or None when it still was after `timeout_s`."""
    serve_api()  # Serve's client quieted before its first call
    state = wait_for_app(name, timeout_s, lambda s: s.status not in starting, poll_s=0.05)
    return state.status if state is not None else None


def teardown(name: str, wait: bool = True) -> None:
    """Delete the app if it exists (idempotent). `wait=False` returns once the controller has the request
    (`serve.delete`'s `_blocking`, Ray 2.60, which we pin)."""
    serve = serve_api()

    try:
        if app_state(name).exists:
            serve.delete(name, _blocking=wait)
    except Exception:  # noqa: BLE001 - cleanup must never hide the trial's own outcome
        pass


def cluster_cannot_host(config: ReplicaConfig, engine: Engine) -> str | None:
    """Checked from the cluster's totals before deploying, not on a node: a replica no node can host would wait for
    resources until the deploy timeout. `engine`: as `start_engine`'s."""
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    return unplaceable(engine.actor_options(config), nodes)
