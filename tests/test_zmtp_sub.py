"""kvroute_common/zmtp_sub.py against real libzmq publishers (pyzmq PUB sockets) on loopback, and against
peers that break the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from kvroute_common.zmtp_sub import ZmtpSubscriber, supported
from support import free_ports, until


def _pub(ctx: zmq.Context, endpoint: str, **opts: int) -> zmq.Socket:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        pub.setsockopt(getattr(zmq, name), value)
    pub.bind(endpoint)
    return pub


@dataclass
class Pair:
    ctx: zmq.Context
    endpoint: str
    pub: zmq.Socket
    sub: ZmtpSubscriber
    got: list[Any] = field(default_factory=list)
    runner: asyncio.Future[None] | None = None  # the subscriber's run()

    async def subscribed(self) -> None:
        """Publish a marker until one arrives (a PUB drops what it sends before the subscription)."""

        def seen() -> bool:
            if not self.got:
                self.pub.send_multipart([b"marker"])
            return bool(self.got)

        await until(seen, what="the subscription")
        self.got.clear()


@contextlib.asynccontextmanager
async def pair(
    handle: Callable[[list[bytes]], Awaitable[None] | None] | None = None,
    endpoint: str | None = None,
    pub_opts: dict[str, int] | None = None,
    **sub_kw: Any,
) -> AsyncIterator[Pair]:
    """A real PUB socket and a running subscriber of it (``handle`` default: collect into ``got``)."""
    ctx = zmq.Context()
    endpoint = endpoint or f"tcp://127.0.0.1:{free_ports(1)[0]}"
    got: list[Any] = []
    sub = ZmtpSubscriber(endpoint, handle or got.append, **sub_kw)
    runner = asyncio.ensure_future(sub.run())
    p = Pair(ctx, endpoint, _pub(ctx, endpoint, **(pub_opts or {})), sub, got, runner)
    try:
        yield p
    finally:
        runner.cancel()
        await asyncio.wait([runner])
        ctx.destroy(linger=0)


def test_endpoints_it_reads() -> None:
    assert supported("tcp://127.0.0.1:5557") and supported("tcp://[::1]:5557") and supported("tcp://engine-0:5557")
    assert supported("ipc:///tmp/kv.sock")
    assert not supported("inproc://kv") and not supported("tcp://*:5557") and not supported("tcp://host")


def test_messages_arrive_whole_and_in_order_long_and_empty_frames_included() -> None:
    async def main() -> None:
        async with pair() as p:
            await p.subscribed()
            sent = [[b"topic", i.to_bytes(8, "big"), bytes([i % 251]) * (i * 97)] for i in range(200)]
            sent.append([b"", b"", b"x" * 300_000])  # empty frames and a long (8-byte size) frame
            for msg in sent:
                p.pub.send_multipart(msg)
            await until(lambda: len(p.got) == len(sent), what="all messages")
            assert p.got == sent

    asyncio.run(main())


def test_ipc_endpoint() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            async with pair(endpoint=f"ipc://{d}/kv.sock") as p:
                await p.subscribed()
                p.pub.send_multipart([b"a", b"b"])
                await until(lambda: p.got == [[b"a", b"b"]], what="the message")

    asyncio.run(main())


def test_a_restarted_publisher_is_connected_again() -> None:
    async def main() -> None:
        async with pair() as p:
            await p.subscribed()
            p.pub.close()
            await until(lambda: p.sub._conn is None, what="the connection to end")
            p.pub = _pub(p.ctx, p.endpoint)
            await p.subscribed()
            assert p.sub.connections >= 2
            p.pub.send_multipart([b"after"])
            await until(lambda: p.got == [[b"after"]], what="a message from the new publisher")

    asyncio.run(main())


def test_publisher_heartbeats_are_answered_and_the_connection_stays() -> None:
    """libzmq drops a peer that does not answer its PINGs within HEARTBEAT_TIMEOUT."""

    async def main() -> None:
        async with pair(pub_opts={"HEARTBEAT_IVL": 50, "HEARTBEAT_TIMEOUT": 200}) as p:
            await p.subscribed()
            deadline = time.monotonic() + 1.0  # five heartbeat timeouts
            await until(lambda: time.monotonic() > deadline, what="the heartbeat window")
            assert p.sub.connections == 1
            p.pub.send_multipart([b"still"])
            await until(lambda: p.got == [[b"still"]], what="a message after the window")

    asyncio.run(main())


def test_a_quiet_publisher_answers_our_pings_and_the_connection_stays() -> None:
    """Our PING is well formed: libzmq answers it with PONG (a malformed command would drop us), and the
    PONGs keep a publisher with nothing to send from looking dead."""

    async def main() -> None:
        async with pair(heartbeat_ivl=0.05, heartbeat_timeout=0.3) as p:
            await p.subscribed()
            deadline = time.monotonic() + 1.5  # five of our heartbeat timeouts without a message
            await until(lambda: time.monotonic() > deadline, what="the quiet window")
            assert p.sub.connections == 1
            p.pub.send_multipart([b"awake"])
            await until(lambda: p.got == [[b"awake"]], what="a message after the quiet window")

    asyncio.run(main())


def test_held_messages_wait_for_release_and_none_is_lost() -> None:
    async def main() -> None:
        async with pair(held=True) as p:
            sub = p.sub
            await until(lambda: sub._conn is not None and sub._conn.ready, what="the handshake")
            sent = 0
            while not sub.queue:  # until the subscription reached the publisher
                p.pub.send_multipart([b"early", sent.to_bytes(4, "big")])
                sent += 1
                await asyncio.sleep(0.01)
                assert sent < 1000
            n = len(sub.queue)
            assert p.got == []
            sub.release()
            await until(lambda: len(p.got) >= n, what="the held messages")
            seqs = [int.from_bytes(m[1], "big") for m in p.got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, none lost

    asyncio.run(main())


def test_messages_received_before_a_connection_ends_are_still_handed_on() -> None:
    async def main() -> None:
        async with pair() as p:
            await p.subscribed()
            p.sub.held = True  # as while an awaitable runs: messages queue
            for i in range(5):
                p.pub.send_multipart([b"%d" % i])
            await until(lambda: len(p.sub.queue) == 5, what="the messages queued")
            p.pub.close()
            await until(lambda: p.sub._conn is None, what="the connection to end")
            p.sub.release()
            await until(lambda: len(p.got) == 5, what="the queued messages")
            assert p.got == [[b"%d" % i] for i in range(5)]

    asyncio.run(main())


def test_an_awaitable_from_the_handler_holds_later_messages_and_the_loop_gets_turns() -> None:
    async def main() -> None:
        got: list[list[bytes]] = []
        gate = asyncio.Event()
        bursts: list[int] = []

        def handle(frames: list[bytes]) -> Awaitable[None] | None:
            got.append(frames)
            return gate.wait() if frames == [b"slow"] else None

        async with pair(handle, on_burst=bursts.append, batch=3) as p:
            p.got = got
            await p.subscribed()
            p.pub.send_multipart([b"slow"])
            for i in range(9):
                p.pub.send_multipart([b"m%d" % i])
            await until(lambda: len(p.sub.queue) == 9, what="the rest queued")
            assert got == [[b"slow"]]
            gate.set()
            await until(lambda: len(got) == 10, what="the rest")
            assert got == [[b"slow"]] + [[b"m%d" % i] for i in range(9)]
            assert max(bursts) <= 3  # at most `batch` messages a turn

    asyncio.run(main())


def test_after_a_turn_that_ran_out_of_time_the_loop_is_left_alone_as_long() -> None:
    """A burst of slow messages (a long prompt's per-step batches) is handled a turn at a time, and a turn
    that ran out of time is followed by a pause as long as it took: a request's next step on the loop does
    not wait behind the next batch at every step (kvroute_common.loop_turns)."""
    spin = 0.006  # longer than a turn: every message ends one

    async def main() -> None:
        gate = asyncio.Event()
        spans: list[tuple[float, float]] = []
        ticks: list[float] = []

        def handle(frames: list[bytes]) -> Awaitable[None] | None:
            if frames == [b"marker"]:
                p.got.append(frames)
                return None
            if frames == [b"hold"]:
                return gate.wait()
            start = time.perf_counter()
            while time.perf_counter() - start < spin:
                pass
            spans.append((start, time.perf_counter()))
            return None

        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0)

        async with pair(handle) as p:
            await p.subscribed()
            p.pub.send_multipart([b"hold"])
            for i in range(4):
                p.pub.send_multipart([b"m%d" % i])
            await until(lambda: len(p.sub.queue) == 4, what="the burst queued")
            tick = asyncio.ensure_future(ticker())
            try:
                gate.set()
                await until(lambda: len(spans) == 4, what="the burst handled")
            finally:
                tick.cancel()
        for (start, end), (next_start, _) in itertools.pairwise(spans):
            assert next_start - end >= 0.7 * (end - start), spans  # the pause, within the timer's granularity
            assert sum(end < t < next_start for t in ticks) >= 2, "the loop ran other callbacks in the pause"

    asyncio.run(main())


def test_once_run_is_cancelled_nothing_more_is_handed_on_and_a_running_awaitable_is_cancelled() -> None:
    """The listener's owner clears the worker's blocks after stopping it: a replay still running, or a
    batch still queued, must not reach the index afterwards."""

    async def main() -> None:
        got: list[list[bytes]] = []
        stopped: list[str] = []

        async def replay() -> None:
            try:
                await asyncio.Event().wait()  # a replay that has not answered yet
            finally:
                stopped.append("replay")

        def handle(frames: list[bytes]) -> Awaitable[None] | None:
            got.append(frames)
            return replay() if frames == [b"gap"] else None

        async with pair(handle) as p:
            p.got = got
            await p.subscribed()
            p.pub.send_multipart([b"gap"])
            p.pub.send_multipart([b"after"])
            await until(lambda: len(p.sub.queue) == 1, what="a batch queued behind the replay")
            assert p.runner is not None
            p.runner.cancel()
            await asyncio.wait([p.runner])
            assert stopped == ["replay"]  # cancelled, and finished before run returned
            assert got == [[b"gap"]] and not p.sub.queue
            p.sub.queue.append([b"late"])
            p.sub.kick()
            p.sub.release()
            await asyncio.sleep(0)  # one loop turn: a delivery scheduled by release() would run in it
            assert got == [[b"gap"]]

    asyncio.run(main())


def test_a_failing_handler_ends_run_with_its_exception() -> None:
    async def main() -> None:
        def handle(frames: list[bytes]) -> None:
            raise RuntimeError("handler broke")

        (port,) = free_ports(1)
        ctx = zmq.Context()
        pub = _pub(ctx, f"tcp://127.0.0.1:{port}")
        runner = asyncio.ensure_future(ZmtpSubscriber(f"tcp://127.0.0.1:{port}", handle).run())

        def ended() -> bool:
            pub.send_multipart([b"x"])  # until the subscription is in, a PUB drops what it sends
            return runner.done()

        try:
            await until(ended, what="run to end")
            with pytest.raises(RuntimeError, match="handler broke"):
                runner.result()
        finally:
            runner.cancel()
            ctx.destroy(linger=0)

    asyncio.run(main())


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_PUB_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return bytes([4, len(body)]) + body


@contextlib.asynccontextmanager
async def fake_peer(serve: Serve, **sub_kw: Any) -> AsyncIterator[ZmtpSubscriber]:
    """A subscriber of a TCP server that is not libzmq: ``serve`` plays the publisher."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    sub = ZmtpSubscriber(f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}", lambda f: None, **sub_kw)
    runner = asyncio.ensure_future(sub.run())
    try:
        yield sub
    finally:
        runner.cancel()
        await asyncio.wait([runner])
        server.close()


