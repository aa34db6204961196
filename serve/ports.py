"""Free TCP ports for a server that another process will bind (an engine, Serve's proxy, a test's endpoint), and for
the NCCL rendezvous of an SGLang engine.

Binding port 0 and closing gives a port from the kernel's ephemeral range, the range every outgoing connection also
takes its local port from. Between that pick and the child's own bind (seconds: imports, Ray's start, a model load)
one of Ray's many connections can take the port, and the child dies with "address already in use" (seen: the
production endpoint, started beside another study). Ports below the ephemeral range are never given to a connection
or to another bind(0), so a random one of those that binds now stays free unless another picker draws the same one.

Below the ephemeral range, three pickers draw, so each gets its own range:
- Ray's own workers listen on 10002-19999 by default (`ray start --min-worker-port/--max-worker-port`);
- SGLang 0.5.23 draws its NCCL port from 22000-29999 when none is given (`utils/network.py`
  `get_free_port_below_ephemeral`, called by `PortArgs.init_new`), and an SGLang engine binds its HTTP port only
  after the model has loaded (minutes for a big model): a port of ours drawn there could be taken meanwhile by a
  parallel trial's NCCL draw. So servers draw from 30000 up to the ephemeral range, and SGLang is given an NCCL
  port (`--nccl-port`) from 20000-21999, where neither it nor Ray draws.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Literal

__all__ = ["free_port", "ephemeral_range", "RANGES", "SGLANG_OWN_NCCL_RANGE"]

Purpose = Literal["server", "nccl"]
SGLANG_OWN_NCCL_RANGE = (22000, 29999)  # SGLang's own draw; never ours
RANGES: dict[str, tuple[int, int]] = {"nccl": (20000, 21999), "server": (30000, 65535)}  # inclusive; capped below
_LINUX_DEFAULT = (32768, 60999)
_DRAWS = 64
_MIN_SPAN = 1000  # fewer free candidates than this and a random draw collides too often: the kernel picks


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for ports it assigns on its own (Linux's file; its default where that cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return _LINUX_DEFAULT
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def draw_range(purpose: Purpose, ephemeral_low: int) -> tuple[int, int] | None:
    """The inclusive range `purpose` draws from below the ephemeral range; None when too little of it is left. Pure."""
    low, high = RANGES[purpose]
    high = min(high, ephemeral_low - 1)
    return (low, high) if high - low + 1 >= _MIN_SPAN else None


def free_port(host: str = "127.0.0.1", purpose: Purpose = "server") -> int:
    """A port that binds on `host` now, drawn from `purpose`'s range below the ephemeral range (module docstring);
    the kernel's pick where that range is too small (then the race described above is back, as with any bind(0))."""
    span = draw_range(purpose, ephemeral_range()[0])
    if span is not None:
        draw = random.SystemRandom()
        for _ in range(_DRAWS):
            port = draw.randint(*span)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
