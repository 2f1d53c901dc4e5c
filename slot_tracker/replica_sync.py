"""Replica sync: slot trackers share lifecycle events (add / prefill complete / free) over ZMQ PUB/SUB.

Best effort by design (as Dynamo's slot-tracker documentation describes replica synchronization): a bounded queue
drops new events when
full instead of blocking HTTP handlers; there is no acknowledgement, replay or snapshot. Each
process picks a random non-zero 64-bit id and ignores events carrying it. A replica applies an
event only to a worker rank it already has registered (same model, tenant and block size):
replica traffic never creates workers.

Wire format = the 1.6.1 reference's replica-sync envelope, so replicas interoperate with it:
two frames ``[b"dynamo.slot-tracker.v1", msgpack map]``; the tenant travels as ``routing_group``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import msgspec
import zmq

from kvroute_common.constants import U64_MAX
from kvroute_common.zmq_recv import drain_forever
from slot_tracker.core import LifecycleEvent, SlotRegistry, SlotTrackerError

log = logging.getLogger("slot_tracker.replica_sync")

TOPIC = b"dynamo.slot-tracker.v1"
DEFAULT_QUEUE_CAPACITY = 100_000
# Publishing waits this long after the first queued event so one wake-up sends a burst: each ZMQ send
# that finds libzmq's I/O thread asleep costs a syscall to wake it, a third of a small request's
# frontend CPU at 2 processes without this. 2 ms is far below any request's life (best effort anyway).
PUBLISH_COALESCE_SECS = 0.002
MAX_BATCH = 256  # events per message with batch=True
MAX_WARNED_TOPOLOGIES = (
    1024  # distinct unknown (model, tenant, block size, worker, rank, reason) keys logged, then silent
)
_MARK_PREFILL = "MarkPrefillCompleted"
_FREE = "Free"


class WorkerRank(msgspec.Struct):
    worker_id: int
    dp_rank: int


class PrefillLoadHint(msgspec.Struct):
    initial_effective_prefill_tokens: int
    expected_prefill_duration: Any = None


class AddRequest(msgspec.Struct):
    token_sequence: list[int]
    track_prefill_tokens: bool
    expected_output_tokens: int | None = None
    prefill_load_hint: PrefillLoadHint | None = None


class AddData(msgspec.Struct):
    AddRequest: AddRequest


class ReplicaEvent(msgspec.Struct):
    request_id: str
    worker: WorkerRank
    data: AddData | str  # {"AddRequest": {...}} | "MarkPrefillCompleted" | "Free"
    router_id: int
    lora_name: str | None = None


class Envelope(msgspec.Struct):
    model_name: str
    routing_group: str
    block_size: int
    event: ReplicaEvent


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_batch_decoder = msgspec.msgpack.Decoder(list[Envelope])


def _array_header(n: int) -> bytes:
    """msgpack array header for ``n`` elements (a batch frame is this + the events' encodings)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_event(ev: LifecycleEvent, router_id: int) -> bytes:
    """The msgpack payload (second frame) for one local lifecycle event."""
    if ev.kind == "add":
        hint = PrefillLoadHint(ev.new_isl_tokens) if ev.new_isl_tokens > 0 else None
        hashes = [h & U64_MAX for h in ev.sequence_hashes]  # the wire carries u64 (HTTP hands the core i64)
        data: AddData | str = AddData(AddRequest(hashes, ev.new_isl_tokens > 0, None, hint))
    elif ev.kind == "prefill_complete":
        data = _MARK_PREFILL
    else:
        data = _FREE
    return _encoder.encode(
        Envelope(
            ev.model_name,
            ev.tenant_id,
            ev.block_size,
            ReplicaEvent(ev.request_id, WorkerRank(ev.worker_id, ev.dp_rank), data, router_id),
        )
    )


def decode_event(payload: bytes) -> Envelope:
    return _decoder.decode(payload)


def validate_endpoint(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be a peer to connect to, or None if it looks usable."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"invalid ZMQ endpoint `{endpoint}`: missing scheme"
    if scheme not in ("tcp", "ipc", "inproc"):
        return f"invalid ZMQ endpoint `{endpoint}`: unsupported scheme `{scheme}`"
    if scheme != "tcp":
        return None if rest else f"invalid ZMQ endpoint `{endpoint}`: missing path"
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
    if not host or host == "*":
        return f"invalid ZMQ endpoint `{endpoint}`: a peer needs a host to connect to"
    return None


class ReplicaSync:
    """PUB our lifecycle events, SUB to the peers' and apply theirs to ``registry``."""

    def __init__(
        self,
        registry: SlotRegistry,
        bind: str,
        advertise: str | None = None,
        peers: list[str] | None = None,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        batch: bool = False,
    ) -> None:
        self.registry = registry
        # batch=True: a burst of events goes out as ONE message [TOPIC, event, event, ...] (every receiver
        # here accepts that; the reference expects exactly two frames, so only for our own processes'
        # private endpoints, `python -m frontend --workers N`)
        self.batch = batch
        self.bind = bind
        self.advertise = advertise
        self.router_id = secrets.randbits(64) or 1  # ephemeral identity, never configured
        self._initial_peers = [p for p in (peers or []) if p]
        self._peers: set[str] = set()
        # events since the last flush; one flush per PUBLISH_COALESCE_SECS window sends them all
        self._pending: list[LifecycleEvent] = []
        self._queue_capacity = queue_capacity
        self._flush_handle: asyncio.TimerHandle | None = None
        # plain (non-asyncio) sockets: sends never block (NOBLOCK, dropped when full) and receives are
        # drained in bursts on one wake-up of the SUB socket's FD, instead of a future per message
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.stats = {"published": 0, "dropped_full": 0, "received": 0, "applied": 0, "ignored_own": 0, "dropped": 0}
        self._warned: set[tuple[str, str, int, int, int, str]] = set()

    # ----- lifecycle -----

    async def start(self) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.bind)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        for peer in self._initial_peers:
            if self._is_self(peer):
                log.info("replica sync: skipping own endpoint %s in the peer list", peer)
                continue
            self.add_peer(peer)
        self.registry.observer = self._on_local_event
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._tasks = [loop.create_task(self._receive_loop())]

    async def stop(self) -> None:
        if self.registry.observer == self._on_local_event:
            self.registry.observer = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._sub = self._ctx = None

    @property
    def bound_endpoint(self) -> str | None:
        """Where the PUB socket actually listens (resolves a ``:0``/wildcard bind)."""
        return None if self._pub is None else self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    # ----- peers -----

    def _is_self(self, endpoint: str) -> bool:
        return endpoint in (self.advertise, self.bind)

    def add_peer(self, endpoint: str) -> bool:
        """Connect the SUB socket to a peer's PUB endpoint; False if it was already a peer.

        Raises SlotTrackerError(400) for an invalid endpoint or this replica's own endpoint.
        """
        problem = validate_endpoint(endpoint)
        if problem is None and self._is_self(endpoint):
            problem = f"`{endpoint}` is this replica's own endpoint"
        if problem is not None:
            raise SlotTrackerError(400, problem)
        if endpoint in self._peers:
            return False
        if self._sub is None:  # not started yet: connect at start()
            if endpoint in self._initial_peers:
                return False
            self._initial_peers.append(endpoint)
            return True
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            raise SlotTrackerError(400, f"failed to register replica peer `{endpoint}`: {exc}") from None
        self._peers.add(endpoint)
        return True

    def remove_peer(self, endpoint: str) -> bool:
        if endpoint not in self._peers:
            if endpoint in self._initial_peers and self._sub is None:
                self._initial_peers.remove(endpoint)
                return True
            return False
        self._peers.discard(endpoint)
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(endpoint)
        return True

    def peers(self) -> list[str]:
        return sorted(self._peers if self._sub is not None else set(self._initial_peers))

    # ----- outgoing -----

    def _on_local_event(self, ev: LifecycleEvent) -> None:
        """Called synchronously by the core after a local change: buffer it, never block. The first
        event of a window schedules the flush, so one wake-up sends the whole burst (each ZMQ send that
        finds libzmq's I/O thread asleep costs a syscall to wake it)."""
        pending = self._pending
        if len(pending) >= self._queue_capacity:
            self.stats["dropped_full"] += 1
            return
        pending.append(ev)
        if self._flush_handle is None and self._pub is not None:
            self._flush_handle = self._loop.call_later(PUBLISH_COALESCE_SECS, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        events, self._pending = self._pending, []
        if not events or self._pub is None:
            return
        if self.batch:
            self._publish_batch(self._pub, events)
            return
        pub, stats = self._pub, self.stats
        for ev in events:
            try:
                pub.send_multipart([TOPIC, encode_event(ev, self.router_id)], flags=zmq.NOBLOCK)
                stats["published"] += 1
            except zmq.Again:
                stats["dropped_full"] += 1
            except Exception:  # one bad event must not stop replication
                log.exception("replica sync: failed to publish %s", ev.kind)

    def _publish_batch(self, pub: zmq.Socket, events: list[LifecycleEvent]) -> None:
        """The burst as messages ``[TOPIC, msgpack array of events]`` of up to MAX_BATCH events each:
        one frame and one decode call per message on the receiving sibling."""
        encoded: list[bytes] = []
        for ev in events:
            try:
                encoded.append(encode_event(ev, self.router_id))
            except Exception:  # one bad event must not stop replication
                log.exception("replica sync: failed to encode %s", ev.kind)
        for i in range(0, len(encoded), MAX_BATCH):
            chunk = encoded[i : i + MAX_BATCH]
            try:
                pub.send_multipart([TOPIC, _array_header(len(chunk)) + b"".join(chunk)], flags=zmq.NOBLOCK)
                self.stats["published"] += len(chunk)
            except zmq.Again:
                self.stats["dropped_full"] += len(chunk)

    # ----- incoming -----

    async def _receive_loop(self) -> None:
        assert self._sub is not None
        await drain_forever(self._sub, self._receive)

    def _receive(self, frames: list[bytes]) -> None:
        """One message: ``[TOPIC, event]`` (the reference's), ``[TOPIC, array of events]`` (our siblings,
        batch=True), or ``[TOPIC, event, event, ...]`` (the earlier batch form, still accepted)."""
        stats = self.stats
        if len(frames) < 2 or frames[0] != TOPIC:
            stats["received"] += 1
            stats["dropped"] += 1
            return
        for payload in frames[1:] if len(frames) > 2 else (frames[1],):
            try:
                if payload and (0x90 <= payload[0] <= 0x9F or payload[0] in (0xDC, 0xDD)):  # a msgpack array: a batch
                    envs = _batch_decoder.decode(payload)
                else:
                    envs = [_decoder.decode(payload)]
            except (msgspec.DecodeError, msgspec.ValidationError):
                stats["received"] += 1
                stats["dropped"] += 1
                continue
            stats["received"] += len(envs)
            for env in envs:
                self.apply(env)

    def apply(self, env: Envelope) -> bool:
        """Apply one peer event; False when it is ours or does not fit local topology (dropped)."""
        ev = env.event
        if ev.router_id == self.router_id:
            self.stats["ignored_own"] += 1
            return False
        tracker = self.registry.get(env.model_name, env.routing_group)
        if (
            tracker is None
            or tracker.block_size != env.block_size
            or not tracker.has_slot(ev.worker.worker_id, ev.worker.dp_rank)
        ):
            self.stats["dropped"] += 1
            self._warn_unknown(env, tracker)
            return False
        try:
            data = ev.data
            if isinstance(data, AddData):
                add = data.AddRequest
                hint = add.prefill_load_hint
                tokens = hint.initial_effective_prefill_tokens if (add.track_prefill_tokens and hint is not None) else 0
                tracker.add(
                    ev.request_id, ev.worker.worker_id, ev.worker.dp_rank, add.token_sequence, tokens, notify=False
                )
            elif data == _MARK_PREFILL:
                tracker.prefill_complete(ev.request_id, notify=False)
            elif data == _FREE:
                tracker.free(ev.request_id, notify=False)
            else:
                self.stats["dropped"] += 1
                return False
        except SlotTrackerError:  # duplicate add, completion of an unknown request: drop
            self.stats["dropped"] += 1
            return False
        self.stats["applied"] += 1
        return True

    def _warn_unknown(self, env: Envelope, tracker: Any) -> None:
        """Say once per topology why a peer's events are dropped: a replica (a standalone tracker
        following a frontend, say) that was never given the same registrations shows no load at all,
        and nothing else would tell its operator why."""
        ev = env.event
        if tracker is None:
            why = "that model and tenant are not registered here"
        elif tracker.block_size != env.block_size:
            why = f"the block size registered here is {tracker.block_size}"
        else:
            why = "that worker rank is not registered here"
        key = (env.model_name, env.routing_group, env.block_size, ev.worker.worker_id, ev.worker.dp_rank, why)
        if key in self._warned or len(self._warned) >= MAX_WARNED_TOPOLOGIES:
            return
        self._warned.add(key)
        log.warning(
            "replica sync: dropping peer events for model %r tenant %r block size %d worker %d rank %d: %s "
            "(replica traffic never creates workers: register the same workers on every replica)",
            *key,
        )
