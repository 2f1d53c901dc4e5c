"""The router queue gate (``--router-queue-threshold``): hold requests while every rank is busy.

As the reference router and its guide do it: a request is *held* (not rejected) while every eligible
(worker, DP rank) has more in-flight prefill tokens than ``threshold x max_num_batched_tokens``;
held requests are released in policy order (:mod:`router.queue`) when capacity frees up, so each
is routed with fresh load numbers at the moment it is actually sent.

How the frontend uses it::

    admission = AdmissionQueue(config.router_queue_policy, config.router_queue_threshold, capacity_check)
    ...
    waited = await admission.wait(model, hints, new_tokens=uncached_prompt_tokens)
    choice = select(...); tracker.add(...)      # book right away: no await between wait and booking
    ...
    tracker.prefill_complete(rid); admission.notify(model)     # and the same after tracker.free(rid)

``capacity_check(model, hints, threshold) -> bool`` is the frontend's: True when at least one
eligible rank for this request is NOT busy (``frontend.routing.eligibility.queue_has_capacity``), and
also True when there is no eligible rank at all (so the request falls through to the selector's 503 instead of waiting).

Release discipline (why no slot is lost or handed out twice):

- One waiter is released at a time. Its task resumes, returns from :meth:`wait` and books
  synchronously; only then (``call_soon`` after that step) is capacity re-checked for the next one.
- A waiter cancelled while queued (client disconnect) is removed from the queue. A waiter
  cancelled after it was released passes its turn on to the next waiter.
- Besides ``notify``, a periodic re-check (``recheck_interval``) covers capacity that appears
  without a prefill/free event (a worker added, a threshold changed).
- A newcomer that finds capacity is admitted directly even if others are held (the router guide on
  strict_priority "does not prevent an eligible new arrival from being admitted directly while
  other requests are parked"; held requests get freed capacity first because every free drains
  the queue before any later arrival runs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from router.queue import PendingQueue, QueuePolicy

if TYPE_CHECKING:
    from frontend.request.hints import RequestHints

CapacityCheck = Callable[[str, "RequestHints", float], bool]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away while its request was held in the router queue (it left the queue)."""


