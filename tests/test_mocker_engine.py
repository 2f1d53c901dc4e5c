"""The mocker's engine core without I/O: paged prefix cache, scheduler, events, timing model."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, Stored, decode_batch, encode_batch
from kvroute_common.hashing import block_hashes
from mocker.engine import FINISH_LENGTH, FINISH_STOP, EngineRank, RankScheduler, Sequence, sequence_rng
from mocker.kv_cache import KvCache
from mocker.perf_model import PerfModel

BS = 4
EOS = 3


def make(num_blocks=32, budget=64, max_seqs=8, speed=0.0):
    kv = KvCache(num_blocks, BS, ext_seed=42)
    return RankScheduler(kv, PerfModel(speed), max_seqs, budget, EOS, output_vocab=list(range(100, 200)))


def run_to_completion(s: RankScheduler, max_steps=10_000) -> int:
    steps = 0
    while s.has_work() and steps < max_steps:
        s.commit(s.schedule())
        steps += 1
    assert not s.has_work(), "engine did not drain"
    return steps


class Collector:
    def __init__(self):
        self.tokens: list[int] = []
        self.reason = None

    def finished(self) -> bool:
        return self.reason is not None

    def __call__(self, token, reason):
        if token is not None:
            self.tokens.append(token)
        if reason is not None:
            self.reason = reason


def seq(rid, prompt, max_tokens=4, **kw):
    c = Collector()
    return Sequence(rid, prompt, max_tokens, c, sequence_rng(0, None, prompt), **kw), c


def stored_events(kv):
    return [e for e in kv.take_events() if isinstance(e, BlockStored)]


def test_prefix_reuse_and_stored_events_match_prompt_blocks():
    s = make()
    prompt = list(range(10, 10 + 4 * BS + 2))  # 4 full blocks + partial
    a, ca = seq("a", prompt, max_tokens=1)
    s.add(a)
    run_to_completion(s)
    assert ca.reason == FINISH_LENGTH and len(ca.tokens) == 1
    events = stored_events(s.kv)
    hashes = [h for e in events for h in e.block_hashes]
    tokens = [t for e in events for t in e.token_ids]
    assert len(hashes) == 4 and tokens == prompt[: 4 * BS]
    assert events[0].parent_block_hash is None and events[0].medium == "GPU" and events[0].block_size == BS
    # the fields vLLM fills for a plain full-attention model
    assert all(e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention" for e in events)
    assert [k for e in events for k in e.extra_keys or ()] == [None] * 4
    local, seqh = block_hashes(prompt, BS)
    assert [b["tokens_hash"] for b in s.kv.snapshot()] == local[:4]
    assert hashes == [s.kv.ext_hash(h) for h in seqh[:4]]

    b, cb = seq("b", prompt + [7, 7], max_tokens=1)
    s.add(b)
    run_to_completion(s)
    assert b.num_cached_tokens == 4 * BS
    assert s.stats.prefix_cache_hits == 4 * BS
    # only the new (5th) block is stored, chained to the 4th
    new = stored_events(s.kv)
    assert len(new) == 1 and new[0].block_hashes == [s.kv.ext_hash(block_hashes(prompt + [7, 7], BS)[1][4])]
    assert new[0].parent_block_hash == hashes[-1]


def test_full_prompt_hit_still_computes_last_token():
    s = make()
    prompt = list(range(50, 50 + 3 * BS))
    a, _ = seq("a", prompt, max_tokens=1)
    s.add(a)
    run_to_completion(s)
    b, _ = seq("b", prompt, max_tokens=1)
    s.add(b)
    run_to_completion(s)
    assert b.num_cached_tokens == 2 * BS  # the last block is recomputed to produce logits


def test_eviction_is_lru_leaves_first_and_reported():
    s = make(num_blocks=7)  # 6 usable blocks + the null block
    p1 = list(range(100, 100 + 3 * BS))
    p2 = list(range(300, 300 + 3 * BS))
    for rid, p in (("a", p1), ("b", p2)):
        r, _ = seq(rid, p, max_tokens=1)
        s.add(r)
        run_to_completion(s)
    s.kv.take_events()
    ext1 = [s.kv.ext_hash(h) for h in block_hashes(p1, BS)[1]]
    # 6 blocks, all cached; a new 2-block prompt must evict the two oldest leaves: p1's last two blocks
    r, _ = seq("c", list(range(500, 500 + 2 * BS - 1)), max_tokens=1)
    s.add(r)
    run_to_completion(s)
    removed = [h for e in s.kv.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [ext1[2], ext1[1]]
    assert set(s.kv.cached) >= set(block_hashes(p2, BS)[1]) and block_hashes(p1, BS)[1][0] in s.kv.cached


def test_block_zero_is_the_null_block():
    """vLLM's --num-gpu-blocks-override N leaves N - 1 usable blocks (block 0 is a placeholder);
    kv_cache_usage_perc counts the usable ones."""
    s = make(num_blocks=9)
    assert s.kv.num_usable == s.kv.num_free == 8 and s.kv.num_used == 0 and 0 not in s.kv.free
    r, _ = seq("a", list(range(1, 1 + 4 * BS)), max_tokens=100, ignore_eos=True)
    s.add(r)
    s.commit(s.schedule())
    assert s.kv.num_used == 4 and s.kv.usage == 4 / 8
    assert s.capacity_tokens() == 8 * BS
    assert s.abort("a") and s.kv.num_used == 0


def test_preemption_when_out_of_blocks_and_everyone_finishes():
    s = make(num_blocks=8, budget=64)
    seqs = []
    for i in range(3):
        r, c = seq(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BS)), max_tokens=12, ignore_eos=True)
        s.add(r)
        seqs.append((r, c))
    run_to_completion(s)
    assert s.stats.preemptions > 0
    for _, c in seqs:
        assert c.reason == FINISH_LENGTH and len(c.tokens) == 12
    assert s.kv.num_free == s.kv.num_usable == 7


def test_outputs_are_deterministic_and_preemption_does_not_change_them():
    def outputs(num_blocks):
        s = make(num_blocks=num_blocks)
        cs = []
        for i in range(3):
            r, c = seq(f"r{i}", list(range(10 * i, 10 * i + 2 * BS)), max_tokens=10, ignore_eos=True)
            s.add(r)
            cs.append(c)
        run_to_completion(s)
        return [c.tokens for c in cs], s.stats.preemptions

    roomy, p0 = outputs(64)
    tight, p1 = outputs(8)
    assert p0 == 0 and p1 > 0
    assert roomy == tight


def test_natural_eos_min_tokens_and_stop_token_ids():
    s = make(num_blocks=128)
    r, c = seq("a", [5] * 9, max_tokens=1000)
    s.add(r)
    run_to_completion(s)
    assert c.reason == FINISH_STOP and c.tokens[-1] == EOS and 16 <= len(c.tokens) - 1 <= 256
    r, c = seq("b", [5] * 9, max_tokens=1000, min_tokens=300)
    s.add(r)
    run_to_completion(s)
    assert c.reason == FINISH_STOP and len(c.tokens) == 301
    stop_ids = frozenset(range(100, 200))  # every sampled token is a stop token
    r, c = seq("c", [6] * 9, max_tokens=50, min_tokens=3, stop_token_ids=stop_ids)
    s.add(r)
    run_to_completion(s)
    assert c.reason == FINISH_STOP and len(c.tokens) == 4


def test_priority_orders_admission():
    s = make(max_seqs=1)
    order: list[str] = []

    def finished_sink(rid: str) -> Callable[[int | None, str | None], None]:
        def sink(_token: int | None, reason: str | None) -> None:
            if reason:
                order.append(rid)

        return sink

    for rid, prio in (("low", 5), ("high", -1), ("mid", 0)):
        r = Sequence(
            rid,
            [1] * 5,
            1,
            finished_sink(rid),
            sequence_rng(0, None, [1]),
            priority=prio,
        )
        s.add(r)
    run_to_completion(s)
    assert order == ["high", "mid", "low"]


def test_chunked_prefill_respects_token_budget():
    s = make(num_blocks=64, budget=8)
    r, c = seq("a", list(range(1, 30)), max_tokens=2)
    s.add(r)
    first = s.schedule()
    assert first.items[0][1] == 8 and first.prefill_tokens == 8
    s.commit(first)
    run_to_completion(s)
    assert len(c.tokens) == 2


def test_abort_frees_blocks_and_reset_clears():
    s = make()
    r, c = seq("a", list(range(1, 20)), max_tokens=100, ignore_eos=True)
    s.add(r)
    s.commit(s.schedule())
    assert s.kv.num_used > 0
    assert not s.reset_prefix_cache()  # busy
    assert s.abort("a") and c.reason == "abort"
    assert s.kv.num_used == 0
    s.kv.take_events()
    assert s.reset_prefix_cache() and not s.kv.cached
    assert isinstance(s.kv.take_events()[-1], AllBlocksCleared)


def test_prompt_larger_than_cache_is_finished_not_stuck():
    s = make(num_blocks=2)
    r, c = seq("a", list(range(1, 40)), max_tokens=3)
    s.add(r)
    run_to_completion(s)
    assert c.reason == FINISH_LENGTH and c.tokens == []


def test_identical_prompts_in_flight_cache_a_copy_like_vllm():
    """vLLM does not de-duplicate: b, admitted in the same step, hits a's first two blocks (its last
    block is always recomputed) and caches its own copy of the third, reported again."""
    s = make()
    prompt = list(range(1, 1 + 3 * BS))
    for rid in ("a", "b"):
        r, _ = seq(rid, prompt, max_tokens=1)
        s.add(r)
    run_to_completion(s)
    events = stored_events(s.kv)
    ext = [s.kv.ext_hash(h) for h in block_hashes(prompt, BS)[1]]
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [(ext, None), (ext[2:], ext[1])]
    assert len(s.kv.cached) == 3 and len(s.kv.snapshot()) == 4


def test_copies_are_evicted_and_reported_one_by_one():
    """A fully cached prompt sent again recomputes its last block into a copy (vLLM: a second
    BlockStored of the same hash); lookups use the oldest copy, and each copy's eviction is its
    own BlockRemoved, so the hash stays cached until the last copy goes."""
    s = make(num_blocks=5)  # 4 usable
    prompt = list(range(1, 1 + 2 * BS))
    for rid in ("a", "b"):
        r, _ = seq(rid, prompt, max_tokens=1)
        s.add(r)
        run_to_completion(s)
    ext = [s.kv.ext_hash(h) for h in block_hashes(prompt, BS)[1]]
    assert [(e.block_hashes, e.parent_block_hash) for e in stored_events(s.kv)] == [(ext, None), (ext[1:], ext[0])]
    assert len(s.kv.snapshot()) == 3
    h1 = block_hashes(prompt, BS)[1][1]
    # free queue (front first): a's copy of block 1, b's copy, block 0 (freed last, by b)
    r, _ = seq("c", list(range(100, 100 + 2 * BS - 1)), max_tokens=1)  # two blocks: one free, one evicted
    s.add(r)
    run_to_completion(s)
    removed = [e for e in s.kv.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[ext[1]]]
    assert all(e.group_idx == 0 and e.medium == "GPU" for e in removed)
    assert h1 in s.kv.cached and not s.kv.copies  # b's copy now serves lookups
    r, _ = seq("e", prompt + [7], max_tokens=1)
    s.add(r)
    run_to_completion(s)
    assert r.num_cached_tokens == 2 * BS
    s.kv.take_events()
    r, _ = seq("d", list(range(200, 200 + 3 * BS - 1)), max_tokens=1)  # evicts c's block, then b's copy
    s.add(r)
    run_to_completion(s)
    removed = [e for e in s.kv.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2 and removed[1].block_hashes == [ext[1]] and h1 not in s.kv.cached


def test_random_workload_keeps_accounting_consistent():
    rng = random.Random(3)
    s = make(num_blocks=24, budget=32, max_seqs=4)
    live = set()
    for i in range(60):
        p = [rng.randint(10, 14) for _ in range(rng.randint(1, 30))]
        r, _ = seq(f"r{i}", p, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5)
        s.add(r)
        live.add(r.request_id)
        for _ in range(rng.randint(0, 3)):
            s.commit(s.schedule())
        if rng.random() < 0.2:
            s.abort(f"r{rng.randint(0, i)}")
        refs = sum(b.ref for b in s.kv.blocks)
        held = sum(len(q.blocks) for q in s.running)
        assert refs == held
        assert all(b.ref == 0 for b in s.kv.free.values())
        for b in s.kv.blocks:  # every cached block is its hash's oldest copy or a younger one
            if b.seq_hash is not None:
                assert s.kv.cached[b.seq_hash] is b or b in s.kv.copies[b.seq_hash]
        assert all(c.seq_hash == h for h, cs in s.kv.copies.items() for c in cs) and all(s.kv.copies.values())
    run_to_completion(s)
    assert s.kv.num_used == 0


def test_events_encode_as_vllm_batches():
    s = make()
    r, _ = seq("a", list(range(1, 1 + 2 * BS)), max_tokens=1)
    s.add(r)
    run_to_completion(s)
    payload = encode_batch(s.kv.take_events(), 1)
    batch = decode_batch(payload)
    assert batch.dp_rank == 1 and len(batch.events) == 1
    assert isinstance(batch.events[0], Stored) and len(batch.events[0].block_hashes) == 2


async def _until(predicate: Callable[[], object], max_turns: int = 10_000) -> None:
    """Let the engine task run until ``predicate`` holds (zero-delay steps: event-loop turns, no clock)."""
    for _ in range(max_turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_events_published_after_the_step_and_a_reset_with_the_next_step():
    """As vLLM (events taken and published in update_from_output): nothing of a step goes out while
    it runs, one batch per step once it ran, and a reset's AllBlocksCleared waits for the next step."""

    async def slow_step_publishes_nothing_yet() -> None:
        published: list[list[KVCacheEvent]] = []
        er = EngineRank(0, make(speed=1e-4), published.append)  # a step of minutes
        er.start()
        r, _ = seq("a", list(range(1, 1 + 2 * BS)), max_tokens=1)
        er.submit(r)
        await _until(lambda: er.scheduler.num_running == 1)
        await asyncio.sleep(0)
        assert published == [] and len(er.scheduler.kv.cached) == 2  # cached at scheduling, not yet published
        await er.stop()

    async def reset_waits_for_the_next_step() -> None:
        published: list[list[KVCacheEvent]] = []
        er = EngineRank(0, make(speed=0), published.append)
        er.start()
        for rid in ("a", "b"):
            r, c = seq(rid, list(range(1, 1 + 2 * BS)), max_tokens=1)
            er.submit(r)
            await _until(c.finished)
            if rid == "a":
                assert [[type(e) for e in b] for b in published] == [[BlockStored]]
                assert er.reset_prefix_cache()
                await asyncio.sleep(0)
                assert len(published) == 1  # not published on its own
        assert [[type(e) for e in b] for b in published] == [[BlockStored], [AllBlocksCleared, BlockStored]]
        await er.stop()

    asyncio.run(slow_step_publishes_nothing_yet())
    asyncio.run(reset_waits_for_the_next_step())


def test_perf_model():
    m = PerfModel(1.0)
    assert m.step_seconds(0, 0, 0.0) == 0.0
    assert m.step_seconds(1000, 0, 0.0) > m.step_seconds(100, 0, 0.0) > m.step_seconds(0, 1, 0.0)
    assert m.decode_ms(0.9) > m.decode_ms(0.1)
    assert PerfModel(2.0).step_seconds(1000, 1, 0.5) == pytest.approx(m.step_seconds(1000, 1, 0.5) / 2)
    assert PerfModel(0).step_seconds(1000, 1, 0.5) == 0.0
