"""One asyncio ZMQ SUB listener per registered (instance_id, dp_rank), with gap replay.

A tcp:// or ipc:// publisher is read on the event loop (``kvroute_common.zmtp_sub``); others (inproc://)
through a libzmq SUB socket.

Live messages are ``[topic, seq (8 bytes BE), payload]``. The listener keeps a watermark (last
applied seq) and follows the reference's sequence rules: a first batch with seq > 0, or any later
jump, is a gap; the missing batches are requested over a DEALER from the engine's replay ROUTER
(``[b"", start_seq]``), applied in order, stale ones skipped; a batch that fails to decode is
dropped whole and does not move the watermark.

Engine restarts: a live batch whose seq is at or below the last seq seen *on the live socket* can
only come from a new publisher on the same endpoint (one PUB never goes backwards; batches a replay
already covered are above it), so the engine restarted with an empty cache. The listener then drops
that rank's blocks, forgets the watermark and treats the batch as the first ever (seq > 0: replay
from 0 from the new engine). The 1.6.1 reference skips such batches as stale, which leaves the old
engine's blocks credited until the new sequence passes the old watermark (a restarted engine that publishes past the
old watermark before we reconnect looks like an ordinary gap).

Unlike the 1.6.1 reference, whose replay receive has no timeout (a silent ROUTER wedges that
listener forever), a replay that gets no answer within ``replay_timeout`` is abandoned: the
listener records ``last_error`` and keeps applying live batches.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from indexer.lag import LagHistogram
from indexer.normalize import EventApplier
from indexer.wire import WireError, decode_batch, seq_frame
from kvroute_common import zmtp_sub
from kvroute_common.zmq_recv import drain_forever

log = logging.getLogger("indexer.listener")

PENDING = "pending"
ACTIVE = "active"
PAUSED = "paused"
FAILED = "failed"

_TCP = re.compile(r"^(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:\[\]]*))(?::(?P<port>.*))?$")


def validate_endpoint(endpoint: str) -> None:
    """Raise ValueError with the reference's wording when ``endpoint`` is not a usable ZMQ address."""
    prefix = f"invalid ZMQ endpoint `{endpoint}`"
    if "://" not in endpoint:
        raise ValueError(f"{prefix}: missing scheme")
    scheme, address = endpoint.split("://", 1)
    if not scheme:
        raise ValueError(f"{prefix}: missing scheme")
    if scheme not in ("tcp", "ipc", "inproc"):
        raise ValueError(f"{prefix}: unsupported scheme `{scheme}`")
    if not address:
        raise ValueError(f"{prefix}: missing address")
    if scheme != "tcp":
        return
    m = _TCP.match(address)
    if m is None:
        raise ValueError(f"{prefix}: missing TCP port")
    host = m.group("v6") if m.group("v6") is not None else m.group("host")
    port = m.group("port")
    if port is None:
        raise ValueError(f"{prefix}: missing TCP port")
    if not host:
        raise ValueError(f"{prefix}: missing TCP host")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{prefix}: invalid TCP port: {port}")


_RCVMORE = zmq.RCVMORE


class _SubSocket(zmq.Socket):
    """The listener's SUB socket: ``recv_multipart`` in bytes reads RCVMORE with ``get`` directly.

    Why: pyzmq's version goes through its keyword-argument ``recv`` and its Python ``getsockopt``
    (an IntEnum conversion per call) for every frame: about 2 us of each 3-frame batch, a tenth of
    applying a short event. The result is the same list of frames.
    """

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> list[Any]:
        if not copy or track:
            return super().recv_multipart(flags, copy, track)
        recv, get = self.recv, self.get
        parts = [recv(flags)]
        while get(_RCVMORE):
            parts.append(recv(flags))
        return parts


class SequenceState:
    """The watermark of one (instance, dp_rank) stream; outlives a listener (see registry)."""

    __slots__ = ("last_seq", "last_live")

    def __init__(self) -> None:
        self.last_seq: int | None = None
        self.last_live: int | None = None  # the last seq received on the live socket (restart detection)


