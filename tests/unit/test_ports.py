"""serve.ports: ports drawn below the kernel's ephemeral range, so no outgoing connection takes one before the
child process binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from serve import ports


def test_a_drawn_port_lies_below_the_ephemeral_range_and_binds():
    low, _ = ports.ephemeral_range()
    drawn = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= port < low for port in drawn), (drawn, low)
    for port in drawn:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if the port was not free


def test_the_range_is_read_from_the_kernel_file_or_defaults(tmp_path: Path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    path.write_text("garbage")
    assert ports.ephemeral_range(path) == (32768, 60999)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_a_range_that_leaves_no_room_below_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 65535))
    port = ports.free_port()
    assert port >= ports.LOWEST + 10 or port < ports.LOWEST  # the kernel's own pick, not a draw from 20000-20010
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
