"""Free loopback ports for the processes the demo, benchmarks and tests start.

Ports are drawn at random from below the kernel's ephemeral range: a port handed out by ``bind(0)``
or taken by an outgoing connection always lies inside that range, so a port chosen below it stays
free while the server it is meant for starts, even when that takes minutes (a vLLM engine binds its
KV-event sockets only after loading the model, while the engine's own processes open ephemeral ports).
Someone else can still bind such a port explicitly: callers that start servers on these ports retry
on a bind conflict (see ``local_cluster``).
"""

from __future__ import annotations

import random
import socket

LOWEST = 20000  # below: ports that well-known services are configured on
_DEFAULT_EPHEMERAL = (32768, 60999)

# Ports this process has handed out (every port of a block included): a test that asks twice (an
# HTTP port, then a replay port block) must never get a port it already has.
_handed_out: set[int] = set()
_random = random.SystemRandom()  # independent of tests that seed ``random``


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _pool() -> tuple[int, int]:
    """Where ports are drawn from: below the ephemeral range, or above it when too little lies below."""
    low, high = ephemeral_range()
    if low - LOWEST >= 4096:
        return LOWEST, low - 1
    if 65535 - high >= 4096:
        return high + 1, 65535
    return 1024, 65535  # the whole range is ephemeral: bind conflicts stay possible


def _bindable(port: int) -> bool:
    """Nobody listens on ``port`` (on any address) and no connection holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, attempts: int = 500) -> int:
    """A base port such that base .. base+n-1 are all free (for per-DP-rank port offsets)."""
    low, high = _pool()
    for _ in range(attempts):
        base = _random.randint(low, high - n + 1)
        block = range(base, base + n)
        if any(p in _handed_out for p in block) or not all(_bindable(p) for p in block):
            continue
        _handed_out.update(block)
        return base
    raise RuntimeError(f"no block of {n} free ports found in {low}-{high}")


def free_port() -> int:
    """A TCP port that was free a moment ago and not handed out before by this process."""
    return free_port_block(1)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