class Listener:
    """Subscribes to one engine's KV events and applies them through an EventApplier."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        applier: EventApplier,
        replay_endpoint: str | None = None,
        seq_state: SequenceState | None = None,
        ready: asyncio.Event | None = None,
        replay_timeout: float = 2.0,
        on_change: Callable[[], None] | None = None,
        lag_histogram: LagHistogram | None = None,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.applier = applier
        self.seq = seq_state or SequenceState()
        self.ready = ready
        self.replay_timeout = replay_timeout
        self.status = PENDING
        self.last_error: str | None = None
        self.batches_applied = 0
        self.batches_dropped = 0
        self.replays = 0
        self.replay_timeouts = 0
        # KV-event health (frontend /admin/workers, both services' /metrics)
        self.events_received = 0  # events in applied batches
        self.gaps = 0  # sequence jumps detected (each starts a replay when an endpoint is configured)
        self.batches_missed = 0  # batches the jumps skipped over
        self.restarts = 0  # engine restarts detected (the live sequence went backwards)
        self.last_event_wall: float | None = None  # time.time() of the last applied batch
        # index lag: the engine's timestamp of the newest applied batch, and how late it was applied
        self.newest_batch_ts: float | None = None
        self.apply_lag: float | None = None
        # batches found queued behind the first when the listener last read its socket (0: keeping up)
        self.batches_waiting = 0
        self._lag_histogram = lag_histogram
        self._on_change = on_change
        self._on_restart = on_restart  # told when a restarted engine is seen (its owner reads it again)
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.Socket | None = None

    # -- lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-listener {self.endpoint}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def info(self) -> dict[str, object]:
        # engine_restarts: a frontend routing on this index reads it to see a restart between its health checks
        out: dict[str, object] = {"endpoint": self.endpoint, "status": self.status, "engine_restarts": self.restarts}
        if self.replay_endpoint:
            out["replay_endpoint"] = self.replay_endpoint
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    def health(self) -> dict[str, object]:
        """Counters that tell a quiet engine from a broken stream (why: silent degradation)."""
        last = self.last_event_wall
        return {
            "batches_applied": self.batches_applied,
            "batches_dropped": self.batches_dropped,
            "events_received": self.events_received,
            "blocks_stored": self.applier.blocks_applied,
            "blocks_rejected_block_size": self.applier.blocks_block_size_mismatch,
            "gaps": self.gaps,
            "batches_missed": self.batches_missed,
            "replays": self.replays,
            "replay_timeouts": self.replay_timeouts,
            "engine_restarts": self.restarts,
            "last_seq": self.seq.last_seq,
            "last_event_timestamp": last,
            "last_event_age_seconds": None if last is None else max(0.0, time.time() - last),
            # seconds between the engine publishing the newest applied batch and its being applied here
            "index_lag_seconds": self.apply_lag,
            # seconds since the engine published the newest applied batch (grows while the engine is quiet
            # and while batches wait to be applied: with a growing lag, the index is behind)
            "newest_event_age_seconds": (
                None if self.newest_batch_ts is None else max(0.0, time.time() - self.newest_batch_ts)
            ),
            "batches_waiting": self.batches_waiting,
        }

    def _set_status(self, status: str, error: str | None = None) -> None:
        self.status = status
        if error is not None:
            self.last_error = error
        if self._on_change is not None:
            self._on_change()

    # -- receive loop

    def _make_sub(self) -> zmq.Socket:
        # A plain socket on the shared context: the loop watches its FD directly (see _run), which
        # drains bursts far better than awaiting zmq.asyncio's poll per wake-up.
        sock: zmq.Socket = _SubSocket(self.ctx, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 15000)
        sock.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; the engine's buffer bounds it
        if self.endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        return sock

    async def _run(self) -> None:
        in_order, on_message = self._in_order, self._on_message

        def handle(frames: list[bytes]) -> Awaitable[None] | None:
            return None if in_order(frames) else on_message(frames)  # the common case without a coroutine

        if zmtp_sub.supported(self.endpoint):
            await self._run_on_loop(handle)
            return
        try:
            self._sub = self._make_sub()
        except zmq.ZMQError as exc:
            self._set_status(FAILED, f"connect {self.endpoint}: {exc}")
            return
        if self.ready is not None:
            await self.ready.wait()  # the start-up gate: recovery first, then drain live events
        self._set_status(ACTIVE)
        try:
            await drain_forever(self._sub, handle, on_burst=self._on_burst)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # pragma: no cover - unexpected socket failure
            log.exception("listener %s failed", self.endpoint)
            self._set_status(FAILED, f"recv loop: {type(exc).__name__}: {exc}")

    async def _run_on_loop(self, handle: Callable[[list[bytes]], Awaitable[None] | None]) -> None:
        """tcp:// and ipc:// publishers are read by the loop itself (kvroute_common/zmtp_sub.py): connected at
        once, their batches held until the start-up gate opens, as the libzmq socket's pipe held them."""
        sub = zmtp_sub.ZmtpSubscriber(self.endpoint, handle, on_burst=self._on_burst, held=self.ready is not None)
        runner = asyncio.ensure_future(sub.run())
        try:
            if self.ready is not None:
                await self.ready.wait()
                sub.release()
            self._set_status(ACTIVE)
            await runner
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("listener %s failed", self.endpoint)
            self._set_status(FAILED, f"recv loop: {type(exc).__name__}: {exc}")
        finally:
            if not runner.done():
                runner.cancel()
                await asyncio.wait([runner])  # its connection closed before the listener is done

    def _on_burst(self, n: int) -> None:
        self.batches_waiting = n - 1

    def _in_order(self, frames: list[bytes]) -> bool:
        """Apply ``frames`` if it is the next batch in sequence; False if it needs the full path."""
        if len(frames) != 3:
            return False
        seq_bytes = frames[1]
        last = self.seq.last_seq
        if last is None or len(seq_bytes) != 8 or int.from_bytes(seq_bytes, "big") != last + 1:
            return False
        self._apply(last + 1, frames[2])
        self.seq.last_live = last + 1
        return True

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("Unexpected ZMQ frame count: %d", len(frames))
            return
        _topic, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            log.warning("Invalid sequence number length: %d", len(seq_bytes))
            return
        seq = int.from_bytes(seq_bytes, "big")
        last = self.seq.last_seq
        if last is not None and seq <= last:
            live = self.seq.last_live
            if live is None or seq > live:
                self.seq.last_live = seq
                return  # stale: a replay already applied it
            self._engine_restarted(seq, live)
            last = None
        self.seq.last_live = seq
        expected = 0 if last is None else last + 1
        if seq > expected:
            self.gaps += 1
            self.batches_missed += seq - expected
            await self._replay(expected)
            last = self.seq.last_seq
            if last is not None and seq <= last:
                return  # the replay already covered it
        self._apply(seq, payload)

    def _engine_restarted(self, seq: int, live: int) -> None:
        """The live sequence went back (``live`` -> ``seq``): a new engine with an empty cache."""
        self.restarts += 1
        log.warning(
            "KV event sequence of %s went back from %d to %d: engine restarted, dropping its blocks",
            self.endpoint,
            live,
            seq,
        )
        self.applier.reset_rank()
        self.seq.last_seq = None
        if self._on_restart is not None:
            try:
                self._on_restart()
            except Exception:  # the owner's reaction never stops the stream
                log.exception("engine restart callback of %s failed", self.endpoint)

    def _apply(self, seq: int, payload: bytes) -> bool:
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self.batches_dropped += 1
            log.warning("dropping undecodable batch %d from %s: %s", seq, self.endpoint, exc)
            return False
        self.applier.apply_batch(batch)
        self.seq.last_seq = seq
        self.batches_applied += 1
        self.events_received += len(batch.events)
        now = self.last_event_wall = time.time()
        if batch.ts > 0:  # the engine's wall clock at publishing (0: a publisher that sends none)
            self.newest_batch_ts = batch.ts
            lag = self.apply_lag = max(0.0, now - batch.ts)
            if self._lag_histogram is not None:
                self._lag_histogram.observe(lag)
        return True

    # -- replay

    async def _replay(self, start: int) -> None:
        if not self.replay_endpoint:
            log.warning("No replay endpoint configured; batches lost (%s from seq %d)", self.endpoint, start)
            return
        self.replays += 1
        dealer = zmq.asyncio.Socket(self.ctx, zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", seq_frame(start)])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):  # POLLIN
                    self.replay_timeouts += 1
                    self.last_error = (
                        f"replay from seq {start} via {self.replay_endpoint} timed out after {self.replay_timeout:g}s; "
                        "continuing with live events"
                    )
                    log.warning(self.last_error)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) == 3:
                    _, seq_bytes, payload = frames
                elif len(frames) == 4:
                    _, _, seq_bytes, payload = frames
                else:
                    return
                if len(seq_bytes) != 8 or not payload:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                last = self.seq.last_seq
                if last is not None and seq <= last:
                    continue
                self._apply(seq, payload)
        except zmq.ZMQError as exc:
            self.last_error = f"replay via {self.replay_endpoint}: {exc}"
            log.warning(self.last_error)
        finally:
            dealer.close(linger=0)
