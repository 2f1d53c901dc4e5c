"""A small keep-alive HTTP/1.1 client for talking to workers on the request path.

Why not httpx here: profiling the frontend (py-spy, short non-streaming chat requests) showed about
70% of its CPU inside httpx/httpcore/anyio per request (request building, pool bookkeeping, two
socket writes, tracing hooks). This client does one ``transport.write`` per request on a pooled
asyncio connection and parses responses with ``httptools`` (the C parser uvicorn already uses).
It only needs what the proxy needs: POST a body, get the status, headers and the body either whole
or chunk by chunk as it arrives (chunked encoding decoded), and abort on client disconnect.
TCP_NODELAY is set on every connection so small SSE chunks are never held back by Nagle.

httpx is still used for the rare control-plane calls (health checks, discovery).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import cast, overload
from urllib.parse import urlsplit

import httptools

log = logging.getLogger("frontend.dispatch.upstream")


class UpstreamError(Exception):
    """The worker could not be talked to."""


class UpstreamConnectError(UpstreamError):
    """The request never reached the worker (connection refused, unreachable): safe to send elsewhere."""


class UpstreamProtocolError(UpstreamError):
    """The connection broke or the worker sent something that is not HTTP/1.1."""


class UpstreamTimeout(UpstreamError):
    """The worker did not answer within the configured time (``--request-timeout``)."""


class UpstreamResponse:
    """One response: ``status``, ``headers`` and a body read whole (``content``) or as chunks."""

    __slots__ = (
        "status",
        "headers",
        "_chunks",
        "_waiter",
        "complete",
        "error",
        "received_any",
        "_conn",
        "_headers_fut",
        "_done_fut",
        "_sink",
        "_last_body",
        "_idle_timer",
        "_loop",
    )

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self.complete = False
        self.error: BaseException | None = None
        self.received_any = False
        self._conn: _Connection | None = conn
        self._headers_fut: asyncio.Future | None = loop.create_future() if stream else None
        self._done_fut: asyncio.Future | None = None if stream else loop.create_future()
        self._sink: Callable[[bytes], bool] | None = None  # relay(): body bytes handed on in the callbacks
        self._last_body = 0.0  # relay(): loop time of the last body bytes (for the idle timeout)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._loop = loop  # on_body reads its clock per chunk; asyncio.get_running_loop() costs a getpid() system call

    @overload
    def header(self, name: bytes, default: bytes) -> bytes: ...
    @overload
    def header(self, name: bytes, default: None = None) -> bytes | None: ...
    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return default

    @property
    def content(self) -> bytes:
        """The whole body (non-streamed responses, after the request returned)."""
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)

    async def relay(self, sink: Callable[[bytes], bool], idle_timeout: float | None = None) -> bool:
        """Hand the body to ``sink`` as it arrives, from the connection's callbacks: no task wake-up
        per chunk. ``sink`` takes each piece (it is consumed) and returns False to hand back; the
        rest of the body is then read with ``aiter_raw``, which also ends the body (or raises its
        error) once this returns. Raises :class:`UpstreamTimeout` after ``idle_timeout`` of silence
        once body bytes arrived, and whatever ``sink`` raised. Returns whether ``sink`` got bytes."""
        chunks = self._chunks
        got = False
        while chunks:
            got = True
            if not sink(chunks.popleft()):
                return True
        if self.complete or self.error is not None:
            return got
        loop = self._loop
        fut = self._waiter = loop.create_future()
        self._sink = sink
        self._last_body = loop.time() if got else 0.0
        if idle_timeout is not None:
            self._idle_timer = loop.call_later(idle_timeout, self._idle_check, fut, idle_timeout)
        try:
            await fut
        finally:
            self._sink = None
            self._waiter = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        return got or self._last_body != 0.0

    def _idle_check(self, fut: asyncio.Future, seconds: float) -> None:
        """relay()'s idle timeout: one timer re-armed to the last body bytes, not one per chunk."""
        if fut.done():
            return
        loop = fut.get_loop()
        last = self._last_body
        if last and loop.time() - last >= seconds:
            _idle_expired(fut, seconds)
        else:  # no body yet (no limit before the first bytes), or bytes since: check again later
            self._idle_timer = loop.call_at((last or loop.time()) + seconds, self._idle_check, fut, seconds)

    async def aiter_raw(self, idle_timeout: float | None = None, started: bool = False) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (everything buffered so far in one piece).

        ``idle_timeout``: once the first body bytes arrived (``started``: before this call), a gap
        longer than this raises :class:`UpstreamTimeout` (a worker that hangs mid-stream;
        ``--stream-idle-timeout``)."""
        chunks = self._chunks
        while True:
            if chunks:
                started = True
                if len(chunks) == 1:
                    yield chunks.popleft()
                else:
                    data = b"".join(chunks)
                    chunks.clear()
                    yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            loop = self._loop
            fut = self._waiter = loop.create_future()
            timer = (
                loop.call_later(idle_timeout, _idle_expired, fut, idle_timeout)
                if (idle_timeout is not None and started)
                else None
            )
            try:
                await fut
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    async def aread(self) -> bytes:
        out = []
        async for chunk in self.aiter_raw():
            out.append(chunk)
        return b"".join(out)

    async def aclose(self) -> None:
        """Done with the response; an unfinished one aborts its connection (the worker sees a disconnect)."""
        conn = self._conn
        self._conn = None
        if conn is not None and not self.complete:
            conn.abort()

    # --- parser side ---------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = exc
        for f in (self._headers_fut, self._done_fut):
            if f is not None and not f.done():
                f.set_exception(exc)
                f.exception()  # mark retrieved: the awaiting side may be gone
        self._wake()


def _run(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("after-send step failed")


def _idle_expired(fut: asyncio.Future, seconds: float) -> None:
    if not fut.done():
        fut.set_exception(UpstreamTimeout(f"worker sent nothing for {seconds:g} s mid-stream"))


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "transport", "parser", "resp", "lost")

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.resp: UpstreamResponse | None = None
        self.lost = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport (uvloop's does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        resp.received_any = True
        assert self.parser is not None  # set by send() together with resp
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(UpstreamProtocolError(f"invalid HTTP response from worker: {exc}"))
            self.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.pool._forget(self)
        resp = self.resp
        if resp is not None:
            self.resp = None
            resp._fail(UpstreamProtocolError("worker closed the connection" + (f": {exc}" if exc else "")))

    # httptools callbacks: they run inside data_received's feed_data, so resp and parser are set
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None and self.parser is not None
        resp.status = self.parser.get_status_code()
        f = resp._headers_fut
        if f is not None and not f.done():
            f.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        sink = resp._sink
        if sink is None:
            resp._chunks.append(body)
            if resp._waiter is not None:
                resp._wake()
            return
        resp._last_body = resp._loop.time()
        try:
            keep = sink(body)
        except Exception as exc:  # the relay's own failure: raised in the relaying task
            resp._sink = None
            w = resp._waiter
            if w is not None and not w.done():
                w.set_exception(exc)
            return
        if not keep:
            resp._sink = None
            resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        assert resp is not None and self.parser is not None
        self.resp = None
        resp.complete = True
        resp._conn = None
        f = resp._done_fut
        if f is not None and not f.done():
            f.set_result(None)
        f = resp._headers_fut
        if f is not None and not f.done():
            f.set_result(None)
        resp._wake()
        if self.parser.should_keep_alive() and not self.lost:
            self.pool._release(self)
        else:
            self.abort()

    def send(self, data: bytes, resp: UpstreamResponse) -> None:
        self.resp = resp
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None  # connection_made ran before the pool handed it out
        self.transport.write(data)

    def abort(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one worker (``http://host:port``)."""

    def __init__(self, base_url: str, max_idle: int = 256, timeout: float | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// URLs are supported on the request path, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = f"host: {parts.netloc}\r\n".encode()
        self._idle: list[_Connection] = []
        self.max_idle = max_idle
        self.timeout = timeout  # for the response head (streaming) or the whole response; None = wait forever
        self._closed = False

    def _release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.abort()
        else:
            self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def _acquire(self) -> _Connection | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return conn

    def encode(self, method: str, path: str, body: bytes, headers: Iterable[tuple[str, str]]) -> bytes:
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode(),
            self._host_header,
            b"content-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for k, v in headers:
            head.append(f"{k}: {v}\r\n".encode())
        head.append(b"\r\n")
        head.append(body)
        return b"".join(head)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        stream: bool = False,
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send a request; returns after the headers (``stream=True``) or the whole response.

        ``on_sent`` runs once, as soon as the request is written (before waiting for anything), or before
        a new connection is awaited: work the caller owes before another request can run, which the
        worker need not wait for. What it raises is logged, not raised: the request is out."""
        data = self.encode(method, path, body, headers)
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            conn = self._acquire()
            reused = conn is not None
            if conn is None:
                if on_sent is not None:
                    _run(on_sent)
                    on_sent = None
                conn = await self._connect()
            resp = UpstreamResponse(conn, loop, stream)
            conn.send(data, resp)
            if on_sent is not None:
                _run(on_sent)
                on_sent = None
            fut = resp._headers_fut if stream else resp._done_fut
            assert fut is not None  # UpstreamResponse creates the one this mode waits on
            try:
                if self.timeout is None:
                    await fut
                else:
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), self.timeout)
                    except TimeoutError:
                        conn.abort()
                        raise UpstreamTimeout(
                            f"worker {self.host}:{self.port} did not answer within {self.timeout} s"
                        ) from None
                return resp
            except UpstreamProtocolError:
                # a kept-alive connection the worker had already closed: nothing was processed
                if reused and not resp.received_any and attempt == 0:
                    continue
                raise
            except asyncio.CancelledError:
                conn.abort()
                raise
        raise UpstreamProtocolError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