def _answering(reply: bytes, accepted: list[int]) -> Serve:
    """A peer that answers every connection with ``reply`` and then stays silent."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.write(reply)
        with contextlib.suppress(ConnectionError):
            while await reader.read(1 << 16):  # until the subscriber closes
                pass
        writer.close()

    return serve


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\n" + bytes(64),  # not ZMTP
        _PUB_GREETING + _ready(b"PULL"),  # not a publisher
        _PUB_GREETING + _ready(b"PUB") + b"\x02" + (1 << 40).to_bytes(8, "big"),  # a frame over the limit
        _PUB_GREETING + b"\x00\x01x",  # a message before the handshake
    ],
    ids=["not-zmtp", "not-a-publisher", "oversized-frame", "message-before-ready"],
)
def test_a_peer_that_breaks_the_protocol_is_dropped_and_tried_again(reply: bytes) -> None:
    async def main() -> None:
        accepted: list[int] = []
        async with fake_peer(_answering(reply, accepted), reconnect_ivl=0.01, reconnect_ivl_max=0.05) as sub:
            await until(lambda: len(accepted) >= 3, what="connections made again")
            assert not sub.queue

    asyncio.run(main())


def test_a_silent_peer_is_dropped_after_the_heartbeat_timeout() -> None:
    async def main() -> None:
        accepted: list[int] = []
        serve = _answering(_PUB_GREETING + _ready(b"PUB"), accepted)  # then never a byte
        async with fake_peer(serve, heartbeat_ivl=0.05, heartbeat_timeout=0.2):
            await until(lambda: len(accepted) >= 2, what="a new connection after the silence")

    asyncio.run(main())


def test_a_zmtp_3_0_publisher_gets_its_subscription_as_a_message() -> None:
    async def main() -> None:
        received = bytearray()
        greeted = asyncio.Event()
        got: list[list[bytes]] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(_PUB_GREETING[:11] + b"\x00" + _PUB_GREETING[12:] + _ready(b"PUB"))
            while len(received) < 64 + len(_ready(b"SUB")) + 3:
                data = await reader.read(1 << 16)
                if not data:
                    break
                received.extend(data)
            greeted.set()
            writer.write(b"\x01\x01a\x00\x01b")  # a two-frame message
            with contextlib.suppress(ConnectionError):
                await reader.read()
            writer.close()

        async with fake_peer(serve) as sub:
            sub.handle = got.append
            await asyncio.wait_for(greeted.wait(), 10)
            assert bytes(received[64:]) == _ready(b"SUB") + b"\x00\x01\x01"  # READY, then subscribe to all
            await until(lambda: got == [[b"a", b"b"]], what="the message")

    asyncio.run(main())
