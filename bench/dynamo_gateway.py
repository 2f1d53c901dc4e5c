"""A thin gateway in front of Dynamo's runtime-free selector, so ``bench peers`` can replay through it.

Dynamo 1.6.1 ships ``python -m dynamo.select_service``: workers' ZMQ KV events in, worker choices out over
HTTP; a gateway does the rest, as Dynamo documents for gateways. This one does only that: it starts the
selector (its child, so the router's CPU is this process tree), registers the engines, and for each
OpenAI request tokenizes the prompt (the engines' tokenizer), asks ``POST /select_and_reserve``, sends
the request to the chosen engine, reports ``POST /reservations/{id}/prefill_complete`` on the first
streamed chunk and ``DELETE /reservations/{id}`` at the end (or when the client goes away).

    python -m bench.dynamo_gateway --port 8080 --block-size 32 \\
        --worker id=1,url=http://127.0.0.1:8001,kv_events_endpoint=tcp://127.0.0.1:5557[,replay_endpoint=...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute_common.ports import free_port
from kvroute_common.tokenizer import chat_request_prompt, completion_prompt_token_ids, load_tokenizer


def parse_worker(spec: str) -> dict[str, Any]:
    """``id=1,url=http://...,kv_events_endpoint=tcp://...[,replay_endpoint=tcp://...]`` -> a /workers body."""
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if "id" not in fields or "url" not in fields:
        raise ValueError(f"--worker {spec!r}: give id=N,url=URL[,kv_events_endpoint=...][,replay_endpoint=...]")
    body: dict[str, Any] = {"worker_id": int(fields["id"]), "endpoint": fields["url"]}
    for key in ("kv_events_endpoint", "replay_endpoint"):
        if fields.get(key):
            body[key] = fields[key]
    return body


class Gateway:
    """The selector process, its HTTP client and the engines' tokenizer."""

    def __init__(self, workers: list[dict[str, Any]], block_size: int) -> None:
        self.workers, self.block_size = workers, block_size
        self.tokenizer = load_tokenizer(None)
        self.selector_port = free_port()
        self.selector = f"http://127.0.0.1:{self.selector_port}"
        self.proc: subprocess.Popen | None = None
        self.http: httpx.AsyncClient | None = None

    def start_selector(self) -> None:
        env = dict(os.environ, DYN_ROUTER_TEMPERATURE="0")
        cmd = [sys.executable, "-m", "dynamo.select_service", "--port", str(self.selector_port)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.selector}/health", timeout=2).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dynamo.select_service did not start")
            time.sleep(0.1)
        for w in self.workers:
            r = httpx.post(f"{self.selector}/workers", json={**w, "block_size": self.block_size}, timeout=10)
            if r.status_code != 201:
                raise RuntimeError(f"the selector refused worker {w}: {r.status_code} {r.text}")

    def token_ids(self, path: str, body: dict) -> list[int]:
        if path.endswith("/chat/completions"):
            return chat_request_prompt(self.tokenizer, body, None)[0]
        return completion_prompt_token_ids(self.tokenizer, body.get("prompt"))


def build_app(gw: Gateway) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=512)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as http:
            gw.http = http
            yield

    async def generate(request: Request) -> Response:
        assert gw.http is not None
        try:
            body = json.loads(await request.body())
            tokens = gw.token_ids(request.url.path, body)
        except (ValueError, TypeError, KeyError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}", "type": "BadRequestError"}}, 400)
        pick = await gw.http.post(f"{gw.selector}/select_and_reserve", json={"token_ids": tokens})
        if pick.status_code != 200:
            return JSONResponse({"error": {"message": f"selector: {pick.text}", "type": "ServiceUnavailable"}}, 503)
        choice = pick.json()
        selection, endpoint = choice["selection_id"], choice["endpoint"]
        upstream = gw.http.build_request("POST", f"{endpoint}{request.url.path}", json=body)
        try:
            resp = await gw.http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            await gw.http.delete(f"{gw.selector}/reservations/{selection}")
            return JSONResponse({"error": {"message": f"engine: {exc!r}", "type": "ServiceUnavailable"}}, 502)

        async def relay() -> AsyncIterator[bytes]:
            first = True
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        first = False
                        await gw.http.post(f"{gw.selector}/reservations/{selection}/prefill_complete")  # type: ignore[union-attr]
                    yield chunk
            finally:
                await resp.aclose()
                await gw.http.delete(f"{gw.selector}/reservations/{selection}")  # type: ignore[union-attr]

        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), status_code=resp.status_code, media_type=media)

    async def models(request: Request) -> Response:
        assert gw.http is not None
        r = await gw.http.get(f"{gw.workers[0]['endpoint']}/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:  # the selector exports none; an empty exposition
        return Response(b"", media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dynamo_gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--worker", action="append", required=True, help="id=N,url=URL,kv_events_endpoint=...")
    args = p.parse_args(argv)
    try:
        workers = [parse_worker(w) for w in args.worker]
    except ValueError as exc:
        p.error(str(exc))
    gw = Gateway(workers, args.block_size)
    gw.start_selector()
    import uvicorn

    try:
        uvicorn.run(build_app(gw), host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        if gw.proc is not None:
            gw.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                gw.proc.wait(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
