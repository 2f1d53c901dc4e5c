"""``python -m bench.tiny_sender URL``: tiny requests sent open loop from a process of their own.

Why a process of its own, on raw kept-alive HTTP/1.1 connections: the client is part of what a latency
percentile measures. An httpx client on the same event loop as the sender of megabyte prompts spent
~3.5 ms of CPU a tiny request on a 2-vCPU guest and delayed its own timestamps while it sent the big
bodies (a tiny request's p50 through an idle frontend: 6-7 ms with it, 4 ms with this sender). Here a
request is one write of pre-built bytes and one read of the answer.

Protocol (for ``bench.long_context``): after its warm-up requests the process prints ``ready``; it sends a
tiny completion (or chat request, ``--chat``) every ``--interval`` seconds until a line (or EOF) arrives on
stdin (or ``--count`` requests are sent), waits for the requests in flight, and prints one JSON line,
``{"samples": [[sent, ms], ...]}``: ``sent`` is ``time.perf_counter()`` (CLOCK_MONOTONIC: comparable with
the parent's) and ``ms`` the time to the whole answer; with ``--timing`` each sample also has the
frontend's timing split (before, in and after its handler, ms; ``nvext.extra_fields: ["timing"]``). Any
answer other than 200 ends the run with ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit

WARM_REQUESTS = 20


def tiny_body(model: str, text: str, chat: bool, timing: bool) -> tuple[str, bytes]:
    """A tiny request's path and JSON body: a chat request (rendered through the chat template) or a
    completion, one output token; ``timing``: it asks for the frontend's own timestamps."""
    body: dict[str, Any] = {"model": model, "max_tokens": 1}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if timing:
        body["nvext"] = {"extra_fields": ["timing"]}
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send ``request``; the answer's status and body (``content-length`` or chunked)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            return status, await self.reader.readexactly(length)
        parts: list[bytes] = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return status, b"".join(parts)
            parts.append(data[:-2])


class TinySender:
    """Open-loop tiny requests on a pool of kept-alive connections (a new one when all are busy)."""

    def __init__(self, url: str, model: str, chat: bool, timing: bool) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.model, self.chat, self.timing = model, chat, timing
        self.idle: list[_Connection] = []
        self.samples: list[list[float]] = []
        self.error: str | None = None

    def _idle_connection(self) -> _Connection | None:
        """An idle connection the server has not closed (servers close kept-alive ones idle a few seconds)."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.reader.at_eof():
                return conn
            conn.writer.close()
        return None

    async def _exchange(self, request: bytes) -> tuple[_Connection, int, bytes]:
        """One request and its answer on an idle connection, else a new one; sent again on a new connection if
        the server closed the idle one as it was written (the close and the write crossed), as HTTP clients do."""
        conn = self._idle_connection()
        if conn is not None:
            try:
                return conn, *await conn.exchange(request)
            except (ConnectionResetError, asyncio.IncompleteReadError) as exc:
                conn.writer.close()
                if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                    raise
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Connection(reader, writer)
        return conn, *await conn.exchange(request)

    async def one(self, k: int, record: bool = True) -> None:
        path, body = tiny_body(self.model, f"hi {k}", self.chat, self.timing)
        request = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        sent, wall = time.perf_counter(), time.time()
        try:
            conn, status, answer = await self._exchange(request)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self.error = self.error or f"tiny request failed: {exc!r}"
            return
        ms = (time.perf_counter() - sent) * 1e3
        self.idle.append(conn)
        if status != 200:
            self.error = self.error or f"tiny request failed: {status} {answer[:200]!r}"
            return
        if not record:
            return
        if self.timing:
            t = json.loads(answer)["nvext"]["timing"]
            before = t["request_received_ms"] - wall * 1e3
            self.samples.append([sent, ms, before, t["total_time_ms"], ms - before - t["total_time_ms"]])
        else:
            self.samples.append([sent, ms])

    async def run(self, interval: float, stop: asyncio.Future[None], count: int | None = None) -> None:
        for i in range(WARM_REQUESTS):
            await self.one(-i - 1, record=False)
            if self.error is not None:
                return
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        tasks = []
        next_t = loop.time()
        k = 0
        while not stop.done() and self.error is None and (count is None or k < count):
            k += 1
            tasks.append(asyncio.create_task(self.one(k)))
            next_t += interval
            await asyncio.wait([stop], timeout=max(0.0, next_t - loop.time()))
        await asyncio.gather(*tasks)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def on_stdin() -> None:
        if not stop.done():
            stop.set_result(None)
        loop.remove_reader(sys.stdin.fileno())

    if args.count is None:
        loop.add_reader(sys.stdin.fileno(), on_stdin)
    sender = TinySender(args.url, args.model, args.chat, args.timing)
    await sender.run(args.interval, stop, args.count)
    if sender.error is not None:
        return {"error": sender.error}
    return {"samples": sender.samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tiny_sender", description=__doc__.split("\n")[0])
    ap.add_argument("url", help="the server's base URL (a frontend or an engine)")
    ap.add_argument("--model", default="kvroute-demo")
    ap.add_argument("--interval", type=float, default=0.01, help="seconds between two requests [0.01]")
    ap.add_argument("--count", type=int, default=None, help="stop after this many requests (stdin is not read)")
    ap.add_argument("--chat", action="store_true", help="chat requests (else completions)")
    ap.add_argument("--timing", action="store_true", help="ask for the frontend's timing and report the split")
    print(json.dumps(asyncio.run(_main(ap.parse_args(argv)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
