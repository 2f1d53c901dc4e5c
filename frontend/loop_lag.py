"""How late the event loop runs a callback that is due: the wait every request on the process shares.

Whatever holds the loop (a long prompt's KV events applied, a slow callback, a full garbage collection,
the process starved of CPU) delays every request by as much, and none of the per-request timings shows
it. A timer due every ``interval`` measures it at no cost worth counting (50 wake-ups a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL = 0.02
"""Seconds between two measurements."""

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_loop_lag(observe: Callable[[float], None], interval: float = INTERVAL) -> None:
    """Observe, every ``interval``, how much later than due the loop woke this task. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - due))
