"""Issue #63 item 5: a dead Ray cluster, tracking server or database, and a missing database driver, are each one
line naming the URL and the fix, within a deadline, before anything is written."""

from __future__ import annotations

import socket

import pytest

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.study.services import (
    check_database, check_ray, check_services, check_tracking_server, postgres_driver_hint, ray_endpoint, within,
)


@pytest.fixture()
def closed_port() -> int:
    """A local port nothing listens on: bound, then closed (the OS does not hand it out again at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_line(exc: pytest.ExceptionInfo[PipelineError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_ray_endpoints():
    assert ray_endpoint("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert ray_endpoint("ray://head") == ("head", 10001)
    assert ray_endpoint("ray://head:10002") == ("head", 10002)
    assert ray_endpoint("head") == ("head", 6379)
    assert ray_endpoint("auto") is None and ray_endpoint("local") is None
    for bad in ("http://head:8265", "head:port", "head:0", ":6379", ""):
        with pytest.raises(ValueError):
            ray_endpoint(bad)


def test_a_dead_ray_address_is_one_line_with_the_fix(closed_port):
    with pytest.raises(PipelineError) as caught:
        check_ray(f"127.0.0.1:{closed_port}", 5)
    line = one_line(caught)
    assert line.startswith("ray.address (--ray-address)") and f"127.0.0.1:{closed_port}" in line
    assert "ray start --head" in line
    with pytest.raises(PipelineError, match="is not host:port"):
        check_ray("http://head:8265", 5)
    check_ray(None)
    check_ray("local")


def test_a_live_tcp_listener_passes_the_ray_check():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray(f"127.0.0.1:{server.getsockname()[1]}", 5)


def test_a_dead_tracking_server_is_one_line_with_the_fix(closed_port):
    with pytest.raises(PipelineError) as caught:
        check_tracking_server(f"http://user:pw@127.0.0.1:{closed_port}", 5)
    line = one_line(caught)
    assert line.startswith("tracking.uri (--tracking-uri)") and f"http://user:***@127.0.0.1:{closed_port}" in line
    assert "pw" not in line.replace("pw@", "") and "mlflow server" in line


def test_the_missing_psycopg_driver_names_the_installed_one(closed_port):
    with pytest.raises(PipelineError) as caught:
        check_database(f"postgresql://u:secret@127.0.0.1:{closed_port}/db", "storage.url (--storage)", 5)
    line = one_line(caught)
    assert "'psycopg'" in line and "postgresql+psycopg2://" in line and "secret" not in line
    assert "psycopg2 is" in postgres_driver_hint("postgresql", lambda m: m == "psycopg2")
    assert "psycopg2 is" not in postgres_driver_hint("postgresql", lambda m: False)


def test_a_dead_database_is_one_line_with_the_fix(closed_port):
    url = f"postgresql+psycopg2://u:secret@127.0.0.1:{closed_port}/db"
    with pytest.raises(PipelineError) as caught:
        check_database(url, "storage.url (--storage)", 5)
    line = one_line(caught)
    assert line.startswith("storage.url (--storage): cannot connect to") and "u:***@" in line
    assert "secret" not in line and "start the database" in line
    with pytest.raises(PipelineError, match="no dialect 'postgres'"):
        check_database("postgres://u@127.0.0.1/db", "storage.url", 5)
    check_database(f"sqlite:///{url}.db", "storage.url", 5)  # SQLite is the preflight's (a path, not a service)


def test_check_services_covers_every_url_of_the_study(closed_port):
    dead = f"127.0.0.1:{closed_port}"
    for overrides, start in (({"ray.address": dead}, "ray.address"),
                             ({"tracking.uri": f"http://{dead}"}, "tracking.uri"),
                             ({"tracking.uri": f"postgresql+psycopg2://{dead}/m"}, "tracking.uri"),
                             ({"storage.url": f"postgresql+psycopg2://{dead}/o"}, "storage.url")):
        with pytest.raises(PipelineError, match=f"^{start}"):
            check_services(load_study(None, overrides), 5)
    check_services(load_study(None, {}))  # the defaults are local: nothing to reach


def test_a_call_that_outlives_its_deadline_is_abandoned():
    import threading

    gate = threading.Event()
    finished, error = within(0.05, lambda: gate.wait(30))  # a driver that ignores its own timeout
    gate.set()
    assert (finished, error) == (False, None)
    assert within(5, lambda: 1 / 0)[1].__class__ is ZeroDivisionError


def test_a_check_that_hangs_is_cut_at_its_deadline():
    import threading

    from pipeline.study.services import bounded

    gate = threading.Event()

    def lookup_that_hangs() -> None:
        gate.wait(30)

    with pytest.raises(PipelineError) as caught:
        bounded("ray.address (--ray-address)", "'head:6379'", 0.05, lookup_that_hangs)
    gate.set()
    assert one_line(caught).startswith("ray.address (--ray-address): no answer from 'head:6379' within 0.05 s")
