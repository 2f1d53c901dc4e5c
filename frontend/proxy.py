"""Dispatch to a worker and pass its response through, owning the request's load booking.

A :class:`Lease` is the booking of one routed request in the embedded slot tracker. Every exit
path ends in ``Lease.release()`` (idempotent): normal end of stream, worker error, client
disconnect, cancellation. The first body bytes from the worker mark prefill complete.

Streaming responses are a small ASGI callable (:class:`StreamProxy`) rather than Starlette's
``StreamingResponse``: it forwards each chunk the moment the worker sends it (no buffering), and it
watches the client's ``http.disconnect`` concurrently so a client that goes away while the worker
is still thinking frees its load at once and aborts the worker's request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import TYPE_CHECKING, Any

from .errors import openai_error_body
from .upstream import UpstreamError, UpstreamResponse, UpstreamTimeout

if TYPE_CHECKING:
    from .state import FrontendState
    from .models import ModelEntry
    from .routing import Decision

log = logging.getLogger("frontend.proxy")
_now = time.perf_counter

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_DONE = b"data: [DONE]"


class Lease:
    """One request's booking on its (worker, rank) plus its per-request metrics."""

    __slots__ = ("state", "entry", "request_id", "decision", "mm", "t_start", "t_first", "t_last", "tokens_out",
                 "prefilled", "released", "status", "error_type", "hooks", "_osl", "_out_blocks", "ttft_recorded", "_freed")

    def __init__(self, state: "FrontendState", entry: "ModelEntry", request_id: str, decision: "Decision", mm: Any, t_start: float) -> None:
        self.state = state
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

    def inherit(self, old: "Lease") -> None:
        """Request migration: this lease continues ``old``'s request on another worker. The
        request's metrics (TTFT, tokens so far, hooks) carry over, so they are recorded once."""
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
        if streamed:
            self.state.router.observe_first_token(self.entry, self.decision, now)
        self.t_first = self.t_last = now
        ttft = now - self.t_start
        mm = self.mm
        mm.ttft.observe(ttft)
        mm.queued.dec()
        self.state.metrics.router_ttft.observe(ttft)
        g = self.state.worker_gauges(self.decision.worker.id, self.decision.dp_rank)
        g[0].set(ttft)
        self._prefill_complete()

    def _prefill_complete(self) -> None:
        try:
            self.entry.tracker.prefill_complete(self.request_id)
        except Exception as exc:  # unknown request (tracker dropped it): nothing left to complete
            log.debug("prefill_complete(%s): %s", self.request_id, exc)
        self.state.capacity_changed(self.entry.name)

    def tokens(self, n: int) -> None:
        """``n`` more output tokens arrived (streaming)."""
        if n <= 0:
            return
        now = _now()
        if self.tokens_out and self.t_last is not None:
            gap = (now - self.t_last) / n
            self.mm.itl.observe(gap)
            self.state.metrics.router_itl.observe(gap)
        self.t_last = now
        self.tokens_out += n
        self.mm.output_tokens.inc(n)
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
            self.state.capacity_changed(self.entry.name)

    def fail(self, status: int, error_type: str) -> None:
        self.status = "error"
        self.error_type = error_type

    def release(self, final: bool = True) -> None:
        """Free the booking and record the request's end. Safe to call any number of times.

        ``final=False`` only frees the booking (the request is being re-routed elsewhere)."""
        if self.released:
            return
        self.released = True
        if not final:
            self.free_booking()
            return
        mm = self.mm
        if not self.ttft_recorded:
            mm.queued.dec()
        self.free_booking(notify=False)
        for h in self.hooks:
            try:
                h.on_release(self)
            except Exception:
                log.exception("release hook failed")
        now = _now()
        mm.duration.observe(now - self.t_start)
        mm.inflight.dec()
        mm.active.dec()
        mm.osl.observe(self.tokens_out)
        mm.finished(self.status, self.error_type)
        m = self.state.metrics
        m.router_requests.inc()
        m.router_osl.observe(self.tokens_out)
        if self.tokens_out > 1 and self.t_first is not None and self.t_last is not None:
            g = self.state.worker_gauges(self.decision.worker.id, self.decision.dp_rank)
            g[2].set((self.t_last - self.t_first) / (self.tokens_out - 1))
        self.state.capacity_changed(self.entry.name)


def upstream_headers(rank: int, request_id: str) -> list[tuple[str, str]]:
    return [("content-type", "application/json"), ("x-data-parallel-rank", str(rank)), ("x-request-id", request_id)]


def count_completion_tokens(body: bytes) -> int:
    m = _COMPLETION_TOKENS.search(body)
    return int(m.group(1)) if m else 0


