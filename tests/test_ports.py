"""Ports handed to the servers that tests, benchmarks and the demo start."""

from __future__ import annotations

import socket

import pytest

from kvroute_common.ports import ephemeral_range, free_port, free_port_block, free_ports


def test_ports_lie_outside_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    """A DP engine's KV-event block (base, base+1) and its replay block must not share a port: the block's
    every port counts as handed out. Ports outside the ephemeral range cannot be taken meanwhile by a
    ``bind(0)`` or an outgoing connection of the engine being started."""
    low, high = ephemeral_range()
    kv, replay = free_port_block(2), free_port_block(2)
    ports = [kv, kv + 1, replay, replay + 1, free_port(), *free_ports(20)]
    assert len(set(ports)) == len(ports)
    assert not any(low <= p <= high for p in ports)
    for p in ports:  # each is bindable now
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute_common import ports

    taken = free_port()
    ports._handed_out.discard(taken)  # as if another process had chosen it
    monkeypatch.setattr(ports, "_pool", lambda: (taken, taken))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        with pytest.raises(RuntimeError, match="no block of 1 free ports"):
            free_port()
    assert free_port() == taken  # released: free again
