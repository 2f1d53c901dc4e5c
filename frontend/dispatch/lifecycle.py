"""The life of one routed request, in one place: booked -> first token (prefill done) -> tokens ->
released, with migration handing the request to a new lease.

A :class:`Lease` owns the request's booking in the slot tracker and its timing; everything that
reacts to the lifecycle (Prometheus metrics, per-worker gauges, the latency model's TTFT
observations, admission wake-ups) is a :class:`LifecycleListener`, so the request path reads
top to bottom here and the listener lives with what it updates (``frontend/observability/request_metrics.py``).
Every exit path ends in ``release()``, which is idempotent.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from frontend.observability.metrics import ModelMetrics
    from frontend.routing.decision import Decision
    from frontend.routing.models import ModelEntry

log = logging.getLogger("frontend.dispatch.lifecycle")
_now = time.perf_counter

# Output tokens are told to the listener in batches (and at the end): metric updates per batch, not per
# streamed chunk, so the relay's cost per chunk stays a few attribute updates.
TOKEN_BATCH = 64


class LifecycleListener(Protocol):
    """What happens to a request, as the frontend's metrics and routers need to hear it."""

    def first_token(self, lease: Lease, ttft: float, now: float, streamed: bool) -> None:
        """The request's first output (once per request, also across migrations)."""

    def tokens(self, lease: Lease, n: int, gaps: list[float]) -> None:
        """``n`` more output tokens, and the inter-token latencies of the chunks that brought them (one
        per chunk after the first), told in batches of about ``TOKEN_BATCH`` tokens and at the end."""

    def capacity_changed(self, model: str) -> None:
        """A booking of ``model`` shrank or went away: waiting requests may fit now."""

    def cancelled(self, lease: Lease) -> None:
        """The client went away before the end of the response."""

    def released(self, lease: Lease, duration: float) -> None:
        """The request ended (``lease.status`` / ``error_type`` say how)."""


class Lease:
    """One request's booking on its (worker, rank) plus its per-request metrics."""

    __slots__ = (
        "listener",
        "entry",
        "request_id",
        "decision",
        "mm",
        "t_start",
        "t_first",
        "t_last",
        "tokens_out",
        "prefilled",
        "released",
        "status",
        "error_type",
        "hooks",
        "_osl",
        "_out_blocks",
        "ttft_recorded",
        "_freed",
        "_untold",
        "_gaps",
    )

    def __init__(
        self,
        listener: LifecycleListener,
        entry: ModelEntry,
        request_id: str,
        decision: Decision,
        mm: ModelMetrics,
        t_start: float,
    ) -> None:
        self.listener = listener
        self.entry = entry
        self.request_id = request_id
        self.decision = decision
        self.mm = mm
        self.t_start = t_start
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens_out = 0
        self.prefilled = False
        self.released = False
        self.status = "success"
        self.error_type = ""
        self.hooks: list[Any] = []  # objects with on_tokens(lease, n) / on_release(lease) (extensions)
        self._out_blocks: int | None = None  # output-block tracking off
        self._osl: int | None = None
        self.ttft_recorded = False  # the request's TTFT is in the metrics (maybe by a lease it migrated from)
        self._freed = False  # the booking was freed in the tracker
        self._untold = 0  # output tokens not yet told to the listener
        self._gaps: list[float] = []  # their chunks' inter-token latencies

    def inherit(self, old: Lease) -> None:
        """Request migration: this lease continues ``old``'s request on another worker. The
        request's metrics (TTFT, tokens so far, hooks) carry over, so they are recorded once."""
        old._tell_tokens()
        self.t_start = old.t_start
        self.t_first, self.t_last = old.t_first, old.t_last
        self.tokens_out = old.tokens_out
        self.ttft_recorded = old.ttft_recorded
        self.hooks, old.hooks = old.hooks, []

    def track_output(self, osl: int | None) -> None:
        """--router-track-output-blocks: add a placeholder block whenever isl + generated crosses a block."""
        bs = self.entry.block_size
        self._osl = osl
        self._out_blocks = -(-self.decision.isl // bs)

    def first_token(self, streamed: bool = True) -> None:
        """The worker produced output: the prompt is no longer prefill load.

        ``streamed=False`` for answers that arrive whole: their "first token" is the whole response,
        so the latency model does not learn from it."""
        if self.prefilled or self.released:
            return
        self.prefilled = True
        if self.ttft_recorded:  # a migrated request: its first token was long ago, only the booking moves on
            self._prefill_complete()
            return
        self.ttft_recorded = True
        now = _now()
        self.t_first = self.t_last = now
        self.listener.first_token(self, now - self.t_start, now, streamed)
        self._prefill_complete()

    def _prefill_complete(self) -> None:
        try:
            self.entry.tracker.prefill_complete(self.request_id)
        except Exception as exc:  # unknown request (tracker dropped it): nothing left to complete
            log.debug("prefill_complete(%s): %s", self.request_id, exc)
        self.listener.capacity_changed(self.entry.name)

    def tokens(self, n: int) -> None:
        """``n`` more output tokens arrived (streaming)."""
        if n <= 0:
            return
        now = _now()
        if self.tokens_out and self.t_last is not None:
            self._gaps.append((now - self.t_last) / n)
        self.t_last = now
        self.tokens_out += n
        self._untold += n
        if self._untold >= TOKEN_BATCH:
            self._tell_tokens()
        if self._out_blocks is not None:
            blocks = -(-(self.decision.isl + self.tokens_out) // self.entry.block_size)
            if blocks > self._out_blocks:
                tracker = self.entry.tracker
                try:
                    for _ in range(blocks - self._out_blocks):
                        tracker.add_output_block(self.request_id, self._osl, self.tokens_out)
                except Exception as exc:
                    log.debug("add_output_block(%s): %s", self.request_id, exc)
                self._out_blocks = blocks
        for h in self.hooks:
            h.on_tokens(self, n)

    def _tell_tokens(self) -> None:
        n, gaps = self._untold, self._gaps
        if n:
            self._untold, self._gaps = 0, []
            self.listener.tokens(self, n, gaps)

    def free_booking(self, notify: bool = True) -> None:
        """Free the (worker, rank) booking only (idempotent); the request itself goes on (migration)."""
        if self._freed:
            return
        self._freed = True
        try:
            self.entry.tracker.free(self.request_id)
        except Exception as exc:
            log.debug("free(%s): %s", self.request_id, exc)
        if notify:
            self.listener.capacity_changed(self.entry.name)

    def client_gone(self) -> None:
        """The client went away before the end of the response: the request ends as cancelled
        (counted once; the caller still releases the lease)."""
        if self.released:
            return
        self.status, self.error_type = "error", "cancelled"
        self.listener.cancelled(self)

    def fail(self, status: int, error_type: str) -> None:
        self.status = "error"
        self.error_type = error_type

    def release(self, final: bool = True) -> None:
        """Free the booking and record the request's end. Safe to call any number of times.

        ``final=False`` only frees the booking (the request is being re-routed elsewhere)."""
        if self.released:
            return
        self.released = True
        self._tell_tokens()
        if not final:
            self.free_booking()
            return
        self.free_booking(notify=False)
        for h in self.hooks:
            try:
                h.on_release(self)
            except Exception:
                log.exception("release hook failed")
        self.listener.released(self, _now() - self.t_start)
        self.listener.capacity_changed(self.entry.name)