class StreamProxy:
    """ASGI response that relays a worker's SSE stream chunk by chunk and always releases the lease."""

    __slots__ = ("upstream", "lease", "headers", "on_failure", "rewriter", "tap", "idle_timeout", "migrator", "preamble")

    def __init__(self, upstream: UpstreamResponse, lease: Lease, headers: list[tuple[bytes, bytes]], on_failure: Any, rewriter: Any = None,
                 tap: Any = None, idle_timeout: float | None = None, migrator: Any = None) -> None:
        self.upstream = upstream
        self.lease = lease
        self.headers = headers
        self.on_failure = on_failure  # callable(lease, exc) for worker failures mid-stream
        self.rewriter = rewriter  # response nvext / speculative prefill (only when the request asked)
        self.tap = tap  # parity.UsageTap: reads (and strips) the engine's usage event
        self.idle_timeout = idle_timeout  # --stream-idle-timeout: cut a worker that goes silent mid-stream
        # --migration-limit: ``tracker`` (migration.SseTracker) and ``async resume(lease, exc) ->
        # (upstream, lease) | None`` that continues the request on another worker
        self.migrator = migrator
        self.preamble = b""  # SSE events sent before the worker's stream (nvext.annotations)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            if self.preamble:
                await send({"type": "http.response.body", "body": self.preamble, "more_body": True})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                done, _ = await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not watch.done():
                    watch.cancel()
            if pump not in done:  # the client went away first
                pump.cancel()
                self._cancelled()
                try:
                    await pump
                except (asyncio.CancelledError, Exception):
                    pass
            else:
                exc = pump.exception()
                if isinstance(exc, OSError):  # send failed: client gone
                    self._cancelled()
                elif exc is not None:
                    raise exc
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            self.lease.release()  # the current one: a migrated stream moved on to another lease
            await self.upstream.aclose()

    def _cancelled(self) -> None:
        lease = self.lease
        if lease.released or lease.status == "error":
            return
        lease.status, lease.error_type = "error", "cancelled"
        st = lease.state
        st.metrics.disconnected.inc()
        st.metrics.cancellations.labels(lease.mm.model, lease.mm.endpoint, lease.mm.request_type).inc()

    async def _pump(self, send: Any) -> None:
        rw = self.rewriter
        tap = self.tap
        mig = self.migrator
        tracker = mig.tracker if mig is not None else None
        while True:
            lease = self.lease
            first = True
            try:
                async for chunk in self.upstream.aiter_raw(self.idle_timeout):
                    if not chunk:
                        continue
                    if first and not _role_only(chunk):  # first token (vLLM-style role chunks carry none)
                        first = False
                        lease.first_token()
                        if rw is not None:
                            rw.first_token()
                    n = chunk.count(b"data:")
                    if n:
                        if _DONE in chunk:
                            n -= 1
                        if b'"content":""' in chunk or b'"choices":[]' in chunk:  # role-only / usage-only events
                            n -= chunk.count(b'"content":""') + chunk.count(b'"choices":[]')
                        lease.tokens(n)
                    if tracker is not None:
                        chunk = tracker.feed(chunk)
                        if not chunk:
                            continue
                    if tap is not None:  # after the tracker: it reads the usage counted over both workers
                        chunk = tap.feed(chunk)
                        if not chunk:
                            continue
                    if rw is not None:
                        chunk = rw.chunk(chunk)
                        if not chunk:
                            continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rest = tap.flush() if tap is not None else b""
                if rw is not None:
                    rest = (rw.chunk(rest) if rest else b"") + rw.flush()
                if rest:
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
            except OSError:
                raise
            except UpstreamError as exc:
                if tracker is not None and tracker.done:  # lost after its [DONE]: the response is complete
                    break
                timeout = isinstance(exc, UpstreamTimeout)
                if timeout:  # silent, not dead: the worker stays in the candidate set
                    lease.fail(504, "response_timeout")
                else:
                    lease.fail(500, "internal")
                    self.on_failure(lease, exc)
                if mig is not None and not tracker.finished:
                    if tap is not None:  # the continuation's usage is not this routing decision's evidence
                        tap.probe = None
                    upstream, self.lease = await mig.resume(lease, exc)
                    if rw is not None:
                        rw.lease = self.lease
                    if upstream is not None:
                        old, self.upstream = self.upstream, upstream
                        await old.aclose()
                        continue
                    lease = self.lease
                if tracker is not None and tracker.finished:
                    err = b"data: [DONE]\n\n"  # every choice ended: only the terminator was lost
                else:
                    status = 504 if timeout else 500
                    msg = (f"worker {lease.decision.worker.id} stopped sending mid-stream: {exc}" if timeout
                           else f"worker {lease.decision.worker.id} failed mid-stream: {exc}")
                    err = b"data: " + openai_error_body(status, msg) + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": err, "more_body": True})
            break
        lease = self.lease
        lease.release()
        if rw is not None:
            rw.finished(lease)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _role_only(chunk: bytes) -> bool:
    """A lone ``delta: {"role": "assistant", "content": ""}`` event (no token yet)."""
    return chunk.count(b"data:") == 1 and b'"role"' in chunk and (b'"content":""' in chunk or b'"content": ""' in chunk)


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
