"""Dispatch to a worker and pass its response through, driving the request's lease.

The lease (``frontend/dispatch/lifecycle.py``) is the booking of one routed request. Every exit path of a
stream ends in ``Lease.release()`` (idempotent): normal end of stream, worker error, client
disconnect, cancellation. The first body bytes from the worker mark prefill complete.

Streaming responses are a small ASGI callable (:class:`StreamProxy`) rather than Starlette's
``StreamingResponse``: it forwards each chunk the moment the worker sends it (no buffering), and it
watches the client's ``http.disconnect`` concurrently so a client that goes away while the worker
is still thinking frees its load at once and aborts the worker's request. Under uvicorn's httptools
server each chunk goes from the worker's connection to the client's in the worker connection's
callback (``UpstreamResponse.relay`` + ``kvroute_common.fast_http.ChunkWriter``): no task step and
no ASGI message per chunk; the request's task wakes only at the end, on a failure, or when the
client stops reading (then ASGI ``send`` takes over and waits for it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from frontend.dispatch.lifecycle import Lease
from frontend.dispatch.stream_dialect import OPENAI, StreamDialect
from frontend.dispatch.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from kvroute_common.fast_http import ChunkWriter, chunk_writer

log = logging.getLogger("frontend.dispatch.proxy")
_now = time.perf_counter


def upstream_headers(rank: int, request_id: str) -> list[tuple[str, str]]:
    return [("content-type", "application/json"), ("x-data-parallel-rank", str(rank)), ("x-request-id", request_id)]


class ChunkPipeline:
    """What every chunk of a worker's streamed response does to its request, whoever relays it (the
    proxy here, or Envoy through the endpoint picker): the first token marks prefill complete, tokens
    are counted, and the migration tracker, the usage tap and the response rewriter see the chunk in
    that order (each may hold or change bytes). ``feed`` returns what the client gets now.

    A relay that writes to the client itself calls ``transform``, writes, then ``account``: the first
    token's bookkeeping (metrics, the latency model, the tracker's prefill completion, admission
    wake-ups) then runs after the client has the token, not before."""

    __slots__ = ("lease", "dialect", "rewriter", "tap", "tracker", "first")

    def __init__(self, lease: Lease, dialect: StreamDialect, rewriter: Any, tap: Any, tracker: Any = None) -> None:
        self.lease = lease
        self.dialect = dialect
        self.rewriter = rewriter
        self.tap = tap
        self.tracker = tracker
        self.first = True

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        self.account(chunk)
        return self.transform(chunk)

    def account(self, chunk: bytes) -> None:
        """The request's bookkeeping for a chunk as the worker sent it: its first token, its token count."""
        if self.first and self.dialect.has_token(chunk):  # first token (vLLM-style role chunks carry none)
            self.first = False
            self.lease.first_token()
            if self.rewriter is not None:
                self.rewriter.first_token()
        n = self.dialect.tokens(chunk)
        if n:
            self.lease.tokens(n)

    @property
    def accounts_after_write(self) -> bool:
        """Whether a relay may write a chunk before ``account``: not when the rewriter adds the first
        token's time to what the client gets."""
        return self.rewriter is None

    def transform(self, chunk: bytes) -> bytes:
        """What the client gets of a chunk now (the tracker, the tap and the rewriter may hold or change it)."""
        if self.tracker is not None:
            chunk = self.tracker.feed(chunk)
            if not chunk:
                return b""
        if self.tap is not None:  # after the tracker: it reads the usage counted over both workers
            chunk = self.tap.feed(chunk)
            if not chunk:
                return b""
        if self.rewriter is not None:
            chunk = self.rewriter.chunk(chunk)
        return chunk

    def flush(self) -> bytes:
        """What is still held at the end of the worker's stream."""
        rest = self.tap.flush() if self.tap is not None else b""
        if self.rewriter is not None:
            rest = (self.rewriter.chunk(rest) if rest else b"") + self.rewriter.flush()
        return rest


