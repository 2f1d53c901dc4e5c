"""The one fast HTTP path of the JSON services: hot POST routes answered before Starlette, on uvicorn.

Both standalone services (``python -m slot_tracker``, ``python -m indexer``) have a few hot
read routes (``/potential_loads``, ``/query``, ``/query_by_hash``) whose handler work is a few
microseconds, less than what Starlette (router, middleware, Request/Response) and uvicorn's
per-request ASGI machinery (scope, cycle, task, receive/send) cost. The pieces, shared so there
is one mechanism for the concept:

- ``FastJsonRoutes(app, routes, limit, observe)``: an ASGI wrapper that answers ``POST <path>``
  for the given paths with a synchronous ``(body) -> (status, payload)`` handler and passes
  everything else (other paths, other methods, HEAD, lifespan) to the wrapped Starlette app. It
  applies ``kvroute_common.http.read_json``'s checks in axum's order with the same messages: 415
  (not JSON), 413 (over ``limit``); handlers raise ``ApiError`` for 400/422/404... With a
  ``policy`` (``kvroute_common.security``), a request it refuses gets its 401 first.
- ``HeaderCoalescingProtocol``: uvicorn's httptools protocol sending each response's header
  block and body in one socket write (uvicorn writes them separately: two ``send`` syscalls per
  small answer). Its malformed-request 400 is JSON like every other error of the services.
- ``FastJsonProtocol`` (the default): the above, plus the ``FastJsonRoutes`` routes answered in
  uvicorn's parser callbacks with the wrapper's own ``precheck``/``answer``: no ASGI cycle or
  task for a hot request (-8 to -20 us of CPU per request, docs/bench/*.md).
- ``chunk_writer``: a streamed (chunked) response's body parts written to the connection from a
  relay's callbacks, with no task step or ASGI message per part (the frontend's stream relay).
- ``server_config`` / ``run`` / ``serve``: uvicorn with the settings measured in
  docs/bench/slot_tracker.md and docs/bench/indexer.md (httptools + the protocol above, uvloop,
  no access log, no proxy-header rewriting, no ``server`` header).

uvicorn does the HTTP/1.1 work (parsing, keep-alive, pipelining, chunked bodies, ``100-continue``,
idle timeouts, graceful shutdown): no hand-written server to maintain. ``FastJsonProtocol``
relies on a few uvicorn internals (tested with uvicorn 0.54); tests/test_fast_http.py runs the
same behaviour tests on it and on the plain ASGI path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from kvroute_common.drain import Drain, DrainingServer, DrainMiddleware
from kvroute_common.errors import ServiceError
from kvroute_common.http import DEFAULT_BODY_LIMIT, is_json_content_type
from kvroute_common.security import AccessPolicy, AuthMiddleware

JsonHandler = Callable[[bytes], tuple[int, bytes]]
"""A hot route: raw request body -> (status, JSON payload). Synchronous, must not block; may raise ApiError."""

Observer = Callable[[str, int, float], None]
"""Called after each fast answer with (path, status, seconds spent), e.g. for request metrics."""

_UNSUPPORTED_MEDIA = orjson.dumps({"error": "Expected request with `Content-Type: application/json`"})
_TOO_LARGE = orjson.dumps({"error": "Failed to buffer the request body: length limit exceeded"})
_BAD_LENGTH = orjson.dumps({"error": "invalid content-length header"})
_CONTENT_TYPE = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")
_WWW_AUTHENTICATE = (b"www-authenticate", b"Bearer")
_JSON = b"application/json"


class FastJsonRoutes:
    """ASGI wrapper answering hot ``POST`` JSON routes directly; everything else goes to ``app``.

    ``routes`` maps a path to its handler; ``limit`` is the body limit of those routes (413 beyond
    it). A 413, or a refusal of an ``Expect: 100-continue`` request, closes the connection: the
    rest of the body is not worth reading, or may never come. ``observe`` (optional) is
    told every fast answer's path, status and duration. ``state`` is the wrapped app's, so the
    wrapper stands in for a Starlette app where its state is read.

    Under any ASGI server this works as is; under uvicorn with ``FastJsonProtocol`` (the default
    of ``server_config``) the same routes are answered in the protocol callback instead, through
    the same ``precheck`` / ``answer`` methods, so the checks and messages cannot diverge.
    """

    def __init__(
        self,
        app: Any,
        routes: Mapping[str, JsonHandler],
        limit: int = DEFAULT_BODY_LIMIT,
        observe: Observer | None = None,
        policy: AccessPolicy | None = None,
    ) -> None:
        self.app = app
        self.policy = policy  # None: no token configured, nothing checked
        self.routes = dict(routes)
        self.raw_routes = {
            path.encode("latin-1"): (path, handler) for path, handler in self.routes.items()
        }  # for FastJsonProtocol
        self.limit = limit
        self.observe = observe
        self.state = getattr(app, "state", None)

    def precheck(self, content_type: bytes | None, content_length: bytes | None) -> tuple[int, bytes] | None:
        """What the headers alone decide (415, then a bad or too large declared length), or None."""
        if content_type != _JSON and not is_json_content_type(
            content_type.decode("latin-1") if content_type is not None else None
        ):
            return 415, _UNSUPPORTED_MEDIA
        if content_length is not None:
            if not content_length.isdigit():
                return 400, _BAD_LENGTH
            if int(content_length) > self.limit:
                return 413, _TOO_LARGE
        return None

    @staticmethod
    def answer(handler: JsonHandler, body: bytes) -> tuple[int, bytes]:
        """The handler's answer, an ApiError turned into its ``{"error": ...}`` body."""
        try:
            return handler(body)
        except ServiceError as exc:  # ApiError and the cores' refusals alike
            return exc.status, orjson.dumps({"error": exc.message})

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]
    ) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter() if self.observe is not None else 0.0
        content_type = content_length = expect = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                content_length = value
            elif name == b"expect":
                expect = value
        policy = self.policy
        refused = policy.refusal("POST", scope["path"], scope["headers"]) if policy is not None else None
        if refused is None:
            refused = self.precheck(content_type, content_length)
        close = refused is not None and (
            refused[0] == 413 or expect is not None
        )  # no body worth reading, or none coming
        if refused is None:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            body = message.get("body", b"")
            if message.get("more_body", False):
                body = await self._rest(body, receive)
            elif len(body) > self.limit:  # a chunked body the server buffered whole
                body = None
            status, payload = self.answer(handler, body) if body is not None else (413, _TOO_LARGE)
            close = status == 413
        else:
            status, payload = refused
        headers = [_CONTENT_TYPE, (b"content-length", b"%d" % len(payload))]
        if status == 401:
            headers.append(_WWW_AUTHENTICATE)
        if close:
            headers.append(_CLOSE)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        if self.observe is not None:
            self.observe(scope["path"], status, time.perf_counter() - start)

    async def _rest(self, first: bytes, receive: Callable[[], Any]) -> bytes | None:
        """The rest of a body sent in several pieces (chunked, large); None once it passes the limit."""
        chunks = [first]
        size = len(first)
        if size > self.limit:
            return None
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
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_STATUS_PREFIX = b"HTTP/1.1 "
_CONTINUE = b"100"
_MALFORMED = orjson.dumps({"error": "Invalid HTTP request received."})
_default_block: tuple[Any, bytes] = (None, b"")


def _defaults(server_state: Any) -> bytes:
    """uvicorn's default response headers (``date``...) as one block; uvicorn renews the list every second."""
    global _default_block
    headers = server_state.default_headers
    if _default_block[0] is not headers:
        _default_block = (headers, b"".join(name + b": " + value + b"\r\n" for name, value in headers))
    return _default_block[1]


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

    class HeaderCoalescingProtocol(HttpToolsProtocol):
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

        malformed_body = _MALFORMED
        """The JSON body of the 400 for an unparsable request: the services' ``{"error": ...}`` shape."""

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to an unparsable request, in the server's JSON error shape."""
            self.transport.write(_json_answer(self.server_state, 400, self.malformed_body, close=True))
            self.transport.close()

    class FastJsonProtocol(HeaderCoalescingProtocol):
        """``HeaderCoalescingProtocol`` that answers the app's ``FastJsonRoutes`` in the parser callbacks.

        Under uvicorn every request costs an ASGI scope, a RequestResponseCycle, an asyncio task and
        a round of ``receive``/``send`` coroutines: more than the hot handlers themselves (measured:
        docs/bench/indexer.md). When the served app is a ``FastJsonRoutes``, a ``POST`` to one of
        its routes is answered here, synchronously, once the body is complete, through the
        wrapper's own ``precheck``/``answer`` (same checks, statuses and messages). Anything else,
        and a hot request pipelined behind a running ASGI request (answers stay in order), takes
        uvicorn's normal path, where the wrapper answers it as ASGI. uvicorn still parses, keeps
        connections alive, times idle ones out and shuts down; ``Expect: 100-continue`` is answered
        when the headers pass the checks.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            app = self.app
            # uvicorn internals this relies on (tested with 0.54); without them, FastJsonRoutes answers as ASGI
            internals = all(
                hasattr(self, name)
                for name in ("cycle", "pipeline", "expect_100_continue", "server_state", "parser", "flow")
            )
            self.fast: FastJsonRoutes | None = (
                app if isinstance(app, FastJsonRoutes) and not self.root_path and internals else None
            )
            self.hot: JsonHandler | None = None
            self.hot_paused_reading = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.hot = None

        def on_headers_complete(self) -> None:
            fast = self.fast
            if fast is not None and self.parser.get_method() == b"POST":
                route = fast.raw_routes.get(httptools.parse_url(self.url).path)
                cycle = self.cycle
                if (
                    route is not None
                    and (cycle is None or cycle.response_complete)
                    and not self.pipeline
                    and not self.parser.should_upgrade()
                ):
                    self._begin_hot(fast, *route)
                    return
            super().on_headers_complete()

        def _begin_hot(self, fast: FastJsonRoutes, path: str, handler: JsonHandler) -> None:
            self.hot = handler
            self.hot_path = path
            self.hot_start = time.perf_counter() if fast.observe is not None else 0.0
            self.hot_chunks: list[bytes] = []
            self.hot_size = 0
            self.hot_done = self.transport.is_closing()
            self.hot_keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            content_type = content_length = None
            for name, value in self.headers:
                if name == b"content-type":
                    content_type = value
                elif name == b"content-length":
                    content_length = value
            policy = fast.policy
            refused = policy.refusal("POST", path, self.headers) if policy is not None else None
            if refused is None:
                refused = fast.precheck(content_type, content_length)
            self.hot_refused = refused
            if refused is not None:
                if refused[0] == 413 or self.expect_100_continue:
                    self._hot_reply(*refused, close=True)  # no body worth reading, or none coming
            elif self.expect_100_continue and not self.hot_done:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        def on_body(self, body: bytes) -> None:
            if self.hot is None:
                super().on_body(body)
            elif not self.hot_done and self.hot_refused is None:
                self.hot_size += len(body)
                if self.hot_size > self.fast.limit:  # type: ignore[union-attr]
                    self._hot_reply(413, _TOO_LARGE, close=True)
                else:
                    self.hot_chunks.append(body)

        def on_message_complete(self) -> None:
            if self.hot is None:
                super().on_message_complete()
            elif not self.hot_done:
                if self.hot_refused is not None:
                    status, payload = self.hot_refused
                else:
                    chunks = self.hot_chunks
                    status, payload = FastJsonRoutes.answer(
                        self.hot, chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    )
                self._hot_reply(status, payload, close=not self.hot_keep_alive)

        def _hot_reply(self, status: int, payload: bytes, close: bool) -> None:
            self.hot_done = True
            if self.transport.is_closing():
                return
            self.transport._transport.write(_json_answer(self.server_state, status, payload, close))  # type: ignore[attr-defined]
            fast = self.fast
            if fast is not None and fast.observe is not None:
                fast.observe(self.hot_path, status, time.perf_counter() - self.hot_start)
            if close:
                self.transport.close()
            self.on_response_complete()  # uvicorn's bookkeeping: request count, resume reading, keep-alive timer
            if self.flow.write_paused:  # a client not reading its answers: stop reading its requests
                self.flow.pause_reading()
                self.hot_paused_reading = True

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.hot_paused_reading:
                self.hot_paused_reading = False
                self.flow.resume_reading()

    def _json_answer(server_state: Any, status: int, payload: bytes, close: bool = False) -> bytes:
        """A complete JSON response (status line, uvicorn's default headers, body) as one buffer."""
        return b"%s%scontent-type: application/json\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
            STATUS_LINE[status],
            _defaults(server_state),
            len(payload),
            b"www-authenticate: Bearer\r\n" if status == 401 else b"",
            b"connection: close\r\n" if close else b"",
            payload,
        )

