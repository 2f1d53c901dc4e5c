"""How a burst of KV-event batches shares the event loop with the requests it serves.

An engine publishes one batch per step; a long prompt's prefill steps each store hundreds of blocks
(~1-2 ms to apply here), and they arrive together. Applied in one callback they held the loop for tens of
milliseconds, so handling runs in turns: after ``BATCH`` messages or ``TURN_SECONDS`` of handling, the
loop's other callbacks run first.

A turn that ran out of time is also followed by a pause as long as the turn took (``PAUSE_RATIO``): a
request needs several turns of the loop (read, send upstream, read the answer, reply), and with the next
batch due at every one of them it waited behind a batch at each, ~2 ms a step; with the pause a burst takes
at most half the loop while it lasts. A tiny request beside 128k-token prompts at 2/s: p99 19.6-22.0 ms
without the pause, 12.9-13.1 ms with it (docs/benchmarks.md, "Long agentic contexts"). The burst is applied
later by as much (a 128k-token prompt's ~23 ms of events over ~46 ms); what the router predicted for its own
requests covers them meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BATCH = 512
"""Messages handled before the loop's other callbacks run (many small batches)."""
TURN_SECONDS = 0.002
"""Seconds of handling before the loop's other callbacks run."""
PAUSE_RATIO = 1.0
"""After a turn that ran out of time, the next starts this many times the turn's length later."""


def next_turn(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], object], spent: float, turn_seconds: float = TURN_SECONDS
) -> None:
    """Schedule the next turn of handling, whose last took ``spent`` seconds: after a pause if it ran out of
    time (over ``turn_seconds``), else at once (after the callbacks the loop has ready)."""
    if spent > turn_seconds:
        loop.call_later(spent * PAUSE_RATIO, callback)
    else:
        loop.call_soon(callback)
