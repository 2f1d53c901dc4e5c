"""A small HTTP/1.1 server (asyncio + httptools) for the standalone indexer.

Why not uvicorn: for a 64-hash overlap query the index work is ~10 us, while uvicorn's per-request
machinery (ASGI scope and message dicts, one task per request, the app's awaits) cost more than
that again. Here the two hot routes (POST /query, /query_by_hash) are answered synchronously in
the protocol callback and written straight to the transport; every other request goes to the
regular ASGI app (Starlette, JSON errors) through a minimal ASGI bridge. Keep-alive, pipelining
(responses in order: reading pauses while an ASGI request runs), chunked request bodies,
``Expect: 100-continue`` and the body limits are handled here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
import orjson

from kvroute_common.http import is_json_content_type

log = logging.getLogger("indexer.http")

HotHandler = Callable[[bytes, bytes | None], tuple[int, bytes]]
"""(body, content-type header) -> (status, JSON body); must not block."""

_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _head(status: int, length: int, keep_alive: bool, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
        % (status, _REASONS.get(status, "Unknown").encode(), content_type, length, b"" if keep_alive else b"connection: close\r\n")
    )


def _error(status: int, message: str, keep_alive: bool = False) -> bytes:
    body = orjson.dumps({"error": message})
    return _head(status, len(body), keep_alive) + body


class _Connection(asyncio.Protocol):
    __slots__ = (
        "server", "transport", "parser", "url", "headers", "body", "body_size", "limit", "too_large",
        "content_type", "busy", "queue", "closed", "client",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: list[tuple[Any, ...]] = []
        self.busy = False
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.body_size = 0
        self.limit = self.server.body_limit
        self.too_large = False
        self.content_type: bytes | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.client = transport.get_extra_info("peername")
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._write_close(_error(400, "upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._write_close(_error(400, f"malformed HTTP request: {exc}"))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.headers.append((name, value))
        if name == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        path = httptools.parse_url(self.url).path
        if path in self.server.hot_paths:
            self.limit = self.server.hot_limit
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    if int(value) > self.limit:
                        self.too_large = True
                except ValueError:
                    pass
            elif name == b"expect" and value.lower() == b"100-continue" and not self.too_large and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > self.limit:
            self.too_large = True
            self.body.clear()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("latin-1")
        keep_alive = self.parser.should_keep_alive()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        request = (method, self.url, self.headers, body, keep_alive, self.content_type, self.too_large)
        if self.busy:
            self.queue.append(request)  # pipelined behind a running ASGI request
            return
        self._handle(request)

    # -- dispatch

    def _handle(self, request: tuple[Any, ...]) -> None:
        method, url, headers, body, keep_alive, content_type, too_large = request
        parsed = httptools.parse_url(url)
        path = parsed.path.decode("latin-1")
        hot = self.server.hot.get(path) if method == "POST" else None
        if too_large:
            ctype = content_type.decode("latin-1") if content_type else None
            if method == "POST" and not is_json_content_type(ctype):  # axum's order: 415 before 413
                out = _error(415, "Expected request with `Content-Type: application/json`", keep_alive)
            else:
                out = _error(413, "Failed to buffer the request body: length limit exceeded", keep_alive)
            self._write(out, keep_alive)
            return
        if hot is not None:
            status, payload = hot(body, content_type)
            self._write(_head(status, len(payload), keep_alive) + payload, keep_alive)
            return
        self.busy = True
        if self.transport is not None:
            self.transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._asgi(method, path, parsed.query or b"", headers, body, keep_alive))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _asgi(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("latin-1"),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server.address,
        }
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # nothing more will come (disconnect is not reported)
            return {"type": "http.disconnect"}

        status = 500
        out_headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                out_headers = [(k.lower(), v) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.server.app(scope, receive, send)
            payload = b"".join(chunks)
        except Exception as exc:  # pragma: no cover - the app turns its errors into responses
            log.exception("unhandled error for %s %s", method, path)
            status, out_headers, payload = 500, [(b"content-type", b"application/json")], orjson.dumps({"error": f"internal error: {exc}"})
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode())]
        for k, v in out_headers:
            if k not in (b"content-length", b"connection", b"transfer-encoding"):
                lines.append(k + b": " + v + b"\r\n")
        head_only = method == "HEAD"
        lines.append(b"content-length: %d\r\n" % len(payload))
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        self._write(b"".join(lines) + (b"" if head_only else payload), keep_alive)
        self.busy = False
        if self.closed:
            return
        while self.queue and not self.busy:
            self._handle(self.queue.pop(0))
        if not self.busy and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _write(self, data: bytes, keep_alive: bool) -> None:
        if self.transport is None or self.closed:
            return
        self.transport.write(data)
        if not keep_alive:
            self.transport.close()
            self.closed = True

    def _write_close(self, data: bytes) -> None:
        self._write(data, False)


class HttpServer:
    """Serves ``app`` (ASGI) on host:port; ``hot`` maps POST paths to synchronous JSON handlers."""

    def __init__(self, app: Any, hot: dict[str, HotHandler], hot_limit: int, body_limit: int) -> None:
        self.app = app
        self.hot = hot
        self.hot_paths = {p.encode() for p in hot}
        self.hot_limit = hot_limit
        self.body_limit = body_limit
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, backlog=2048)
        self.address = (host, port)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for task in list(self.tasks):
            task.cancel()
