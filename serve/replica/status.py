"""A Serve application's status as the controller reports it, read and waited for in one place: the trial's replicas
(`pipeline.trial.replicas`), production's deploy and roll (`serve.production.app`, `serve.production.roll`) and the
canary's candidate (`serve.closed_loop.candidate_arm`). Ray is imported only when a status is read, so importing this
module stays light. `state_of` (pure) turns Serve's `ServeStatus` into an `AppState`; `wait_for_app` polls until a
state settles the wait, under a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MISSING", "STARTING", "AppState", "DeploymentState", "app_state", "state_of", "wait_for_app"]

MISSING = "MISSING"  # no application of that name: not registered yet, or deleted
STARTING = ("DEPLOYING", "NOT_STARTED")  # an application on its way to RUNNING (or to DEPLOY_FAILED)


def _word(status: Any) -> str:
    """`ApplicationStatus.RUNNING` (or its value) -> `RUNNING`."""
    return str(getattr(status, "value", status)).split(".")[-1]


@dataclass(frozen=True)
class DeploymentState:
    name: str
    status: str  # HEALTHY, UPDATING, UNHEALTHY, DEPLOY_FAILED, UPSCALING, DOWNSCALING
    message: str = ""


@dataclass(frozen=True)
class AppState:
    """One application's status: RUNNING, DEPLOYING, DEPLOY_FAILED, UNHEALTHY, DELETING, NOT_STARTED, or MISSING."""

    status: str
    message: str = ""
    deployments: tuple[DeploymentState, ...] = ()

    @property
    def exists(self) -> bool:
        return self.status != MISSING

    def healthy(self, names: tuple[str, ...] | list[str]) -> bool:
        """Whether every deployment in `names` is there and HEALTHY."""
        found = {d.name: d.status for d in self.deployments}
        return all(found.get(name) == "HEALTHY" for name in names)

    def failure(self) -> str:
        """Why it failed: the deployments' own messages (a constructor's exception text) before the app's generic
        one."""
        messages = [f"{d.name}: {d.message}" for d in self.deployments if d.message]
        return "\n".join(messages) or self.message


def state_of(serve_status: Any, name: str) -> AppState:
    """App `name` in a `ray.serve.status()` answer. Pure."""
    app = (getattr(serve_status, "applications", None) or {}).get(name)
    if app is None:
        return AppState(MISSING)
    deployments = tuple(DeploymentState(d_name, _word(d.status), str(getattr(d, "message", "") or ""))
                        for d_name, d in (getattr(app, "deployments", None) or {}).items())
    return AppState(_word(app.status), str(getattr(app, "message", "") or ""), deployments)


def app_state(name: str) -> AppState:
    """App `name`'s status now, from the Serve controller of the Ray this process is connected to."""
    from ray import serve  # lazy: Ray Serve only where a status is read

    return state_of(serve.status(), name)


def wait_for_app(name: str, timeout_s: float, settled: Callable[[AppState], bool], *, poll_s: float = 0.5,
                 keep_waiting: Callable[[], bool] = lambda: True, retry_errors: bool = False,
                 read: Callable[[str], AppState] = app_state) -> AppState | None:
    """Ask for app `name`'s status every `poll_s` until `settled(state)`: that state. None once `timeout_s` has
    passed, or `keep_waiting()` turned False, without a settling state. `retry_errors`: a controller that cannot
    answer (busy, restarting) is asked again instead of raising."""
    deadline = time.monotonic() + timeout_s
    while keep_waiting():
        try:
            state: AppState | None = read(name)
        except Exception:  # noqa: BLE001 - only with retry_errors: the controller busy or restarting
            if not retry_errors:
                raise
            state = None
        if state is not None and settled(state):
            return state
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)  # the controller's status, polled under the deadline above
    return None
