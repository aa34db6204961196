"""A Serve application's status read and waited for in one place (`serve.replica.status`), on Ray Serve's own status
objects: what a state says, and when a wait settles, gives up or asks again."""

import pytest
from ray.serve._private.common import DeploymentStatusTrigger
from ray.serve.schema import (ApplicationStatus, ApplicationStatusOverview, DeploymentStatus,
                              DeploymentStatusOverview, ServeStatus)

from serve.replica.status import MISSING, STARTING, AppState, state_of, wait_for_app


def serve_status(status: ApplicationStatus, message: str = "", **deployments: tuple[DeploymentStatus, str]):
    overview = {name: DeploymentStatusOverview(status=s, status_trigger=DeploymentStatusTrigger.UNSPECIFIED,
                                               replica_states={}, message=m) for name, (s, m) in deployments.items()}
    app = ApplicationStatusOverview(status=status, message=message, last_deployed_time_s=0.0, deployments=overview)
    return ServeStatus(applications={"app": app})


def test_a_state_names_the_status_and_the_deployments_own_messages_first():
    state = state_of(serve_status(ApplicationStatus.DEPLOY_FAILED, "app failed",
                                  Engine=(DeploymentStatus.DEPLOY_FAILED, "constructor raised"),
                                  Ingress=(DeploymentStatus.HEALTHY, "")), "app")
    assert state.status == "DEPLOY_FAILED" and state.exists
    assert state.failure() == "Engine: constructor raised"
    assert not state.healthy(["Engine", "Ingress"]) and state.healthy(["Ingress"])
    assert state_of(serve_status(ApplicationStatus.RUNNING), "other") == AppState(MISSING)
    assert not AppState(MISSING).exists and AppState("RUNNING", "generic").failure() == "generic"


def scripted(*states: AppState | Exception):
    reads: list[str] = []

    def read(name: str) -> AppState:
        reads.append(name)
        item = states[min(len(reads), len(states)) - 1]
        if isinstance(item, Exception):
            raise item
        return item

    return read, reads


def test_a_wait_returns_the_first_state_that_settles_it():
    read, reads = scripted(AppState(MISSING), AppState("DEPLOYING"), AppState("RUNNING"), AppState("UNHEALTHY"))
    state = wait_for_app("app", 3600, lambda s: s.status not in (*STARTING, MISSING), poll_s=0, read=read)
    assert state == AppState("RUNNING") and reads == ["app"] * 3


def test_a_wait_gives_up_at_its_deadline_or_when_told_to_stop():
    read, reads = scripted(AppState("DEPLOYING"))
    assert wait_for_app("app", 0, lambda s: s.status == "RUNNING", poll_s=0, read=read) is None
    assert reads == ["app"]  # asked once: a zero deadline still reads the status it judges
    read, reads = scripted(AppState("RUNNING"))
    assert wait_for_app("app", 3600, lambda s: True, keep_waiting=lambda: False, read=read) is None
    assert reads == []


def test_a_controller_that_cannot_answer_is_asked_again_only_when_told_to():
    read, reads = scripted(RuntimeError("controller restarting"), AppState("RUNNING"))
    assert wait_for_app("app", 3600, lambda s: s.status == "RUNNING", poll_s=0, retry_errors=True,
                        read=read) == AppState("RUNNING")
    assert len(reads) == 2
    read, _ = scripted(RuntimeError("controller restarting"))
    with pytest.raises(RuntimeError, match="controller restarting"):
        wait_for_app("app", 3600, lambda s: True, poll_s=0, read=read)


def test_no_other_module_reads_an_applications_status():
    """`serve.status().applications.get(name)` outside serve/replica/status.py is a second status poller (listing
    the applications' names is not)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("serve", "pipeline"):
        for path in (root / package).rglob("*.py"):
            if path == root / "serve" / "replica" / "status.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr == "get" and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "applications"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []
