"""The generation routes answered before Starlette (frontend/app.py GenerationRoutes): a handler's bug is
still an API-shaped 500, everything else goes to the Starlette app."""

from __future__ import annotations

import asyncio

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
