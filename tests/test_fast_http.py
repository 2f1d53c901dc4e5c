"""kvroute_common.fast_http on a real uvicorn server (in-process, loopback): FastJsonRoutes' checks,
statuses and pass-through, and the raw HTTP/1.1 behaviour with the header-coalescing protocol
(keep-alive, pipelining, chunked bodies, 100-continue, malformed requests, HEAD, HTTP/1.0)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from kvroute_common.fast_http import FastJsonProtocol, FastJsonRoutes, HeaderCoalescingProtocol, server_config
from kvroute_common.http import ApiError, decode_json, json_service, raw_json_response, read_json, route
from support import free_port, wait_until

LIMIT = 1024


class Echo(msgspec.Struct):
    n: int
    name: str = "x"


def hot_echo(body: bytes) -> tuple[int, bytes]:
    req = decode_json(body, Echo)
    if req.name == "missing":
        raise ApiError(404, "no such name")
    return 200, b'{"fast":true,"n":%d}' % req.n


async def slow_echo(request: Request) -> Response:
    req = await read_json(request, Echo, LIMIT)
    return raw_json_response(b'{"fast":false,"n":%d}' % req.n)


async def listing(request: Request) -> Response:
    return raw_json_response(b"[1,2,3]")


@pytest.fixture(scope="module", params=["fast", "coalescing"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[tuple[str, int, float]]]]:
    """The same app served with FastJsonProtocol (hot routes answered in the protocol) and with
    HeaderCoalescingProtocol (hot routes answered by FastJsonRoutes as ASGI): same behaviour."""
    observed: list[tuple[str, int, float]] = []
    app = json_service(
        [
            route("/echo", slow_echo, ["POST"]),
            route("/slow_echo", slow_echo, ["POST"]),
            route("/list", listing, ["GET"]),
        ]
    )
    wrapped = FastJsonRoutes(app, {"/echo": hot_echo}, LIMIT, observe=lambda *a: observed.append(a))
    port = free_port()
    config = server_config(wrapped, "127.0.0.1", port, lifespan="off", protocol=request.param)
    assert config.http is {"fast": FastJsonProtocol, "coalescing": HeaderCoalescingProtocol}[request.param]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30, what="uvicorn started")
        yield f"http://127.0.0.1:{port}", observed
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def base(served: tuple[str, list]) -> str:
    return served[0]


def post(
    base: str, path: str, body: bytes, content_type: str | None = "application/json", **headers: str
) -> httpx.Response:
    if content_type is not None:
        headers["content-type"] = content_type
    return httpx.post(f"{base}{path}", content=body, headers=headers, timeout=10)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    assert set(r.json()) == {"error"}
    return r.json()["error"]


def test_hot_route_answered_before_the_app_with_the_same_checks(served: tuple[str, list]) -> None:
    base, observed = served
    r = post(base, "/echo", b'{"n":5}')
    assert (
        r.status_code == 200 and r.json() == {"fast": True, "n": 5} and r.headers["content-type"] == "application/json"
    )
    assert observed and observed[-1][:2] == ("/echo", 200) and observed[-1][2] >= 0
    assert post(base, "/slow_echo", b'{"n":5}').json() == {"fast": False, "n": 5}  # same handler shape via Starlette
    # JSON content types read_json accepts, and nothing else (415 before anything is read)
    assert post(base, "/echo", b'{"n":1}', "application/json; charset=utf-8").status_code == 200
    assert post(base, "/echo", b'{"n":1}', "application/vnd.kv+json").status_code == 200
    assert (
        error_of(post(base, "/echo", b'{"n":1}', None), 415) == "Expected request with `Content-Type: application/json`"
    )
    assert error_of(post(base, "/echo", b'{"n":1}', "text/plain"), 415) == error_of(
        post(base, "/slow_echo", b'{"n":1}', "text/plain"), 415
    )
    # 400 malformed, 422 wrong shape, handler errors: same messages as the Starlette route
    for body, status in ((b'{"n":', 400), (b'{"n":"x"}', 422), (b"[]", 422)):
        assert error_of(post(base, "/echo", body), status) == error_of(post(base, "/slow_echo", body), status)
    assert error_of(post(base, "/echo", b'{"n":1,"name":"missing"}'), 404) == "no such name"
    assert observed[-1][:2] == ("/echo", 404)


def test_body_limit_413(base: str) -> None:
    body = b'{"n":7}'
    assert post(base, "/echo", body + b" " * (LIMIT - len(body))).status_code == 200
    too_big = body + b" " * (LIMIT - len(body) + 1)
    msg = error_of(post(base, "/echo", too_big), 413)
    assert (
        msg
        == error_of(post(base, "/slow_echo", too_big), 413)
        == "Failed to buffer the request body: length limit exceeded"
    )
    # 415 wins over 413 (axum's order)
    error_of(post(base, "/echo", too_big, "text/plain"), 415)

    def chunks() -> Iterator[bytes]:  # no content-length: the limit applies while reading
        yield b'{"n":7,'
        for _ in range(LIMIT // 64 + 1):
            yield b" " * 64
        yield b"}"

    r = httpx.post(f"{base}/echo", content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    error_of(r, 413)


def test_everything_else_goes_to_the_app(base: str) -> None:
    r = httpx.get(f"{base}/echo")
    assert error_of(r, 405) == "method not allowed" and "POST" in r.headers["allow"]
    assert httpx.get(f"{base}/list").json() == [1, 2, 3]
    assert error_of(httpx.get(f"{base}/nope"), 404) == "route not found"
    assert error_of(post(base, "/nope", b"{}"), 404) == "route not found"
    assert "server" not in httpx.get(f"{base}/list").headers


# -- raw HTTP/1.1 over one socket -------------------------------------------------------------


def read_response(sock: socket.socket, buf: bytearray, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response from ``sock`` (``buf`` holds bytes already read past the previous one)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {bytes(buf)!r}"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = 0 if head_only or status == 100 else int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    buf[:] = rest[length:]
    return status, headers, rest[:length]


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10)
    return sock.recv(1) == b""


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def hot_request(
    n: int, extra: bytes = b"", content_type: bytes = b"application/json", version: bytes = b"HTTP/1.1"
) -> bytes:
    body = b'{"n":%d}' % n
    return b"POST /echo %s\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
        version,
        content_type,
        len(body),
        extra,
        body,
    )


def test_keep_alive_and_pipelining_keep_order(base: str) -> None:
    with connect(base) as sock:
        buf = bytearray()
        for n in range(3):  # keep-alive: one request after the other on the same connection
            sock.sendall(hot_request(n))
            assert read_response(sock, buf)[::2] == (200, b'{"fast":true,"n":%d}' % n)
        # pipelined in one write: hot, app, hot -> three answers in request order
        sock.sendall(hot_request(10) + b"GET /list HTTP/1.1\r\nhost: x\r\n\r\n" + hot_request(11))
        answers = [read_response(sock, buf)[::2] for _ in range(3)]
        assert answers == [(200, b'{"fast":true,"n":10}'), (200, b"[1,2,3]"), (200, b'{"fast":true,"n":11}')]


def test_chunked_body_continue_head_and_http10(base: str) -> None:
    body = b'{"n":42}'
    with connect(base) as sock:
        buf = bytearray()
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (3, body[:3], len(body) - 3, body[3:])
        )
        assert read_response(sock, buf)[::2] == (200, b'{"fast":true,"n":42}')
        # Expect: 100-continue: the interim answer comes once the route reads the body
        sock.sendall(hot_request(1, b"expect: 100-continue\r\n"))
        assert read_response(sock, buf)[0] == 100
        assert read_response(sock, buf)[::2] == (200, b'{"fast":true,"n":1}')
        # HEAD goes to the app: header block only, held and flushed as one write
        sock.sendall(b"HEAD /list HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, _ = read_response(sock, buf, head_only=True)
        assert status == 200 and headers["content-length"] == "7"
        sock.sendall(hot_request(3))
        assert read_response(sock, buf)[::2] == (200, b'{"fast":true,"n":3}')
    with connect(
        base
    ) as sock:  # refused before the body is read: final answer only, then close (the body may never come)
        buf = bytearray()
        sock.sendall(hot_request(2, b"expect: 100-continue\r\n", content_type=b"text/plain")[:-7])
        status, headers, _ = read_response(sock, buf)
        assert (status, headers["connection"]) == (415, "close")
        assert closed_by_server(sock)
    with connect(base) as sock:  # HTTP/1.0 without keep-alive: answer, then close
        buf = bytearray()
        sock.sendall(hot_request(4, version=b"HTTP/1.0"))
        status, headers, payload = read_response(sock, buf)
        assert (status, payload, headers.get("connection")) == (200, b'{"fast":true,"n":4}', "close")
        assert closed_by_server(sock)


def test_413_closes_and_malformed_is_a_json_400(base: str) -> None:
    with connect(base) as sock:  # declared over the limit: refused at once, connection closed (no draining)
        buf = bytearray()
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n{"
            % (LIMIT + 1)
        )
        status, headers, payload = read_response(sock, buf)
        assert status == 413 and headers["connection"] == "close" and b"length limit exceeded" in payload
        assert closed_by_server(sock)
    with connect(base) as sock:
        buf = bytearray()
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, payload = read_response(sock, buf)
        assert (status, headers["content-type"]) == (400, "application/json")
        assert payload == b'{"error":"Invalid HTTP request received."}'
        assert closed_by_server(sock)
