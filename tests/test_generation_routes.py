"""The generation routes answered before Starlette (frontend/app.py GenerationRoutes): a handler's bug is
still an API-shaped 500, everything else goes to the Starlette app."""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from frontend.app import GenerationRoutes


async def _broken(request: Request) -> JSONResponse:
    raise RuntimeError("boom")


async def _answer(request: Request) -> JSONResponse:
    return JSONResponse({"path": request.url.path, "body": (await request.body()).decode()})


async def _starlette(request: Request) -> JSONResponse:
    return JSONResponse({"starlette": request.method})


def test_fast_routes_answer_and_errors_keep_the_api_shape() -> None:
    inner = Starlette(routes=[Route("/v1/completions", _starlette, methods=["GET", "POST"])])
    app = GenerationRoutes(inner, {"/v1/completions": _answer, "/v1/chat/completions": _broken,
                                   "/v1/messages": _broken})  # fmt: skip

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [
                await c.post("/v1/completions", content=b'{"x": 1}'),
                await c.get("/v1/completions"),
                await c.post("/v1/chat/completions", json={}),
                await c.post("/v1/messages", json={}),
            ]

    fast, other, broken, broken_messages = asyncio.run(run())
    assert fast.json() == {"path": "/v1/completions", "body": '{"x": 1}'}
    assert other.json() == {"starlette": "GET"}  # not a POST: the Starlette app
    assert broken.status_code == 500 and "boom" in broken.json()["error"]["message"]
    assert broken_messages.status_code == 500 and broken_messages.json()["type"] == "error"  # Anthropic's shape
    assert app.state is inner.state


def test_frontend_protocol_one_write_per_unary_answer_and_openai_shaped_400() -> None:
    """The frontend's HTTP protocol sends a unary answer's header block and body in one socket write,
    and answers an unparsable request with an OpenAI-shaped 400."""
    import socket
    import threading

    import uvicorn

    from frontend.app import FrontendHttpProtocol
    from support import free_port, wait_until

    writes: list[bytes] = []

    class CountingTransport:
        def __init__(self, transport: asyncio.Transport) -> None:
            self._transport = transport

        def write(self, data: bytes) -> None:
            writes.append(bytes(data))
            self._transport.write(data)

        def __getattr__(self, name: str) -> object:
            return getattr(self._transport, name)

    class Counting(FrontendHttpProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CountingTransport(transport))  # type: ignore[arg-type]

    inner = Starlette(routes=[])
    app = GenerationRoutes(inner, {"/v1/completions": _answer})
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning", http=Counting)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30, what="uvicorn started")
        with httpx.Client() as client:
            answer = client.post(f"http://127.0.0.1:{port}/v1/completions", content=b'{"x": 2}')
        assert answer.json() == {"path": "/v1/completions", "body": '{"x": 2}'}
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b'"{\\"x\\": 2}"}')
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):  # the server closes the connection after its answer
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
        error = json.loads(body)
        assert error["error"]["message"] == "Invalid HTTP request received." and error["error"]["code"] == 400
    finally:
        server.should_exit = True
        thread.join(30)
