"""Event ingestion: normalisation rules, and the ZMQ listener against real PUB and ROUTER sockets.

The replay server is a real ROUTER socket that serves the batches it buffered, exactly as vLLM's
publisher does (``[b"", topic, seq, payload]`` per batch, then an empty-payload end marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from indexer.core import KvIndex
from indexer.listener import ACTIVE, validate_endpoint
from indexer.normalize import EventApplier
from indexer.registry import IndexerRegistry
from indexer.wire import REPLAY_END_SEQ, AllBlocksCleared, BlockStored, decode_batch, encode_batch, seq_frame
from kvroute_common.hashing import local_block_hashes
from support import free_ports, until

BS = 4
MODEL = "m"


def toks(*blocks: int) -> list[int]:
    return [t for b in blocks for t in [b] * BS]


def local(*blocks: int, lora: str | None = None, salt: str | None = None) -> list[int]:
    return local_block_hashes(toks(*blocks), BS, lora, salt)


def stored(exts: list[int], parent: int | None = None, blocks: list[int] | None = None, **kw) -> BlockStored:
    args = dict(lora_id=None, medium=None, lora_name=None)
    args.update(kw)
    return BlockStored(exts, parent, toks(*(blocks if blocks is not None else exts)), BS, **args)


# ----------------------------------------------------------------------------- normalisation


def _apply(
    *events, dp_rank: int | None = 0, index: KvIndex | None = None, applier: EventApplier | None = None
) -> EventApplier:
    applier = applier or EventApplier(index or KvIndex(BS), 7, 0)
    applier.apply_batch(decode_batch(encode_batch(list(events), dp_rank)))
    return applier


def test_local_hashes_are_recomputed_from_tokens() -> None:
    a = _apply(stored([901, 902], blocks=[1, 2]))  # the engine's own hashes are only external ids
    assert a.index.find_matches(local(1, 2)) == {(7, 0): 2}
    assert a.index.find_matches([901, 902]) == {}


def test_batch_rank_overrides_and_none_falls_back_to_registered() -> None:
    a = _apply(stored([1]), dp_rank=3)
    _apply(stored([1]), dp_rank=None, applier=a)
    assert a.index.find_matches(local(1)) == {(7, 3): 1, (7, 0): 1}


def test_filters_drop_what_the_reference_drops() -> None:
    a = _apply(
        stored([1], medium="FOO"),  # unknown medium
        stored([2], medium="cpu"),  # case-sensitive
        stored([3], locality="REMOTE"),
        stored([4], group_idx=1, kv_cache_spec_kind="sliding_window"),
        stored([5], group_idx=2),  # unlearned group other than 0
        stored([6, 6]),  # duplicate hashes
        BlockStored([8], None, toks(8), BS * 2, None, None, None),  # block size differs from registration
    )
    for b in (1, 2, 3, 4, 5, 6, 8):
        assert a.index.tier_matches(local(b)) == {}, b
    _apply(
        stored([9], group_idx=0),
        stored([10], group_idx=1),
        stored([11], kv_cache_spec_kind="mla_attention", group_idx=3),
        stored([12], group_idx=3),
        applier=a,
    )
    assert a.index.find_matches(local(9)) and a.index.find_matches(local(11)) and a.index.find_matches(local(12))
    assert a.index.find_matches(local(10)) == {}  # group 1 was learned as sliding_window


def test_tokens_running_out_drop_remaining_blocks_and_partial_blocks_are_ignored() -> None:
    ev = BlockStored([1, 2, 3], None, toks(1, 2) + [3, 3], BS, None, None, None)
    a = _apply(ev)
    assert a.index.find_matches(local(1, 2, 3)) == {(7, 0): 2}


def test_lora_and_cache_salt_seed_the_hash_and_namespaces_propagate() -> None:
    a = _apply(stored([1], lora_name="ad"), stored([2], blocks=[2], extra_keys=[("dynamo-cache-salt:t1",)]))
    assert a.index.find_matches(local(1, lora="ad")) == {(7, 0): 1}
    assert a.index.find_matches(local(1)) == {}
    assert a.index.find_matches(local(2, salt="t1")) == {(7, 0): 1}
    _apply(stored([3], parent=2, blocks=[3]), applier=a)  # no salt, inherits its parent's namespace
    salted = local_block_hashes(toks(2, 3), BS, None, "t1")
    assert a.index.find_matches(salted) == {(7, 0): 2}


def test_vllms_cache_salt_is_read_by_position_never_as_an_image() -> None:
    """vLLM lays a block's extra keys out as [LoRA name] + (image id, offset) pairs + [salt, first block only]:
    a salt that is a 64-hex digest (what a tenant hash looks like) is the salt, not an image."""
    import hashlib

    from kvroute_common.hashing import mm_object_hash

    hex_salt = hashlib.sha256(b"tenant-a").hexdigest()
    image = hashlib.sha256(b"image").hexdigest()
    mm = [[mm_object_hash(image)], None]
    a = _apply(
        stored([1, 2], blocks=[1, 2], extra_keys=[(hex_salt,), None]),
        stored([3], parent=2, blocks=[3]),  # a later block of that request: the salt is inherited
        stored([11, 12], blocks=[11, 12], lora_name="ad", extra_keys=[("ad", (image, 1), "tenant-b"), ("ad",)]),
        stored([21], blocks=[21], extra_keys=[("other", "dynamo-cache-salt:t9")]),
    )
    assert a.index.find_matches(local_block_hashes(toks(1, 2, 3), BS, None, hex_salt)) == {(7, 0): 3}
    assert a.index.find_matches(local(1, 2)) == {}  # not indexed unsalted either
    keyed = local_block_hashes(toks(11, 12), BS, "ad", "tenant-b", mm)
    assert a.index.find_matches(keyed) == {(7, 0): 2}
    assert a.index.find_matches(local(21, salt="t9")) == {(7, 0): 1}
    # a bare string in an event that continues a request (it has a parent) is no salt: vLLM puts none there
    b = _apply(stored([5], blocks=[5]), stored([6], parent=5, blocks=[6], extra_keys=[("stray",)]))
    assert b.index.find_matches(local(5, 6)) == {(7, 0): 2}


def test_tiers_follow_the_medium_table() -> None:
    a = _apply(stored([1]), stored([2], parent=1, medium="CPU_PINNED"), stored([3], parent=2, medium="NVME"))
    assert a.index.tier_matches(local(1, 2, 3)) == {(7, 0): (1, 2, 3)}
    _apply(AllBlocksCleared(), applier=a)
    assert a.index.tier_matches(local(1, 2, 3)) == {}


def test_endpoint_validation_messages() -> None:
    validate_endpoint("tcp://127.0.0.1:5557")
    validate_endpoint("tcp://[::1]:5557")
    validate_endpoint("ipc:///tmp/x")
    for bad, msg in [
        ("garbage", "missing scheme"),
        ("udp://h:1", "unsupported scheme `udp`"),
        ("tcp://host", "missing TCP port"),
        ("tcp://:55", "missing TCP host"),
        ("tcp://h:99999", "invalid TCP port"),
        ("tcp://", "missing address"),
    ]:
        with pytest.raises(ValueError, match=msg):
            validate_endpoint(bad)


# ----------------------------------------------------------------------------- ZMQ listener


class Engine:
    """A fake engine's publisher: real PUB socket plus a replay ROUTER serving its buffer."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_port: int,
        replay_port: int,
        answer_replays: bool = True,
        old_reply: bool = False,
    ):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.endpoint = f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.old_reply = old_reply
        self._task = asyncio.get_running_loop().create_task(self._serve()) if answer_replays else None

    def publish(self, seq: int, payload: bytes, live: bool = True) -> None:
        """Buffer batch ``seq``; ``live=False`` simulates a batch lost on the way to the subscriber."""
        self.buffer[seq] = payload
        if live:
            self.pub.send_multipart([b"topic", seq_frame(seq), payload])

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(s for s in self.buffer if s >= first):
                if self.old_reply:
                    await self.router.send_multipart([identity, b"", seq_frame(seq), self.buffer[seq]])
                else:
                    await self.router.send_multipart([identity, b"", b"topic", seq_frame(seq), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", b"", REPLAY_END_SEQ, b""])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def batch(*events, dp: int = 0) -> bytes:
    return encode_batch(list(events), dp)


async def _connected(engine: Engine, reg: IndexerRegistry, listener) -> None:
    """Publish marker batches at seq 0 until the subscription is live (ZMQ slow joiner)."""
    index = reg.index(MODEL)
    assert index is not None
    probe = batch(stored([999]))

    def seen() -> bool:
        if listener.seq.last_seq is None:
            engine.publish(0, probe)
        return bool(index.find_matches(local(999)))

    await until(seen, what="subscription live")


def _scenario(body: Callable[..., object], **engine_kw) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub_port, replay_port = free_ports(2)
        engine = Engine(ctx, pub_port, replay_port, **engine_kw)
        reg = IndexerRegistry(ctx, replay_timeout=0.5)
        try:
            listener = reg.register(1, engine.endpoint, MODEL, block_size=BS, replay_endpoint=engine.replay_endpoint)
            await _connected(engine, reg, listener)
            assert listener.status == ACTIVE
            await body(engine, reg, listener, reg.index(MODEL))
        finally:
            await reg.close()
            engine.close()
            ctx.term()

    asyncio.run(main())


def test_gap_is_replayed_from_the_router_in_order() -> None:
    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        engine.publish(1, batch(stored([1])), live=False)
        engine.publish(2, batch(stored([2], parent=1, blocks=[2])), live=False)
        engine.publish(3, batch(stored([3], parent=2, blocks=[3])))  # the gap [1, 3) is noticed here
        await until(lambda: listener.seq.last_seq == 3, what="replay applied")
        assert engine.replay_requests == [1]
        assert index.find_matches(local(1, 2, 3)) == {(1, 0): 3}
        assert listener.replays == 1 and listener.last_error is None
        # Stale: a live batch a replay already applied is skipped.
        engine.publish(4, batch(stored([4], parent=3, blocks=[4])), live=False)
        engine.publish(6, batch(stored([6], parent=5, blocks=[6])), live=False)  # buffered, its live copy comes late
        engine.publish(5, batch(stored([5], parent=4, blocks=[5])))  # gap [4, 5): the replay sends 4, 5 and 6
        await until(lambda: listener.seq.last_seq == 6, what="seq 6")
        engine.pub.send_multipart([b"topic", seq_frame(6), batch(AllBlocksCleared())])  # the late live copy of seq 6
        engine.publish(7, batch(stored([7], parent=6, blocks=[7])))
        await until(lambda: listener.seq.last_seq == 7, what="seq 7")
        assert index.find_matches(local(1, 2, 3, 4, 5, 6, 7)) == {(1, 0): 7}
        assert listener.restarts == 0

    _scenario(body)


def test_engine_restart_resets_the_rank_and_relearns() -> None:
    """A restarted engine's sequence starts again at 0: its old blocks go, its new ones are learnt, and the
    registry's owner is told which stream saw a new engine (the frontend reads that worker again)."""

    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        told: list[tuple[int, int]] = []
        reg.on_restart = lambda instance, rank: told.append((instance, rank))
        for seq in range(1, 6):
            engine.publish(seq, batch(stored([seq])))
        await until(lambda: listener.seq.last_seq == 5, what="seq 5")
        # the new engine: seq 0 was published before the subscriber reconnected, seq 1 is seen live
        engine.buffer.clear()
        engine.publish(0, batch(stored([40])), live=False)
        engine.publish(1, batch(stored([41])))
        await until(lambda: listener.restarts == 1 and listener.seq.last_seq == 1, what="restart handled")
        assert engine.replay_requests[-1] == 0  # relearnt from the new engine's replay buffer
        for old in (999, 1, 5):
            assert index.find_matches(local(old)) == {}, old
        assert index.find_matches(local(40)) == {(1, 0): 1} and index.find_matches(local(41)) == {(1, 0): 1}
        assert listener.health()["engine_restarts"] == 1 and told == [(1, 0)]
        engine.publish(2, batch(stored([42])))  # and it goes on in order
        await until(lambda: listener.seq.last_seq == 2, what="seq 2")
        assert index.find_matches(local(42)) == {(1, 0): 1}

    _scenario(body)


def test_old_vllm_replay_reply_shape() -> None:
    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        engine.publish(1, batch(stored([5])), live=False)
        engine.publish(2, batch(stored([6])))
        await until(lambda: listener.seq.last_seq == 2, what="replay applied")
        assert index.find_matches(local(5)) and index.find_matches(local(6))

    _scenario(body, old_reply=True)


def test_undecodable_batch_is_dropped_whole_and_keeps_the_watermark() -> None:
    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        good = {"type": "BlockStored", "block_hashes": [7], "token_ids": toks(7), "block_size": BS}
        bad = msgspec.msgpack.encode([0.0, [good, {"type": "Mystery"}], 0])
        engine.publish(1, bad)
        await until(lambda: listener.batches_dropped >= 1, what="bad batch dropped")
        assert listener.seq.last_seq == 0
        assert index.find_matches(local(7)) == {}  # nothing of the bad batch applied
        engine.publish(2, batch(stored([8])))  # reports the gap [1, 2): replay re-sends 1 (still bad), then 2
        await until(lambda: listener.seq.last_seq == 2, what="seq 2")
        assert engine.replay_requests == [1]
        assert index.find_matches(local(7)) == {} and index.find_matches(local(8)) == {(1, 0): 1}

    _scenario(body)


def test_replay_without_answer_times_out_and_listener_keeps_going() -> None:
    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        engine.publish(1, batch(stored([1])), live=False)
        engine.publish(2, batch(stored([2])))
        await until(lambda: listener.seq.last_seq == 2, timeout=10, what="live batch after the replay timeout")
        assert listener.replay_timeouts == 1
        assert listener.status == ACTIVE and "timed out" in (listener.last_error or "")
        assert index.find_matches(local(2)) == {(1, 0): 1} and index.find_matches(local(1)) == {}
        worker = reg.workers()[0]
        assert worker["status"] == "active" and "timed out" in worker["listeners"]["0"]["last_error"]
        engine.publish(3, batch(stored([3])))
        await until(lambda: listener.seq.last_seq == 3, what="seq 3")

    _scenario(body, answer_replays=False)


def test_first_batch_after_start_replays_from_zero_and_unregister_keeps_the_watermark() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub_port, replay_port = free_ports(2)
        engine = Engine(ctx, pub_port, replay_port)
        reg = IndexerRegistry(ctx, replay_timeout=2.0)
        try:
            for seq in range(3):
                engine.publish(seq, batch(stored([10 + seq])), live=False)  # before anyone listened
            listener = reg.register(1, engine.endpoint, MODEL, block_size=BS, replay_endpoint=engine.replay_endpoint)
            index = reg.index(MODEL)

            def poke() -> bool:
                if listener.seq.last_seq is None or listener.seq.last_seq < 3:
                    engine.publish(3, batch(stored([13])))
                return listener.seq.last_seq == 3

            await until(poke, what="replay from 0")
            assert engine.replay_requests[0] == 0
            assert index.find_matches(local(10)) and index.find_matches(local(12)) and index.find_matches(local(13))
            await reg.unregister(1, MODEL)
            assert reg.index(MODEL) is None
            listener = reg.register(1, engine.endpoint, MODEL, block_size=BS, replay_endpoint=engine.replay_endpoint)
            assert listener.seq.last_seq == 3  # the document: the watermark outlives unregister/register
        finally:
            await reg.close()
            engine.close()
            ctx.term()

    asyncio.run(main())


def test_health_counts_events_gaps_replays_block_size_rejections_and_last_event_time() -> None:
    """KV-event health: one listener's counters, its registry view and the Prometheus
    families both services export (the standalone indexer's /metrics renders them too)."""
    from indexer.service import Metrics

    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        before = listener.health()
        assert before["events_received"] >= 1 and before["gaps"] == 0 and before["last_event_timestamp"] is not None
        engine.publish(1, batch(stored([1]), stored([2], parent=1, blocks=[2])), live=False)
        engine.publish(3, batch(stored([3], parent=2, blocks=[3])), live=False)
        foreign = BlockStored([40, 41], None, [5] * (2 * BS * 2), BS * 2, lora_id=None, medium=None, lora_name=None)
        engine.publish(4, batch(foreign))  # seq 4 reveals the gap [1, 4); the replay fills it
        await until(lambda: listener.seq.last_seq == 4, what="replay applied")
        h = listener.health()
        assert h["gaps"] == 1 and h["batches_missed"] == 3 and h["replays"] == 1 and h["replay_timeouts"] == 0
        assert h["events_received"] == before["events_received"] + 4
        assert h["batches_applied"] == before["batches_applied"] + 3  # seqs 1 and 3 (replayed) and 4
        assert h["blocks_rejected_block_size"] == 2 and listener.applier.last_foreign_block_size == 2 * BS
        assert h["last_seq"] == 4 and 0 <= h["last_event_age_seconds"] < 60
        view = reg.health(1)
        assert list(view) == ["0"] and view["0"]["gaps"] == 1 and view["0"]["blocks_stored"] == h["blocks_stored"]
        assert reg.health(99) == {}
        text = Metrics(reg).render().body.decode()
        assert 'kvroute_kv_event_gaps_total{dp_rank="0",worker_id="1"} 1.0' in text
        assert 'kvroute_kv_event_replays_total{dp_rank="0",worker_id="1"} 1.0' in text
        assert 'kvroute_kv_event_blocks_rejected_block_size_total{dp_rank="0",worker_id="1"} 2.0' in text
        assert f'kvroute_kv_events_received_total{{dp_rank="0",worker_id="1"}} {float(h["events_received"])}' in text
        assert 'kvroute_kv_event_last_timestamp_seconds{dp_rank="0",worker_id="1"}' in text

    _scenario(body)


def test_apply_lag_is_counted_per_batch_and_a_caught_up_listener_has_nothing_waiting() -> None:
    """Index lag as a signal: every applied batch lands in the process's apply-lag histogram (engine
    publish time to applied), and a listener that keeps up shows no batches waiting."""
    from indexer.lag import BUCKETS, quantile
    from indexer.service import Metrics

    async def body(engine: Engine, reg, listener, index: KvIndex) -> None:
        hist = reg.apply_lag
        before = list(hist.counts)
        late = encode_batch([stored([5])], 0, ts=time.time() - 0.3)  # published 0.3 s before it is applied
        engine.publish(1, late)
        await until(lambda: listener.seq.last_seq == 1, what="late batch applied")
        added = [b - a for a, b in zip(before, hist.counts, strict=True)]
        assert sum(added) == 1 and sum(added[BUCKETS.index(0.3) + 1 :]) == 1, added  # lag > 0.3 s
        assert 0.3 <= quantile(0.99, [*BUCKETS, float("inf")], added) <= 0.5
        assert listener.batches_waiting == 0 and listener.health()["batches_waiting"] == 0
        text = Metrics(reg).render().body.decode()
        assert 'kvroute_kv_event_batches_waiting{dp_rank="0",worker_id="1"} 0.0' in text
        assert f"kvroute_kv_index_apply_lag_seconds_count {float(sum(hist.counts))}" in text
        assert 'kvroute_kv_index_apply_lag_seconds_bucket{le="0.3"}' in text

    _scenario(body)


def test_drain_reports_how_many_messages_each_wake_up_found_queued() -> None:
    """The listener's 'batches waiting' comes from here: messages queued when the reader got its turn."""
    from kvroute_common.zmq_recv import drain_forever

    async def main() -> None:
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind("inproc://drain")
        push.connect("inproc://drain")
        got: list[bytes] = []
        bursts: list[int] = []
        for i in range(5):  # inproc: queued at the reader as soon as send returns
            push.send(b"%d" % i)
        task = asyncio.get_running_loop().create_task(
            drain_forever(pull, lambda frames: got.extend(frames), on_burst=bursts.append)
        )
        try:
            await until(lambda: len(got) == 5, what="the queued five")
            assert bursts == [5]
            push.send(b"5")
            await until(lambda: len(got) == 6, what="one more")
            assert bursts == [5, 1] and got == [b"%d" % i for i in range(6)]
        finally:
            task.cancel()
            push.close(linger=0)
            pull.close(linger=0)
            ctx.term()

    asyncio.run(main())


@contextlib.contextmanager
def _push_pull(endpoint: str) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A PUSH socket connected to a PULL socket bound at ``endpoint``, closed after."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    push.connect(endpoint)
    try:
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_drain_gives_the_loop_a_turn_when_a_burst_takes_long() -> None:
    """A burst of slow messages (a long prompt's per-step batches) is read in turns: after
    ``turn_seconds`` of handling the loop's other callbacks run, then reading goes on, in order."""
    from kvroute_common.zmq_recv import drain_forever

    def slow(frames: list[bytes]) -> None:
        end = time.perf_counter() + 0.003  # longer than the turn: every message ends a turn
        while time.perf_counter() < end:
            pass
        log.append(frames[0].decode())

    log: list[str] = []

    async def ticker() -> None:
        while True:
            log.append("tick")
            await asyncio.sleep(0)

    async def main() -> None:
        with _push_pull("inproc://turns") as (push, pull):
            for i in range(4):
                push.send(b"m%d" % i)
            loop = asyncio.get_running_loop()
            tick = loop.create_task(ticker())
            task = loop.create_task(drain_forever(pull, slow, turn_seconds=0.002))
            try:
                await until(lambda: "m3" in log, what="the four messages")
            finally:
                task.cancel()
                tick.cancel()
        messages = [x for x in log if x != "tick"]
        assert messages == ["m0", "m1", "m2", "m3"]
        first = log.index("m0")
        assert all(log[i + 1] == "tick" for i in range(first, len(log) - 1) if log[i] != "tick"), log

    asyncio.run(main())


def test_drain_pauses_after_a_turn_that_ran_out_of_time() -> None:
    """After a turn that ran out of time the next starts no sooner than that turn's length later, and the
    loop runs other callbacks meanwhile, even as more messages make the socket's descriptor fire."""
    from kvroute_common.zmq_recv import drain_forever

    spin = 0.006
    spans: list[tuple[float, float]] = []
    ticks: list[float] = []

    def slow(frames: list[bytes]) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < spin:
            pass
        spans.append((start, time.perf_counter()))

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)

    async def main() -> None:
        with _push_pull("inproc://pauses") as (push, pull):
            push.send(b"m0")
            loop = asyncio.get_running_loop()
            tick = loop.create_task(ticker())
            task = loop.create_task(drain_forever(pull, slow, turn_seconds=0.002))
            try:
                await until(lambda: len(spans) == 1, what="the first message")
                for i in range(1, 4):
                    push.send(b"m%d" % i)  # arriving during the pause: the descriptor fires
                await until(lambda: len(spans) == 4, what="the four messages")
            finally:
                task.cancel()
                tick.cancel()
        for (start, end), (next_start, _) in itertools.pairwise(spans):
            assert next_start - end >= 0.7 * (end - start), spans
            assert sum(end < t < next_start for t in ticks) >= 2, "the loop ran other callbacks in the pause"

    asyncio.run(main())
