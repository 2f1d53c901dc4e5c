"""Draining a non-blocking ZMQ socket from asyncio: replica sync, and the KV-event listener of an
endpoint the loop cannot read itself (inproc://; tcp:// and ipc:// go through ``kvroute_common.zmtp_sub``).

A plain ``zmq.Socket`` read through its file descriptor costs far less per message than
``zmq.asyncio``. ZMQ's descriptor is edge-triggered: after the reader fires, every queued message
must be read, checking ``EVENTS`` before each read, or a message can sit unread until the next one
arrives. The reading runs in the loop's reader callback itself: a worker publishing a batch at a
time wakes the loop once per batch, and with hundreds of workers per process that wake-up (a task
switch and an exception per empty read, before) was most of what a batch cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import cast

import zmq

from kvroute_common.loop_turns import BATCH, TURN_SECONDS, next_turn

_POLLIN = int(zmq.POLLIN)  # an int: ``int & PollEvent`` builds a PollEvent, half a microsecond a check
_EVENTS = zmq.EVENTS
_NOBLOCK = zmq.NOBLOCK


async def drain_forever(
    sock: zmq.Socket[bytes],
    handle: Callable[[list[bytes]], Awaitable[None] | None],
    batch: int = BATCH,
    on_burst: Callable[[int], None] | None = None,
    turn_seconds: float = TURN_SECONDS,
) -> None:
    """Read every message of ``sock`` as it arrives and pass its frames to ``handle``, in order.

    ``handle`` returns None when it is done, or an awaitable for the rare message that needs one;
    reading stops until that awaitable is done. After ``batch`` messages or ``turn_seconds`` of
    handling, the loop's other callbacks run before reading goes on (``kvroute_common.loop_turns``).
    ``on_burst`` gets the number of messages each wake-up found queued (1 when the reader keeps up). Runs
    until cancelled; an exception from ``handle`` ends it."""
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    get, recv = sock.get, sock.recv_multipart
    clock = time.perf_counter
    waiting: list[Awaitable[None]] = []  # what the reader callback left to this task
    failed: list[BaseException] = []
    paused = [False]  # set while an awaitable runs or after a failure or cancellation: no reading
    resting = [False]  # set until the next turn: the FD firing meanwhile does not start it early
    wake = asyncio.Event()

    def resume() -> None:
        resting[0] = False
        drain()

    def drain() -> None:
        if paused[0] or resting[0]:
            return  # a drain scheduled before the pause, or the FD firing before the next turn
        n = 0
        start = clock()
        until = start + turn_seconds
        try:
            while cast(int, get(_EVENTS)) & _POLLIN:
                pending = handle(recv(_NOBLOCK))
                n += 1
                if pending is not None:
                    loop.remove_reader(fd)  # the rest waits in the socket, in order
                    paused[0] = True
                    waiting.append(pending)
                    wake.set()
                    break
                now = clock()
                if n == batch or now > until:
                    resting[0] = True
                    next_turn(loop, resume, now - start, turn_seconds)
                    break
        except Exception as exc:
            loop.remove_reader(fd)
            paused[0] = True
            failed.append(exc)
            wake.set()
        if on_burst is not None and n:
            on_burst(n)

    loop.add_reader(fd, drain)
    try:
        drain()  # messages queued before the reader was added do not make the FD fire
        while True:
            await wake.wait()
            wake.clear()
            if failed:
                raise failed[0]
            while waiting:
                await waiting.pop(0)
            paused[0] = False
            loop.add_reader(fd, drain)
            drain()
    finally:
        paused[0] = True
        loop.remove_reader(fd)
