"""The engine gets a request, and the client a first token, before the bookkeeping neither waits for.

The proxy reserves the worker in the slot tracker before it writes a request to its engine; what the
router learns from the decision (decision log, latency mode's footprint, metrics, the parity probe) runs
once the bytes are written (``UpstreamPool.request``'s ``on_sent``), before anything is awaited, so the
next decision still sees it. A first token is written to the client before its bookkeeping (TTFT
metrics, the latency model, the tracker's prefill completion) unless the response rewriter needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from frontend.dispatch.lifecycle import Lease
from frontend.dispatch.proxy import ChunkPipeline, _DirectSink
from frontend.dispatch.stream_dialect import OPENAI
from frontend.dispatch.upstream import UpstreamConnectError, UpstreamPool
from frontend.routing.models import _EMPTY_TRACKER
from support import free_port, wait_until

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


@contextlib.contextmanager
def _server_thread(app: Any) -> Iterator[int]:
    """A uvicorn server on its own thread and loop: it reads what the client wrote while the client's
    loop is held by a callback."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 10, what="test upstream server")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_on_sent_runs_once_when_the_request_is_out_before_its_answer(caplog: pytest.LogCaptureFixture) -> None:
    arrived: list[bytes] = []
    got = [threading.Event(), threading.Event()]
    gate = threading.Event()

    async def slow(request: Request) -> JSONResponse:
        arrived.append(await request.body())
        if len(arrived) <= len(got):
            got[len(arrived) - 1].set()
        await asyncio.to_thread(gate.wait, 10)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])

    async def main(port: int) -> None:
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        try:
            # no idle connection: the callback runs before the connection is awaited (the request is not out)
            seen: list[bool] = []
            pending = asyncio.ensure_future(
                pool.request("POST", "/slow", b'{"n": 1}', [], False, lambda: seen.append(got[0].is_set()))
            )
            await asyncio.to_thread(got[0].wait, 10)
            assert seen == [False] and not pending.done()
            gate.set()
            r = await asyncio.wait_for(pending, 10)
            assert r.status == 200 and arrived == [b'{"n": 1}']

            # a kept-alive connection: the bytes are out when the callback runs (the server, on its own
            # thread, receives them while the callback holds this loop), and the answer is not awaited
            gate.clear()
            seen = []
            pending = asyncio.ensure_future(
                pool.request("POST", "/slow", b"{}", [], False, lambda: seen.append(got[1].wait(10)))
            )
            await asyncio.to_thread(got[1].wait, 10)
            assert seen == [True] and not pending.done()
            gate.set()
            assert (await asyncio.wait_for(pending, 10)).status == 200

            # a callback that raises is logged; the request it followed goes on
            def broken() -> None:
                raise RuntimeError("bookkeeping bug")

            with caplog.at_level(logging.ERROR, logger="frontend.dispatch.upstream"):
                r = await asyncio.wait_for(pool.request("POST", "/slow", b"{}", [], False, broken), 10)
            assert r.status == 200
            assert any("after-send step failed" in rec.message for rec in caplog.records)
        finally:
            gate.set()
            await pool.aclose()

        # nothing listening: the callback still ran once (the booking it records is freed by the caller)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            dead = probe.getsockname()[1]
        calls: list[None] = []
        with pytest.raises(UpstreamConnectError):
            await UpstreamPool(f"http://127.0.0.1:{dead}").request(
                "POST", "/x", b"{}", [], False, lambda: calls.append(None)
            )
        assert len(calls) == 1

    with _server_thread(app) as port:
        asyncio.run(main(port))


class _Listener:
    """A lifecycle listener that notes what the client had been written when each event came."""

    def __init__(self, written: list[bytes]) -> None:
        self.written = written
        self.events: list[tuple[str, int]] = []

    def first_token(self, lease: Lease, ttft: float, now: float, streamed: bool) -> None:
        self.events.append(("first_token", len(self.written)))

    def tokens(self, lease: Lease, n: int, gaps: list[float]) -> None:
        self.events.append(("tokens", n))

    def capacity_changed(self, model: str) -> None:
        self.events.append(("capacity", len(self.written)))

    def cancelled(self, lease: Lease) -> None:
        pass

    def released(self, lease: Lease, duration: float) -> None:
        pass


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, part: bytes) -> bool:
        self.parts.append(part)
        return True


class _TimingRewriter:
    """The nvext timing rewriter's contract: it hears of the first token before it sees the chunk."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def first_token(self) -> None:
        self.log.append("first_token")

    def chunk(self, data: bytes) -> bytes:
        self.log.append("chunk")
        return data


def _lease(listener: _Listener) -> Lease:
    entry = SimpleNamespace(name="m", tracker=_EMPTY_TRACKER, block_size=16)
    decision = SimpleNamespace(isl=10)
    return Lease(listener, entry, "r1", decision, SimpleNamespace(), 0.0)  # type: ignore[arg-type]


def test_the_first_token_reaches_the_client_before_its_bookkeeping() -> None:
    writer = _Writer()
    listener = _Listener(writer.parts)
    lease = _lease(listener)
    sink = _DirectSink(ChunkPipeline(lease, OPENAI, None, None), writer)  # type: ignore[arg-type]
    assert sink(ROLE) and sink(TOKEN)
    assert writer.parts == [ROLE, TOKEN]
    # prefill complete (metrics, tracker, waiting requests) after the token was written, counted once
    assert listener.events[:2] == [("first_token", 2), ("capacity", 2)]
    assert lease.prefilled and lease.tokens_out == 1
    assert sink(TOKEN) and lease.tokens_out == 2 and writer.parts[-1] == TOKEN


def test_a_rewriter_hears_of_the_first_token_before_the_chunk_is_written() -> None:
    writer = _Writer()
    listener = _Listener(writer.parts)
    lease = _lease(listener)
    log: list[str] = []
    sink = _DirectSink(ChunkPipeline(lease, OPENAI, _TimingRewriter(log), None), writer)  # type: ignore[arg-type]
    assert sink(TOKEN)
    assert log == ["first_token", "chunk"]
    assert listener.events[0] == ("first_token", 0)  # before the write, as the rewriter needs it
    assert writer.parts == [TOKEN]


def test_a_failing_routed_record_is_logged_once_and_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    from frontend.dispatch.context import RequestContext

    ctx = RequestContext()
    calls: list[int] = []

    def notes() -> None:
        calls.append(1)
        raise RuntimeError("bookkeeping bug")

    ctx.routed_notes = notes
    with caplog.at_level(logging.ERROR, logger="frontend"):
        ctx.sent()
        ctx.sent()  # once only
    assert calls == [1] and ctx.routed_notes is None
    assert [r.message for r in caplog.records] == ["recording a routed decision failed"]
