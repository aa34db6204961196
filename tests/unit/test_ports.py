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
    assert all(ports.RANGES["server"][0] <= port < low for port in drawn), (drawn, low)
    for port in drawn:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if the port was not free


def test_no_port_of_ours_lies_where_sglang_draws_its_own_nccl_port():
    # Issue 40 item 8: SGLang 0.5.23 draws an unset NCCL port from 22000-29999 and binds its HTTP port only after
    # the model loads; a server port of ours drawn there could be taken by a parallel trial's NCCL draw meanwhile.
    own_low, own_high = ports.SGLANG_OWN_NCCL_RANGE
    for ephemeral_low in (32768, 61000):
        spans = [ports.draw_range(p, ephemeral_low) for p in ("server", "nccl")]
        assert all(span is not None for span in spans)
        (s_low, s_high), (n_low, n_high) = spans  # type: ignore[misc]
        assert s_high < ephemeral_low and n_high < ephemeral_low
        assert s_low > own_high and n_high < own_low  # both outside SGLang's own draw
        assert n_high < s_low  # and apart from each other
    nccl = {ports.free_port(purpose="nccl") for _ in range(20)}
    assert all(ports.RANGES["nccl"][0] <= p <= ports.RANGES["nccl"][1] for p in nccl), nccl


def test_an_sglang_engine_is_given_its_nccl_port_from_our_range(monkeypatch: pytest.MonkeyPatch):
    from serve.engines.sglang import engine as sglang
    from serve.engines.base import ReplicaConfig

    monkeypatch.setattr(sglang, "server_arg_fields", lambda path=None, python=None: None)
    argv = sglang.SglangEngine().argv(ReplicaConfig(engine="sglang", model="/m", device="cuda"), "127.0.0.1", 31000)
    nccl = int(argv[argv.index("--nccl-port") + 1])
    assert ports.RANGES["nccl"][0] <= nccl <= ports.RANGES["nccl"][1]
    # The exported command (deploy/engine_command.sh) leaves the port to SGLang: a port drawn here means nothing there.
    exported = sglang.SglangEngine().command_argv(ReplicaConfig(engine="sglang", model="/m", device="cuda"), "h", 1)
    assert "--nccl-port" not in exported


def test_the_range_is_read_from_the_kernel_file_or_defaults(tmp_path: Path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    path.write_text("garbage")
    assert ports.ephemeral_range(path) == (32768, 60999)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_a_range_that_leaves_no_room_below_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch):
    low = ports.RANGES["server"][0]
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (low + 10, 65535))
    port = ports.free_port()
    assert port >= low + 10 or port < low  # the kernel's own pick, not a draw from 30000-30010
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