else:  # pragma: no cover
    HeaderCoalescingProtocol = FastJsonProtocol = None  # type: ignore[assignment,misc]


# -- a streamed response's body written from callbacks ------------------------------------------

try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _HttpToolsCycle
except ImportError:  # pragma: no cover - uvicorn without httptools
    _HttpToolsCycle = None  # type: ignore[assignment,misc]


class ChunkWriter:
    """Writes the body parts of a chunked response straight to the client's connection, outside any
    task: a relay calls it from its upstream connection's callbacks, with no coroutine step and no
    ASGI message per part. It does what uvicorn's ``send`` does for a body part (the chunk framing),
    and hands back as soon as ``send`` must take over again."""

    __slots__ = ("_cycle", "_transport", "_flow")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    def write(self, part: bytes) -> bool:
        """Send one body part (an empty one is skipped). False when the client has gone or stopped
        reading (writing paused): later parts must go through ``send``, which waits for the client."""
        if self._cycle.disconnected:
            return False
        if part:
            transport = self._transport
            transport.write(b"%x\r\n%b\r\n" % (len(part), part))
            if type(transport) is _HeaderHoldingTransport and transport._held is None:
                self._transport = transport._transport  # the header block is out: the rest go straight
        return not self._flow.write_paused


def chunk_writer(send: Callable[..., Any]) -> ChunkWriter | None:
    """A ``ChunkWriter`` for an ASGI ``send`` of uvicorn's httptools server whose chunked response has
    started, or None (another server, a wrapped ``send``, a response with a length, HEAD): then the
    body goes through ``send``. Relies on uvicorn's ``RequestResponseCycle`` (tested with 0.54)."""
    cycle = getattr(send, "__self__", None)
    if _HttpToolsCycle is None or type(cycle) is not _HttpToolsCycle:
        return None
    if not getattr(cycle, "response_started", False) or getattr(cycle, "response_complete", True):
        return None
    if getattr(cycle, "chunked_encoding", None) is not True or cycle.scope.get("method") == "HEAD":
        return None
    if not all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected")):
        return None
    return ChunkWriter(cycle)


