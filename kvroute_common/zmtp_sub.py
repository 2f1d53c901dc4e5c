"""A ZMQ SUB socket spoken on the event loop: ZMTP 3.1 with the NULL mechanism, for the KV-event listener.

Why: a libzmq socket receives in its own I/O thread and hands each message to the loop through a
mailbox (a thread switch, a ``poll`` and a ``getpid`` per read). An engine publishes a batch per step,
so on a router alone on a core that hand-over was ~7 % of its CPU a request (docs/benchmarks.md).
Here the engine's TCP (or Unix) connection is read by the loop itself, like any other connection.

What it speaks (https://rfc.zeromq.org/spec/37/): the 64-byte greeting, the NULL handshake (a READY
command each way; the peer must be a PUB or XPUB), a SUBSCRIBE command for every topic once the
peer's READY is in (libzmq drops a peer that sends anything before it), then frames: a flags byte
(MORE 1, LONG 2, COMMAND 4) and a 1- or 8-byte size. Commands: PING is answered with PONG, ERROR
ends the connection; the rest are ignored. What libzmq did for the SUB socket it replaces: reconnect
with a doubling interval (0.1 s up to 5 s), heartbeats (a PING every 5 s; 15 s without a byte from
the peer closes the connection), no receive limit (messages wait in memory while the owner holds them).
A frame above ``max_frame_bytes`` is a protocol error (the connection is dropped and made again).

Reading is fair to the loop: after ``batch`` messages or ``turn_seconds`` of handling, the loop's other
callbacks run before the rest is handled, after a pause if the turn ran out of time
(``kvroute_common.loop_turns``). ``handle`` returns None, or an awaitable for the rare message
that needs one: nothing after that message is handled until it is done. An exception from ``handle``
(or its awaitable) ends ``run``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import cast

from kvroute_common.loop_turns import BATCH, TURN_SECONDS, next_turn

log = logging.getLogger("kvroute_common.zmtp_sub")

RECONNECT_IVL = 0.1
RECONNECT_IVL_MAX = 5.0
HEARTBEAT_IVL = 5.0
HEARTBEAT_TIMEOUT = 15.0
MAX_FRAME_BYTES = 1 << 30

_GREETING = (
    b"\xff" + bytes(8) + b"\x7f"  # signature
    + b"\x03\x01"  # version 3.1
    + b"NULL".ljust(20, b"\x00")  # mechanism
    + b"\x00"  # as-server: no
    + bytes(31)  # filler
)  # fmt: skip
_MORE, _LONG, _COMMAND = 1, 2, 4
_PEER_TYPES = (b"PUB", b"XPUB")
_TCP = re.compile(r"^tcp://(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]/*]+)):(?P<port>\d{1,5})$")


class ProtocolError(Exception):
    """The peer broke ZMTP (or is not a publisher): the connection is dropped and made again."""


def _command(name: bytes, data: bytes = b"") -> bytes:
    body = bytes([len(name)]) + name + data
    if len(body) > 255:
        return bytes([_COMMAND | _LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([_COMMAND, len(body)]) + body


_READY = _command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB")


def _properties(data: bytes) -> dict[bytes, bytes]:
    """A READY command's metadata: name (1-byte length) and value (4-byte length) pairs."""
    out: dict[bytes, bytes] = {}
    i, n = 0, len(data)
    while i < n:
        k = data[i]
        name = data[i + 1 : i + 1 + k]
        i += 1 + k
        if i + 4 > n:
            raise ProtocolError("READY metadata is cut short")
        size = int.from_bytes(data[i : i + 4], "big")
        value = data[i + 4 : i + 4 + size]
        if len(name) != k or len(value) != size:
            raise ProtocolError("READY metadata is cut short")
        out[name.lower()] = value
        i += 4 + size
    return out


def supported(endpoint: str) -> bool:
    """Whether ``endpoint`` is one this reader connects to (``tcp://host:port``, ``ipc://path``)."""
    return _TCP.match(endpoint) is not None or (endpoint.startswith("ipc://") and len(endpoint) > 6)


