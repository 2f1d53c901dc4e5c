"""Streaming pass-through: every chunk reaches the client before the worker produces the next one.

The worker is a tiny in-process OpenAI-style server whose stream advances only when the test says
so; the frontend is the real `python -m frontend` process. If the proxy buffered anything (or sat on
a chunk waiting for more bytes), the client's read of chunk i would time out, because chunk i+1 is
not produced until chunk i has been read.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from support import free_ports, service, wait_until

MODEL = "gated-model"
BULK_TOKENS = 1000  # a request for at least this many tokens gets them at once, ungated


class GatedWorker:
    """An OpenAI-ish worker in a background thread; ``step()`` lets its current stream emit one chunk."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: asyncio.Queue | None = None
        self.seen_ranks: list[str | None] = []
        self.disconnected = threading.Event()
        self.bulk_done = threading.Event()
        self.health_status = 200
        app = Starlette(
            routes=[
                Route("/health", lambda r: PlainTextResponse("", status_code=self.health_status)),
                Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": [{"id": MODEL}]})),
                Route(
                    "/metrics",
                    lambda r: PlainTextResponse('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'),
                ),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.gate = asyncio.Queue()
        self.loop.run_until_complete(self.server.serve())

    async def chat(self, request: Request):
        body = await request.json()
        self.seen_ranks.append(request.headers.get("x-data-parallel-rank"))
        n = body.get("max_tokens", 3)
        if n >= BULK_TOKENS:
            return StreamingResponse(self.bulk(n), media_type="text/event-stream")

        async def gen():
            try:
                for i in range(n):
                    await self.gate.get()
                    chunk = {
                        "object": "chat.completion.chunk",
                        "model": MODEL,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": f"t{i}"},
                                "finish_reason": None if i < n - 1 else "length",
                            }
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnected.set()
                raise

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def bulk(self, n: int):
        """``n`` ungated chunks of ~4 KB, numbered, as fast as the connection takes them."""
        pad = "x" * 4000
        for i in range(n):
            chunk = {
                "object": "chat.completion.chunk",
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": f"<{i}>{pad}"}, "finish_reason": None}],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        self.bulk_done.set()

    def step(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.gate.put_nowait, None)

    def __enter__(self) -> GatedWorker:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, what="gated worker")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def frontend_and_worker():
    wport, fport = free_ports(2)
    with GatedWorker(wport) as worker:
        args = [
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(fport),
            "--router-mode",
            "kv",
            "--worker",
            f"id=5,url=http://127.0.0.1:{wport}",
            "--health-check-interval",
            "0.5",
            "--log-level",
            "warning",
        ]
        with service(args, ready_url=f"http://127.0.0.1:{fport}/health", timeout=90):
            wait_until(
                lambda: httpx.get(f"http://127.0.0.1:{fport}/health").status_code == 200, 60, what="frontend ready"
            )
            yield f"http://127.0.0.1:{fport}", worker


def test_each_chunk_is_forwarded_before_the_next_exists(frontend_and_worker) -> None:
    url, worker = frontend_and_worker
    body = {"model": MODEL, "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=httpx.Timeout(10.0)) as client:  # a buffered chunk would hit this read timeout
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["x-data-parallel-rank"] == "0"
            it = resp.iter_raw()
            for i in range(5):
                worker.step()
                chunk = next(it)
                assert f'"t{i}"'.encode() in chunk and chunk.endswith(b"\n\n")
            assert b"[DONE]" in chunk + b"".join(it)  # [DONE] follows t4 at once (same or next chunk)
    assert worker.seen_ranks[-1] == "0"
    loads = httpx.get(url + "/loads").json()
    assert [(r["active_prefill_tokens"], r["active_decode_blocks"]) for r in loads] == [(0, 0)]


def test_a_client_that_stops_reading_gets_every_byte_in_order(frontend_and_worker) -> None:
    """A 16 MB stream to a client that reads nothing until the worker has sent all of it: the
    relay outruns the client's socket, waits for it, and loses, reorders or repeats nothing."""
    url, worker = frontend_and_worker
    worker.bulk_done.clear()
    n = 4000
    body = {"model": MODEL, "stream": True, "max_tokens": n, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert worker.bulk_done.wait(60)  # everything sent upstream while the client read nothing
            data = resp.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    contents = [json.loads(e[len(b"data: ") :])["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert [c[: c.index(">") + 1] for c in contents] == [f"<{i}>" for i in range(n)]
    assert all(len(c) == len(f"<{i}>") + 4000 for i, c in enumerate(contents))
    wait_until(
        lambda: (
            [(r["active_prefill_tokens"], r["active_decode_blocks"]) for r in httpx.get(url + "/loads").json()]
            == [(0, 0)]
        ),
        30,
        what="the stream's booking freed",
    )


def test_client_leaving_mid_stream_aborts_the_worker_request(frontend_and_worker) -> None:
    url, worker = frontend_and_worker
    worker.disconnected.clear()
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "a longer question " * 20}],
    }
    with httpx.Client(timeout=10.0) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            worker.step()
            it = resp.iter_raw()  # keep the iterator: dropping it would close the stream here
            assert b'"t0"' in next(it)
            loads = httpx.get(url + "/loads").json()
            assert loads[0]["active_decode_blocks"] > 0
    # the client is gone while the worker waits for its next step: the frontend frees the load
    # and closes the worker connection, which cancels the worker's stream
    wait_until(lambda: httpx.get(url + "/loads").json()[0]["active_decode_blocks"] == 0, 30, what="load freed")
    assert worker.disconnected.wait(30)


def test_failing_health_checks_take_the_worker_out_and_back(frontend_and_worker) -> None:
    url, worker = frontend_and_worker
    body = {"model": MODEL, "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    def healthy() -> bool:
        return httpx.get(url + "/health").json()["instances"][0]["healthy"]

    worker.health_status = 503
    try:
        wait_until(lambda: not healthy(), 30, what="worker marked unhealthy after failed checks")
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert httpx.get(url + "/health").status_code == 503
        assert "503" in httpx.get(url + "/admin/workers").json()["workers"][0]["last_error"]
    finally:
        worker.health_status = 200
    wait_until(healthy, 30, what="worker healthy again")
    worker.step()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and b'"t0"' in r.read()