# -- running an app ----------------------------------------------------------------------------


def protect(app: Any, policy: AccessPolicy | None = None, drain: Drain | None = None) -> Any:
    """``app`` behind the optional access policy and drain middlewares (none: ``app`` itself).

    The drain is outermost so ``/health`` answers 503 while draining whatever the credentials; the
    hot routes get the same policy through ``FastJsonRoutes(policy=...)``.
    """
    if policy is not None:
        app = AuthMiddleware(app, policy)
    if drain is not None:
        app = DrainMiddleware(app, drain)
    return app


PROTOCOLS = ("fast", "coalescing", "httptools")
"""``server_config``'s ``protocol``: FastJsonProtocol, HeaderCoalescingProtocol, or uvicorn's stock httptools one."""


def server_config(
    app: Any, host: str, port: int, *, log_level: str = "warning", protocol: str = "fast", **overrides: Any
) -> Any:
    """A ``uvicorn.Config`` with the lean settings both services measured (override any with kwargs)."""
    import uvicorn

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    http: Any = {"fast": FastJsonProtocol, "coalescing": HeaderCoalescingProtocol}.get(protocol) or "httptools"
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


def _server(app: Any, host: str, port: int, drain: Drain | None, kwargs: dict[str, Any]) -> Any:
    import uvicorn

    config = server_config(app, host, port, **kwargs)
    return uvicorn.Server(config) if drain is None else DrainingServer(config, drain)


def run(app: Any, host: str, port: int, drain: Drain | None = None, **kwargs: Any) -> None:
    """Serve ``app`` until SIGINT/SIGTERM (blocking; sets up uvloop): ``python -m <service>``'s last step.
    With ``drain`` (``kvroute_common.drain``), SIGTERM drains first and the exit is clean."""
    _server(app, host, port, drain, kwargs).run()


async def serve(app: Any, host: str, port: int, drain: Drain | None = None, **kwargs: Any) -> None:
    """``run`` inside an already running event loop (for services with an async start-up sequence)."""
    await _server(app, host, port, drain, kwargs).serve()


__all__ = [
    "FastJsonProtocol",
    "FastJsonRoutes",
    "HeaderCoalescingProtocol",
    "JsonHandler",
    "Observer",
    "PROTOCOLS",
    "protect",
    "run",
    "serve",
    "server_config",
]