class _Connection(asyncio.Protocol):
    """One connection: bytes are parsed as they arrive (the handshake and commands at once) and whole
    messages go to the owner's queue. ``closed`` resolves when the connection ends."""

    def __init__(self, owner: ZmtpSubscriber) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.greeted = False
        self.ready = False  # the peer's READY arrived (the handshake is done)
        self.minor = 1  # the peer's ZMTP minor version (3.0 peers subscribe by message, know no PING)
        self.frames: list[bytes] = []  # the message being assembled
        self.last_rx = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.write(_GREETING + _READY)
        self.timer = self.loop.call_later(self.owner.heartbeat_ivl, self._heartbeat)

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.loop.time()
        buf = self.buf
        buf += data
        owner = self.owner
        queued = len(owner.queue)
        try:
            used = self._parse(buf)
        except ProtocolError as exc:
            log.warning("KV events from %s: %s; connecting again", owner.endpoint, exc)
            self.abort()
            return
        if used:
            del buf[:used]
        if len(owner.queue) > queued:
            owner.kick()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.closed.done():
            self.closed.set_result(None)

    def abort(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.transport.abort()
        if not self.closed.done():
            self.closed.set_result(None)

    # -- the protocol
    def _parse(self, buf: bytearray) -> int:
        """Queue the whole messages in ``buf`` and act on its commands; returns the bytes used."""
        pos = 0
        if not self.greeted:
            if len(buf) < 64:
                return 0
            self._check_greeting(bytes(buf[:64]))
            pos = 64
            self.greeted = True
        end = len(buf)
        frames = self.frames
        queue = self.owner.queue
        limit = self.owner.max_frame_bytes
        while end - pos >= 2:
            flags = buf[pos]
            if flags & _LONG:
                if end - pos < 9:
                    break
                size = int.from_bytes(buf[pos + 1 : pos + 9], "big")
                start = pos + 9
            else:
                size = buf[pos + 1]
                start = pos + 2
            if size > limit:
                raise ProtocolError(f"a frame of {size} bytes (the limit is {limit})")
            stop = start + size
            if stop > end:
                break
            body = bytes(buf[start:stop])
            pos = stop
            if flags & _COMMAND:
                self._command(body)
                continue
            if not self.ready:
                raise ProtocolError("a message before the handshake")
            frames.append(body)
            if not flags & _MORE:
                queue.append(frames)
                frames = self.frames = []
        return pos

    def _check_greeting(self, g: bytes) -> None:
        if g[0] != 0xFF or g[9] & 1 != 1:
            raise ProtocolError("not a ZMTP peer")
        if g[10] < 3:
            raise ProtocolError(f"ZMTP {g[10]}.{g[11]} (3.0 or newer is spoken here)")
        self.minor = g[11] if g[10] == 3 else 1
        mechanism = g[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ProtocolError(f"security mechanism {mechanism!r} (only NULL is spoken here)")

    def _command(self, body: bytes) -> None:
        if not body:
            raise ProtocolError("an empty command")
        k = body[0]
        name, data = body[1 : 1 + k], body[1 + k :]
        assert self.transport is not None
        if name == b"READY":
            peer = _properties(data).get(b"socket-type")
            if peer not in _PEER_TYPES:
                raise ProtocolError(f"the peer is a {peer!r} socket, not a publisher")
            self.ready = True
            # every topic: ZMTP 3.1's command, 3.0's message (a 1 byte, then the topic)
            self.transport.write(_command(b"SUBSCRIBE") if self.minor >= 1 else b"\x00\x01\x01")
        elif name == b"PING":
            if len(data) < 2:
                raise ProtocolError("a PING without its TTL")
            self.transport.write(_command(b"PONG", data[2:18]))
        elif name == b"ERROR":
            reason = data[1 : 1 + data[0]] if data else b""
            raise ProtocolError(f"the peer sent ERROR {reason!r}")

    def _heartbeat(self) -> None:
        owner = self.owner
        if self.closed.done() or self.transport is None:
            return
        if self.loop.time() - self.last_rx > owner.heartbeat_timeout:
            silent = owner.heartbeat_timeout
            log.warning("KV events from %s: nothing for %g s; connecting again", owner.endpoint, silent)
            self.abort()
            return
        if self.ready and self.minor >= 1:
            ttl = int(owner.heartbeat_timeout * 10).to_bytes(2, "big")  # deciseconds
            self.transport.write(_command(b"PING", ttl))
        self.timer = self.loop.call_later(owner.heartbeat_ivl, self._heartbeat)


class ZmtpSubscriber:
    """Subscribes to every topic of one ZMQ publisher and hands each message's frames to ``handle``, in
    order; messages received before a connection ends are still handed on.

    ``held``: messages wait (in order, none lost) until ``release()``; the connection is made at once."""

    def __init__(
        self,
        endpoint: str,
        handle: Callable[[list[bytes]], Awaitable[None] | None],
        on_burst: Callable[[int], None] | None = None,
        held: bool = False,
        batch: int = BATCH,
        turn_seconds: float = TURN_SECONDS,
        reconnect_ivl: float = RECONNECT_IVL,
        reconnect_ivl_max: float = RECONNECT_IVL_MAX,
        heartbeat_ivl: float = HEARTBEAT_IVL,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        if not supported(endpoint):
            raise ValueError(f"not a tcp://host:port or ipc://path endpoint: {endpoint}")
        self.endpoint = endpoint
        self.handle = handle
        self.on_burst = on_burst
        self.held = held
        self.batch = batch
        self.turn_seconds = turn_seconds
        self.reconnect_ivl = reconnect_ivl
        self.reconnect_ivl_max = reconnect_ivl_max
        self.heartbeat_ivl = heartbeat_ivl
        self.heartbeat_timeout = heartbeat_timeout
        self.max_frame_bytes = max_frame_bytes
        self.connections = 0  # connections made (reconnects included)
        self.queue: deque[list[bytes]] = deque()  # whole messages not yet handed on
        self._conn: _Connection | None = None
        self._scheduled = False  # a call_soon(_deliver) is pending
        self._waiting: asyncio.Future[None] | None = None  # the task of an awaitable from handle, while it runs
        self._failed: asyncio.Future[BaseException] | None = None  # set when handle fails: run raises it
        self._closed = False  # run has ended: nothing more is handed on (the owner may be clearing its state)

    def release(self) -> None:
        """Stop holding messages: what waited is handed on."""
        self.held = False
        self._schedule()

    def kick(self) -> None:
        """New messages are queued: hand them on now, unless delivery waits."""
        if not self._scheduled and self._waiting is None and not self.held and not self._closed:
            self._deliver()

    def _schedule(self) -> None:
        if self.queue and not self._scheduled and self._waiting is None and not self.held and not self._closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        """Hand queued messages on, within the loop's turn."""
        self._scheduled = False
        if self._waiting is not None or self.held or self._closed or (self._failed is not None and self._failed.done()):
            return
        queue, handle = self.queue, self.handle
        n = 0
        start = time.perf_counter()
        until = start + self.turn_seconds
        try:
            while queue:
                pending = handle(queue.popleft())
                n += 1
                if pending is not None:
                    self._wait(pending)
                    break
                if queue:
                    now = time.perf_counter()
                    if n >= self.batch or now > until:
                        self._scheduled = True
                        next_turn(asyncio.get_running_loop(), self._deliver, now - start, self.turn_seconds)
                        break
        except Exception as exc:  # handle's own failure: run ends with it
            self._fail(exc)
        if n and self.on_burst is not None:
            self.on_burst(n)

    def _wait(self, pending: Awaitable[None]) -> None:
        task = self._waiting = asyncio.ensure_future(pending)

        def done(t: asyncio.Future[None]) -> None:
            if self._waiting is t:
                self._waiting = None
            if self._closed:
                return
            if t.cancelled():
                self._fail(asyncio.CancelledError())
            elif t.exception() is not None:
                self._fail(cast(BaseException, t.exception()))
            else:
                self._schedule()

        task.add_done_callback(done)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(exc)
        if self._conn is not None:
            self._conn.abort()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        m = _TCP.match(self.endpoint)
        if m is not None:
            host = m.group("v6") or m.group("host")
            _, conn = await loop.create_connection(lambda: _Connection(self), host, int(m.group("port")))
        else:
            path = self.endpoint[len("ipc://") :]
            if path.startswith("@"):  # libzmq's name for Linux's abstract socket namespace
                path = "\0" + path[1:]
            _, conn = await loop.create_unix_connection(lambda: _Connection(self), path)
        return conn

    async def run(self) -> None:
        """Connect, and connect again whenever the connection ends, until cancelled; raises what ``handle``
        (or an awaitable it returned) raised. Once it returns, nothing more is handed on: an awaitable still
        running is cancelled (and waited for) and queued messages are dropped."""
        failed = self._failed = asyncio.get_running_loop().create_future()
        wait = self.reconnect_ivl
        try:
            while True:
                try:
                    conn = await self._connect()
                except OSError as exc:
                    log.debug("KV events from %s: %s", self.endpoint, exc)
                    conn = None
                if conn is not None:
                    self.connections += 1
                    self._conn = conn
                    try:
                        await asyncio.wait([conn.closed, failed], return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        self._conn = None
                        conn.abort()
                    if conn.ready:
                        wait = self.reconnect_ivl  # it worked: start again from the shortest interval
                if failed.done():
                    raise failed.result()
                await asyncio.sleep(wait)
                wait = min(wait * 2, self.reconnect_ivl_max)
        finally:
            self._closed = True
            self.queue.clear()
            task, self._waiting = self._waiting, None
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])