class StreamProxy:
    """ASGI response that relays a worker's SSE stream chunk by chunk and always releases the lease."""

    __slots__ = (
        "upstream",
        "lease",
        "headers",
        "on_failure",
        "rewriter",
        "tap",
        "idle_timeout",
        "migrator",
        "preamble",
        "dialect",
    )

    def __init__(
        self,
        upstream: UpstreamResponse,
        lease: Lease,
        headers: list[tuple[bytes, bytes]],
        on_failure: Any,
        rewriter: Any = None,
        tap: Any = None,
        idle_timeout: float | None = None,
        migrator: Any = None,
        dialect: StreamDialect = OPENAI,
    ) -> None:
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
        self.dialect = dialect  # the API's stream format (OpenAI chunks or Anthropic events)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # the relay runs in the request's own task; a watcher task cancels it if the client leaves first
        task = asyncio.current_task()
        watch: asyncio.Future | None = None
        gone = _ClientGone()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            # the headers leave now, as an engine's stream sends them, not with the first token (an
            # empty body part flushes a header block the server holds for coalescing)
            await send({"type": "http.response.body", "body": self.preamble, "more_body": True})
            watch = asyncio.ensure_future(_cancel_on_disconnect(receive, task, gone))
            try:
                await self._pump(send, chunk_writer(send))
            except OSError:  # send failed: client gone
                self._cancelled()
            except asyncio.CancelledError:
                if not gone.left or task is None or task.uncancel() > 0:
                    raise  # cancelled from outside (shutdown): not the client's doing
                self._cancelled()
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
            self.lease.release()  # the current one: a migrated stream moved on to another lease
            await self.upstream.aclose()

    def _cancelled(self) -> None:
        lease = self.lease
        if lease.released or lease.status == "error":
            return
        lease.client_gone()

    async def _pump(self, send: Any, writer: ChunkWriter | None) -> None:
        """Relay the worker's stream, continuing it elsewhere if the worker fails and may be migrated.
        With a ``writer`` the chunks go to the client from the upstream connection's callbacks, and
        ``send`` takes over for what is left when the writer hands back (a slow or gone client)."""
        rw = self.rewriter
        tap = self.tap
        mig = self.migrator
        tracker = mig.tracker if mig is not None else None
        dialect = self.dialect
        while True:
            lease = self.lease
            chunks = ChunkPipeline(lease, dialect, rw, tap, tracker)
            try:
                started = False
                if writer is not None:
                    started = await self.upstream.relay(_DirectSink(chunks, writer), self.idle_timeout)
                async for chunk in self.upstream.aiter_raw(self.idle_timeout, started):
                    chunk = chunks.feed(chunk)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rest = chunks.flush()
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
                if mig is not None and tracker is not None and not tracker.finished:
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
                    msg = (
                        f"worker {lease.decision.worker.id} stopped sending mid-stream: {exc}"
                        if timeout
                        else f"worker {lease.decision.worker.id} failed mid-stream: {exc}"
                    )
                    err = dialect.failure(status, msg)
                await send({"type": "http.response.body", "body": err, "more_body": True})
            break
        lease = self.lease
        lease.release()
        if rw is not None:
            rw.finished(lease)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _DirectSink:
    """A chunk from the worker, through the pipeline, to the client: called in the upstream
    connection's callbacks (``UpstreamResponse.relay``); False hands the rest back to the task."""

    __slots__ = ("chunks", "writer")

    def __init__(self, chunks: ChunkPipeline, writer: ChunkWriter) -> None:
        self.chunks = chunks
        self.writer = writer

    def __call__(self, chunk: bytes) -> bool:
        chunks = self.chunks
        if not chunks.accounts_after_write:
            out = chunks.feed(chunk)
            return self.writer.write(out) if out else True
        if not chunk:
            return True
        out = chunks.transform(chunk)
        try:
            return self.writer.write(out) if out else True
        finally:
            chunks.account(chunk)  # the client has the bytes: the bookkeeping no longer delays them


class _ClientGone:
    """Set by the disconnect watcher before it cancels the relay, so the relay tells the client's
    leaving apart from a cancellation from outside."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = False


async def _cancel_on_disconnect(receive: Any, task: asyncio.Task | None, gone: _ClientGone) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.left = True
            if task is not None:
                task.cancel()
            return