class QueueRejected(Exception):
    """Backpressure: the request was not admitted (answered 529 + Retry-After, never routed).

    ``reason`` is the ``router_queue_backpressure_total`` label: ``request_limit`` (the queue was
    full on arrival, ``--router-queue-max``) or ``queue_timeout`` (held longer than
    ``--router-queue-timeout-secs``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


class _Waiter:
    __slots__ = ("fut", "hints", "isl", "cached")

    def __init__(self, fut: asyncio.Future, hints: RequestHints, isl: int = 0, cached: int = 0) -> None:
        self.fut = fut
        self.hints = hints
        self.isl = isl  # prompt tokens, for the pending-ISL gauge
        self.cached = cached  # best eligible worker's cached prompt tokens when queued


class AdmissionQueue:
    """Per-model held requests + the release loop. One asyncio loop; not thread-safe."""

    def __init__(
        self,
        policy: QueuePolicy | str | None,
        threshold: float | None,
        capacity_check: CapacityCheck,
        *,
        recheck_interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
    ) -> None:
        if threshold is not None and threshold < 0:
            raise ValueError("router queue threshold must be >= 0")
        if max_queued is not None and max_queued < 0:
            raise ValueError("router queue max must be >= 0")
        if queue_timeout is not None and queue_timeout <= 0:
            raise ValueError("router queue timeout must be > 0")
        self.max_queued = max_queued  # per model; None = unbounded, 0 = never hold (reject instead)
        self.queue_timeout = queue_timeout
        self.policy = QueuePolicy.parse(policy)
        self.threshold = threshold
        self._capacity_check = capacity_check
        self._recheck_interval = recheck_interval
        self._clock = clock
        self._t0 = clock()
        self._queues: dict[str, PendingQueue[_Waiter]] = {}
        self._released_pending: dict[str, int] = {}  # released waiters whose task has not resumed yet
        self._drain_scheduled: set[str] = set()
        self._tick_handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.admitted_directly = 0
        self.admitted_after_wait = 0
        self.cancelled_while_waiting = 0
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    # --- request path ----------------------------------------------------------------------------

    async def wait(
        self,
        model: str,
        hints: RequestHints,
        *,
        new_tokens: int = 0,
        receive: Receive | None = None,
        cached_tokens: Callable[[], int] | None = None,
    ) -> float:
        """Return (seconds held) once this request may be routed.

        ``new_tokens``: uncached prompt tokens on the best eligible worker (WSPT's weight).
        ``receive``: the ASGI receive callable (``request.receive``) of a request whose body was
        already read: while held, a client disconnect takes the request out of the queue and
        raises :class:`ClientDisconnected` (Starlette does not cancel a handler on disconnect).
        Cancelling the waiting task also removes it from the queue.

        Backpressure: raises :class:`QueueRejected` at once when ``max_queued`` requests of this
        model are already held, and when the request has been held ``queue_timeout`` seconds
        (it leaves the queue first; nothing was booked)."""
        threshold = self.threshold
        if threshold is None:
            return 0.0
        # A released waiter that has not booked yet makes the capacity numbers stale: queue up
        # behind it rather than both taking the same slot.
        if not self._released_pending.get(model) and self._capacity_check(model, hints, threshold):
            self.admitted_directly += 1
            return 0.0
        loop = self._loop = asyncio.get_running_loop()
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = PendingQueue(self.policy)
        if self.max_queued is not None and len(q) >= self.max_queued:
            self.rejected_full += 1
            raise QueueRejected(
                "request_limit",
                f"router queue for model {model} is full ({self.max_queued} requests held); retry later",
            )
        fut = loop.create_future()
        start = self._clock()
        entry = q.push(
            _Waiter(fut, hints, new_tokens, cached_tokens() if cached_tokens is not None else 0),
            start - self._t0,
            strict_priority=hints.queue_tier,
            priority_jump=hints.priority_jump,
            new_tokens=new_tokens,
        )
        self._ensure_tick()
        watcher: asyncio.Task | None = None
        try:
            waits: tuple[asyncio.Future, ...] = (fut,)
            if receive is not None:
                watcher = loop.create_task(_until_disconnect(receive))
                waits = (fut, watcher)
            await asyncio.wait(waits, timeout=self.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
            if fut.cancelled():  # close()
                raise asyncio.CancelledError
            if not fut.done():  # still held: the client went away, or the wait timed out
                q.remove(entry)
                fut.cancel()
                if watcher is not None and watcher.done():
                    self.cancelled_while_waiting += 1
                    raise ClientDisconnected(f"client disconnected while queued for model {model}")
                self.rejected_timeout += 1
                raise QueueRejected(
                    "queue_timeout",
                    f"request waited {self.queue_timeout:g} s in the router queue for model {model} "
                    "without capacity; retry later",
                )
        except asyncio.CancelledError:
            if q.remove(entry):
                self.cancelled_while_waiting += 1
            elif fut.done() and not fut.cancelled():  # released, then cancelled before booking: pass the turn on
                self._resumed(model)
            raise
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
        self._resumed(model)
        self.admitted_after_wait += 1
        return self._clock() - start

    def notify(self, model: str | None = None) -> None:
        """Capacity may have freed (prefill complete, request freed): release held requests.

        Cheap when nothing is held. ``model=None`` re-checks every model."""
        if model is None:
            for m, held in self._queues.items():
                if held:
                    self._schedule_drain(m)
            return
        q = self._queues.get(model)
        if q:
            self._schedule_drain(model)

    def depth(self, model: str) -> int:
        """Requests currently held for ``model`` (the /metrics queue-depth gauge)."""
        q = self._queues.get(model)
        return len(q) if q is not None else 0

    def pending_tokens(self, model: str) -> tuple[int, int]:
        """(prompt tokens, cached prompt tokens) of the requests held for ``model`` (scrape-time gauges)."""
        q = self._queues.get(model)
        if not q:
            return 0, 0
        isl = cached = 0
        for w in q.items_in_order():
            isl += w.isl
            cached += w.cached
        return isl, cached

    def depths(self) -> dict[str, int]:
        return {m: len(q) for m, q in self._queues.items()}

    def close(self) -> None:
        """Stop the periodic re-check and cancel every held request."""
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        for q in self._queues.values():
            while q:
                w = q.pop()
                if not w.fut.done():
                    w.fut.cancel()

    # --- release machinery -----------------------------------------------------------------------

    def _resumed(self, model: str) -> None:
        n = self._released_pending.get(model, 0) - 1
        self._released_pending[model] = n if n > 0 else 0
        # runs after the current task step, i.e. after the caller has booked its request
        self._schedule_drain(model)

    def _schedule_drain(self, model: str) -> None:
        if model in self._drain_scheduled:
            return
        loop = self._loop
        if loop is None:
            return
        self._drain_scheduled.add(model)
        loop.call_soon(self._drain, model)

    def _drain(self, model: str) -> None:
        self._drain_scheduled.discard(model)
        if self._released_pending.get(model, 0) > 0:
            return  # the released waiter's resume schedules the next drain
        q = self._queues.get(model)
        threshold = self.threshold
        if not q or threshold is None:
            return
        while q:
            top = q.peek()
            assert top is not None
            waiter = top.item
            if waiter.fut.done():  # cancelled future (close()); drop it
                q.pop()
                continue
            if not self._capacity_check(model, waiter.hints, threshold):
                return
            q.pop()
            waiter.fut.set_result(None)
            self._released_pending[model] = self._released_pending.get(model, 0) + 1
            return

    def _ensure_tick(self) -> None:
        if self._tick_handle is None and self._loop is not None and self._recheck_interval > 0:
            self._tick_handle = self._loop.call_later(self._recheck_interval, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        busy = False
        for m, q in self._queues.items():
            if q:
                busy = True
                self._schedule_drain(m)
        if busy:
            self._ensure_tick()
