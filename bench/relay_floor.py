"""``python -m bench.relay_floor``: the cheapest HTTP relay Python can be, as a router row of the benchmarks.

What it is for: a floor. It does what every router's data path must do and nothing else: read a
request, pick a worker in turn, forward the request's bytes as they came on a kept-alive connection,
and hand the response's bytes back as they arrive, on the same event loop kvroute runs (uvloop, the
``httptools`` parser). No tokenizing, no routing, no metrics, no per-chunk parsing. What kvroute
spends above this row is its own work; what this row spends is Python's and the kernel's share of any
router written on this stack.

Not a product: HTTP/1.1 with ``Content-Length`` bodies only, no timeouts, a worker that fails fails
the request (502).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import httptools

BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n"


def _no_delay(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """A stream connection's transport, with small writes sent at once (no Nagle)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport  # type: ignore[return-value]


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to a worker: response bytes go to ``client`` as they arrive; the
    parser only finds where the response ends, so the connection can serve the next request."""

    def __init__(self, pool: deque[_Upstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = _no_delay(transport)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None:
            client.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.client = None
        self.parser = httptools.HttpResponseParser(self)
        self.pool.append(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.close()  # the response was cut: the client sees its connection end


class _Client(asyncio.Protocol):
    """One client connection: each request's bytes, once whole, go to the next worker in turn."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.raw: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = _no_delay(transport)

    def data_received(self, data: bytes) -> None:
        self.raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_complete(self) -> None:
        request, self.raw = b"".join(self.raw), []
        assert self.transport is not None
        asyncio.get_running_loop().create_task(self.relay.forward(request, self.transport))


class Relay:
    """Round robin over ``workers`` (``host:port``), a pool of idle connections each."""

    def __init__(self, workers: Sequence[tuple[str, int]]) -> None:
        self.workers = list(workers)
        self.pools: list[deque[_Upstream]] = [deque() for _ in self.workers]
        self.turn = itertools.cycle(range(len(self.workers)))

    async def forward(self, request: bytes, client: asyncio.Transport) -> None:
        n = next(self.turn)
        pool = self.pools[n]
        if pool:
            up = pool.pop()
        else:
            host, port = self.workers[n]
            try:
                _, up = await asyncio.get_running_loop().create_connection(lambda: _Upstream(pool), host, port)
            except OSError:
                client.write(BAD_GATEWAY)
                return
        up.client = client
        assert up.transport is not None
        up.transport.write(request)


async def serve(host: str, port: int, workers: Sequence[tuple[str, int]]) -> None:
    relay = Relay(workers)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(relay), host, port)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", action="append", required=True, help="a worker's URL (repeat)")
    args = p.parse_args(argv)
    workers = []
    for url in args.worker:
        u = urlsplit(url)
        if u.hostname is None or u.port is None:
            p.error(f"--worker wants http://host:port, not {url!r}")
        workers.append((u.hostname, u.port))
    import uvloop

    uvloop.run(serve(args.host, args.port, workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
