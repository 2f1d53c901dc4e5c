"""Publishing KV events over ZMQ exactly like vLLM's ``ZmqEventPublisher`` (one per DP rank).

* Live: PUB socket, 3-frame messages ``[topic, seq (8 bytes big-endian), payload]``, ``seq``
  counting from 0 per rank, payload = ``indexer.wire.encode_batch`` (vLLM 0.33 bytes).
* Replay: ROUTER socket; a request ``[identity, b"", start_seq]`` is answered with
  ``[identity, b"", topic, seq, payload]`` for every buffered batch with seq >= start, then
  ``[identity, b"", b"", REPLAY_END_SEQ, b""]``. The last ``buffer_steps`` batches are kept.
* Rank r uses the endpoint's port + r (``inproc``/``ipc``: suffix ``_dp{r}``), like vLLM.
* PUB binds for wildcard hosts (``*``, ``::``) and ipc/inproc, like vLLM, and additionally for
  loopback hosts (127.x.x.x, localhost, [::1]) so a test can bind on loopback only; any other
  host is connected to (vLLM's "connect" convention).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import zmq
import zmq.asyncio

from indexer.wire import REPLAY_END_SEQ, KVCacheEvent, encode_batch, seq_frame

log = logging.getLogger("mocker.events")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-rank endpoint: port + rank for tcp, ``_dp{rank}`` suffix for ipc/inproc."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"invalid ZMQ endpoint {endpoint!r}: missing TCP port")
        return f"{head}:{int(port) + rank}"
    raise ValueError(f"invalid ZMQ endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")


def should_bind(endpoint: str) -> bool:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def connect_endpoint(endpoint: str) -> str:
    """Where a subscriber on this machine connects for a bound endpoint (``*`` -> 127.0.0.1)."""
    return endpoint.replace("*", "127.0.0.1")


class KvEventPublisher:
    """PUB + replay ROUTER of one DP rank. ``publish`` is synchronous and never blocks."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        dp_rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        buffer_steps: int = 10_000,
        topic: bytes = b"",
        hwm: int = 100_000,
    ) -> None:
        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, dp_rank) if replay_endpoint else None
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        # plain (synchronous) socket: PUB never blocks and publish() is called from the engine step
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        if should_bind(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name=f"replay-{self.dp_rank}")

    def publish(self, events: list[KVCacheEvent]) -> int:
        """Send one batch; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(events, self.dp_rank)
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # no room (HWM): subscribers will see a gap and replay
            log.warning("rank %d: KV event batch %d not sent (high-water mark)", self.dp_rank, seq)
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("rank %d: invalid replay request (%d frames)", self.dp_rank, len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await sock.send_multipart([identity, b"", self.topic, seq_frame(seq), payload])
            await sock.send_multipart([identity, b"", b"", REPLAY_END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
