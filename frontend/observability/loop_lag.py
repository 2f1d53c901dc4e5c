"""How late the event loop runs a callback that is due: the wait every request on the process shares.

Whatever holds the loop (a long prompt's KV events applied, a slow callback, a full garbage collection,
the process starved of CPU) delays every request by as much, and none of the per-request timings shows
it. A timer due every ``interval`` measures it while requests are in flight; with none, every
``IDLE_INTERVAL``: each wake-up of the loop costs ~0.1 ms of CPU on a virtual machine (timer, epoll,
scheduler; ``python -m bench wakeup_cost``), so 50 a second on an idle frontend were 5-7 ms of CPU per
second, which the peer benchmark charged to its requests (issue 28). A lag matters only to requests
that wait behind it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("frontend.observability.loop_lag")

INTERVAL = 0.02
"""Seconds between two measurements while requests are in flight."""
IDLE_INTERVAL = 1.0
"""Seconds between two measurements while none is (a request arriving meanwhile waits at most this long
for the fast cadence; its own wait is still measured by the timer due then)."""

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_loop_lag(
    observe: Callable[[float], None],
    interval: float = INTERVAL,
    busy: Callable[[], bool] | None = None,
    idle_interval: float = IDLE_INTERVAL,
) -> None:
    """Observe how much later than due the loop woke this task: every ``interval`` while ``busy()`` (always
    without ``busy``), every ``idle_interval`` otherwise. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        wait = interval if busy is None or busy() else idle_interval
        due = loop.time() + wait
        await asyncio.sleep(wait)
        observe(max(0.0, loop.time() - due))


class StallLogger:
    """Logs where the event loop's thread was when a callback due on the loop waited ``threshold``
    seconds (``--log-loop-stalls MS``): what held every request on the process, named.

    A thread posts a no-op to the loop every ``interval``; when it has not run within ``threshold``,
    the loop thread's stack is taken then and logged, with the whole stall's length, once the loop
    runs it. Python frames only: a C call that holds the GIL also holds this thread, so its stack is
    taken when that call returns. Create it on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: float, interval: float = 0.01) -> None:
        if threshold <= 0:
            raise ValueError("the stall threshold must be > 0")
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.threshold = threshold
        self.interval = interval
        self.stalls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-stall-logger", daemon=True)

    def start(self) -> StallLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            ran = threading.Event()
            posted = time.perf_counter()
            try:
                self._loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop is closed
                return
            if not ran.wait(self.threshold):
                frame = sys._current_frames().get(self._loop_thread)
                where = "".join(traceback.format_stack(frame, limit=20)) if frame is not None else "(no frame)\n"
                while not ran.wait(0.5):
                    if self._stop.is_set():
                        return
                self.stalls += 1
                log.warning(
                    "event loop held for %.1f ms; %.1f ms in, its thread was at:\n%s",
                    (time.perf_counter() - posted) * 1e3,
                    self.threshold * 1e3,
                    where.rstrip(),
                )
            self._stop.wait(self.interval)
