"""Free TCP ports for a server that another process will bind (an engine, Serve's proxy, a test's endpoint).

Binding port 0 and closing gives a port from the kernel's ephemeral range, the range every outgoing connection also
takes its local port from. Between that pick and the child's own bind (seconds: imports, Ray's start, a model load)
one of Ray's many connections can take the port, and the child dies with "address already in use" (seen: the
production endpoint, started beside another study). Ports below the ephemeral range are never given to a connection
or to another bind(0), so a random one of those that binds now stays free unless another picker draws the same one.
Ray's own workers listen on 10002-19999 by default (`ray start --min-worker-port/--max-worker-port`): the draw starts
above them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "ephemeral_range"]

LOWEST = 20000  # above Ray's default worker ports
_LINUX_DEFAULT = (32768, 60999)
_DRAWS = 64


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds on `host` now, drawn below the ephemeral range; the kernel's pick where that range starts
    too low to leave room (then the race described above is back, as with any bind(0))."""
    low, _ = ephemeral_range()
    if low - LOWEST >= 1000:
        draw = random.SystemRandom()
        for _ in range(_DRAWS):
            port = draw.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
