"""Free loopback ports for the processes the demo, benchmarks and tests start.

A port found free can be taken by someone else before it is bound: callers that start servers on
these ports retry on a bind conflict (see ``local_cluster``).
"""

from __future__ import annotations

import socket

# Ports this process has handed out: the kernel may hand the same ephemeral port to two separate
# ``bind(0)`` calls once the first socket is closed, and a test that asks twice (an HTTP port, then a
# replay port) must not get one port for both.
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and not handed out before by this process."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port that was not handed out before")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        if _handed_out.intersection(ports):  # rare: retry for ports not handed out before
            return [free_port() for _ in range(n)]
        _handed_out.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port_block(n: int, attempts: int = 50) -> int:
    """A base port such that base .. base+n-1 are all free (for per-DP-rank port offsets)."""
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found")
