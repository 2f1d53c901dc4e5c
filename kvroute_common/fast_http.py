"""The one fast HTTP path of the JSON services: hot POST routes answered before Starlette, on uvicorn.

Both standalone services (``python -m slot_tracker``, ``python -m indexer``) have a few hot
read routes (``/potential_loads``, ``/query``, ``/query_by_hash``) whose handler work is a few
microseconds, comparable to what Starlette's router, middleware and Request/Response objects
cost per request. Three pieces, shared so there is one mechanism for the concept:

- ``FastJsonRoutes(app, routes, limit)``: an ASGI wrapper that answers ``POST <path>`` for the
  given paths with a synchronous ``(body) -> (status, payload)`` handler and passes everything
  else (other paths, other methods, HEAD, lifespan) to the wrapped Starlette app. It applies
  ``kvroute_common.http.read_json``'s checks in axum's order with the same messages: 415 (not
  JSON), 413 (over ``limit``); handlers raise ``ApiError`` for 400/422/404...
- ``HeaderCoalescingProtocol``: uvicorn's httptools protocol sending each response's header
  block and body in one socket write (uvicorn writes them separately: two ``send`` syscalls per
  small answer, ~6 us of CPU each on this VM). Its malformed-request 400 is JSON like every
  other error of the services.
- ``server_config`` / ``run`` / ``serve``: uvicorn with the settings measured in
  docs/bench/slot_tracker.md and docs/bench/indexer.md (httptools + the protocol above, uvloop,
  no access log, no proxy-header rewriting, no ``server`` header).

uvicorn does the HTTP/1.1 work (keep-alive, pipelining, chunked bodies, ``100-continue``,
timeouts, graceful shutdown): no hand-written server to maintain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from kvroute_common.http import DEFAULT_BODY_LIMIT, ApiError, is_json_content_type

JsonHandler = Callable[[bytes], tuple[int, bytes]]
"""A hot route: raw request body -> (status, JSON payload). Synchronous, must not block; may raise ApiError."""

Observer = Callable[[str, int, float], None]
"""Called after each fast answer with (path, status, seconds spent), e.g. for request metrics."""

_UNSUPPORTED_MEDIA = orjson.dumps({"error": "Expected request with `Content-Type: application/json`"})
_TOO_LARGE = orjson.dumps({"error": "Failed to buffer the request body: length limit exceeded"})
_BAD_LENGTH = orjson.dumps({"error": "invalid content-length header"})
_CONTENT_TYPE = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")
_JSON = b"application/json"


class FastJsonRoutes:
    """ASGI wrapper answering hot ``POST`` JSON routes directly; everything else goes to ``app``.

    ``routes`` maps a path to its handler; ``limit`` is the body limit of those routes (413 beyond
    it, the connection is then closed rather than draining the rest). ``observe`` (optional) is
    told every fast answer's path, status and duration. ``state`` is the wrapped app's, so the
    wrapper stands in for a Starlette app where its state is read.
    """

    def __init__(self, app: Any, routes: Mapping[str, JsonHandler], limit: int = DEFAULT_BODY_LIMIT, observe: Observer | None = None) -> None:
        self.app = app
        self.routes = dict(routes)
        self.limit = limit
        self.observe = observe
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        content_type = content_length = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                content_length = value
        headers = None
        if content_type != _JSON and not is_json_content_type(content_type.decode("latin-1") if content_type is not None else None):
            status, payload = 415, _UNSUPPORTED_MEDIA
        elif content_length is not None and not content_length.isdigit():
            status, payload = 400, _BAD_LENGTH
        elif content_length is not None and int(content_length) > self.limit:
            status, payload, headers = 413, _TOO_LARGE, [_CONTENT_TYPE, (b"content-length", b"%d" % len(_TOO_LARGE)), _CLOSE]
        else:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            body = message.get("body", b"")
            if message.get("more_body", False):
                body = await self._rest(body, receive)
            if body is None:
                status, payload, headers = 413, _TOO_LARGE, [_CONTENT_TYPE, (b"content-length", b"%d" % len(_TOO_LARGE)), _CLOSE]
            else:
                try:
                    status, payload = handler(body)
                except ApiError as exc:
                    status, payload = exc.status, orjson.dumps({"error": exc.message})
        await send({"type": "http.response.start", "status": status, "headers": headers or [_CONTENT_TYPE, (b"content-length", b"%d" % len(payload))]})
        await send({"type": "http.response.body", "body": payload})
        if self.observe is not None:
            self.observe(scope["path"], status, time.perf_counter() - start)

    async def _rest(self, first: bytes, receive: Callable[[], Any]) -> bytes | None:
        """The rest of a body sent in several pieces (chunked, large); None once it passes the limit."""
        chunks = [first]
        size = len(first)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


# -- uvicorn protocol: one write per response -------------------------------------------------

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_STATUS_PREFIX = b"HTTP/1.1 "
_CONTINUE = b"100"
_MALFORMED = orjson.dumps({"error": "Invalid HTTP request received."})


class _HeaderHoldingTransport:
    """Transport proxy that holds a response's header block until the next write."""

    __slots__ = ("_transport", "_held")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data[:9] == _STATUS_PREFIX and data[9:12] != _CONTINUE:
            self._held = data
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


if HttpToolsProtocol is not None:

    class HeaderCoalescingProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol with one write per (small) response.

        The header block is held until the first body write, the end of the response or a close;
        streaming is unaffected (only the header block waits, and only until the first chunk) and
        ``100 Continue`` interim responses are never held. Pass it as uvicorn's ``http=``.
        """

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.transport = _HeaderHoldingTransport(transport)  # type: ignore[assignment]

        def on_response_complete(self) -> None:
            self.transport.flush()  # type: ignore[attr-defined]  # header-only responses (HEAD, 204)
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to an unparsable request, in the services' ``{"error": ...}`` shape."""
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(_MALFORMED))
            self.transport.write(b"".join(head) + _MALFORMED)
            self.transport.close()

else:  # pragma: no cover
    HeaderCoalescingProtocol = None  # type: ignore[assignment,misc]


# -- running an app ----------------------------------------------------------------------------


def server_config(app: Any, host: str, port: int, *, log_level: str = "warning", coalesce: bool = True, **overrides: Any) -> Any:
    """A ``uvicorn.Config`` with the lean settings both services measured (override any with kwargs)."""
    import uvicorn

    http: Any = HeaderCoalescingProtocol if coalesce and HeaderCoalescingProtocol is not None else "httptools"
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "access_log": False,
        "http": http,
        "loop": "uvloop",
        "lifespan": "on",
        "proxy_headers": False,
        "server_header": False,
        "backlog": 2048,
    }
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def run(app: Any, host: str, port: int, **kwargs: Any) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (blocking; sets up uvloop): ``python -m <service>``'s last step."""
    import uvicorn

    uvicorn.Server(server_config(app, host, port, **kwargs)).run()


async def serve(app: Any, host: str, port: int, **kwargs: Any) -> None:
    """``run`` inside an already running event loop (for services with an async start-up sequence)."""
    import uvicorn

    await uvicorn.Server(server_config(app, host, port, **kwargs)).serve()


__all__ = ["FastJsonRoutes", "HeaderCoalescingProtocol", "JsonHandler", "Observer", "run", "serve", "server_config"]
