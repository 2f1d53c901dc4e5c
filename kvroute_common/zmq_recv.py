"""Draining a non-blocking ZMQ socket from asyncio, shared by the indexer's KV-event listener and
replica sync.

A plain ``zmq.Socket`` read through its file descriptor costs far less per message than
``zmq.asyncio``. ZMQ's descriptor is edge-triggered: after the reader fires, every queued message
must be read, and ``EVENTS`` re-checked after re-arming, or a message can sit unread until the
next one arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

import zmq

# messages read before the event loop gets a turn (HTTP requests wait meanwhile)
BATCH = 512


async def drain_forever(
    sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], Awaitable[None] | None], batch: int = BATCH
) -> None:
    """Read every message of ``sock`` as it arrives and pass its frames to ``handle``.

    ``handle`` returns None when it is done, or an awaitable for the rare message that needs one
    (the common case costs no coroutine). Runs until cancelled."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    fd = sock.fileno()
    loop.add_reader(fd, wake.set)
    try:
        while True:
            n = 0
            while n < batch:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                pending = handle(frames)
                if pending is not None:
                    await pending
            if n == batch:
                await asyncio.sleep(0)
                continue
            wake.clear()
            if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                continue
            await wake.wait()
    finally:
        loop.remove_reader(fd)
