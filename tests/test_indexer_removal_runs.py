"""Runs of single-block removals (vLLM publishes one event per evicted block) applied in one index call
leave the index and the event counters exactly as those events applied one at a time do.

Random batches against the same batches cut into one event each (each then goes through the
per-event path): stores of chains with real tokens below blocks held or not, removals of held,
already-cut and unknown blocks in any order and of stored chains last block first, multi-block
removals, other media (a lower tier), groups (learned as sliding window or not), localities, and
cleared ranks. After every batch both
indexes dump the same blocks, answer the same matches for every chain ever stored, and count the
same events by type and status.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import KvIndex
from indexer.normalize import EventApplier
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch
from kvroute_common.hashing import local_block_hashes

BS = 4
HASHES = list(range(1, 25))  # the external hashes events name: chains, removals and unknown blocks


def _tokens(exts: list[int]) -> list[int]:
    return [t for e in exts for t in [e % 7] * BS]


_MEDIA = st.sampled_from(["GPU", None, "CPU"])
_GROUPS = st.sampled_from([None, 0, 1])
_LOCALITIES = st.sampled_from([None, "LOCAL", "REMOTE"])


@st.composite
def _batch(draw: st.DrawFn) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Events most of which share the batch's medium, group and locality, so removals form runs; some
    runs evict a chain stored earlier in the batch last block first, as vLLM frees a request's blocks."""
    usual = (draw(_MEDIA), draw(_GROUPS), draw(_LOCALITIES))
    events = draw(st.lists(_event(usual), min_size=1, max_size=30))
    stored = [ev for ev in events if isinstance(ev, BlockStored)]
    for _ in range(draw(st.integers(0, 3)) if stored else 0):
        chain = draw(st.sampled_from(stored)).block_hashes
        tail = list(reversed(chain))[: draw(st.integers(1, len(chain)))]
        if draw(st.booleans()):  # one block of the tail evicted out of order
            k = draw(st.integers(0, len(tail) - 1))
            tail.append(tail.pop(k))
        medium, group, locality = usual
        at = draw(st.integers(0, len(events)))
        events[at:at] = [BlockRemoved([h], medium, group_idx=group, locality=locality) for h in tail]
    return events


@st.composite
def _event(draw: st.DrawFn, usual: tuple) -> BlockStored | BlockRemoved | AllBlocksCleared:
    kind = draw(st.sampled_from(["stored"] * 3 + ["removed"] * 5 + ["removed_many", "cleared"]))
    medium, group, locality = usual if draw(st.integers(0, 4)) else (draw(_MEDIA), draw(_GROUPS), draw(_LOCALITIES))
    if kind == "stored":
        exts = draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=5, unique=True))
        parent = draw(st.none() | st.sampled_from(HASHES).filter(lambda h: h not in exts))
        spec = draw(st.sampled_from([None, None, None, "full_attention", "sliding_window"]))
        return BlockStored(
            exts,
            parent,
            _tokens(exts),
            BS,
            None,
            medium,
            None,
            group_idx=group,
            kv_cache_spec_kind=spec,
            locality=locality,
        )
    if kind == "cleared":
        return AllBlocksCleared()
    size = 1 if kind == "removed" else draw(st.integers(2, 4))
    hashes = draw(st.lists(st.sampled_from(HASHES), min_size=size, max_size=size, unique=True))
    return BlockRemoved(hashes, medium, group_idx=group, locality=locality)


def _matches(index: KvIndex, chains: list[list[int]]) -> list[object]:
    out: list[object] = []
    for exts in chains:
        local = local_block_hashes(_tokens(exts), BS)
        out.append((index.find_matches(local), index.tier_matches(local)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_batch(), min_size=1, max_size=6), st.sampled_from([0, 2]))
def test_a_run_of_single_block_removals_equals_its_events_one_by_one(batches: list[list], dp_rank: int) -> None:
    whole = EventApplier(KvIndex(BS), 7, 0)
    each = EventApplier(KvIndex(BS), 7, 0)
    chains: list[list[int]] = []
    for events in batches:
        whole.apply_batch(decode_batch(encode_batch(events, dp_rank)))
        for ev in events:
            each.apply_batch(decode_batch(encode_batch([ev], dp_rank)))
        chains += [ev.block_hashes for ev in events if isinstance(ev, BlockStored)]
        assert sorted(map(repr, whole.index.dump_events())) == sorted(map(repr, each.index.dump_events()))
        assert _matches(whole.index, chains) == _matches(each.index, chains)
        assert whole.counters == each.counters
        assert whole.index.blocks_per_worker() == each.index.blocks_per_worker()


def test_an_evicted_prompt_tail_first_is_one_run_and_counted_per_event() -> None:
    applier = EventApplier(KvIndex(BS), 7, 0)
    chain = list(range(100, 164))
    applier.apply_batch(
        decode_batch(encode_batch([BlockStored(chain, None, _tokens(chain), BS, None, "GPU", None)], 0))
    )
    evictions = [BlockRemoved([h], "GPU", group_idx=0) for h in reversed(chain[32:])] + [BlockRemoved([999], "GPU")]
    cuts: list[int] = []
    cut = applier.index._cut
    applier.index._cut = lambda w, lookup, node, pos, ext: cuts.append(pos) or cut(w, lookup, node, pos, ext)  # type: ignore[method-assign]
    applier.apply_batch(decode_batch(encode_batch(evictions, 0)))
    assert applier.index.find_matches(local_block_hashes(_tokens(chain), BS)) == {(7, 0): 32}
    assert applier.counters[("removed", "ok")] == 32
    assert applier.counters[("removed", "block_not_found")] == 1
    assert cuts == [32]  # the 32 blocks evicted last first: one cut


def test_a_removal_naming_another_workers_block_does_not_join_the_run() -> None:
    """Two workers hold the same blocks under their own external hashes: a worker's eviction run that names
    the other's hash for a lower block is not found for it, and its blocks below the run stay."""
    index = KvIndex(BS)
    a, b = EventApplier(index, 7, 0), EventApplier(index, 8, 0)
    chain_a, chain_b = list(range(100, 108)), list(range(200, 208))
    tokens = _tokens(chain_a)
    a.apply_batch(decode_batch(encode_batch([BlockStored(chain_a, None, tokens, BS, None, "GPU", None)], 0)))
    b.apply_batch(decode_batch(encode_batch([BlockStored(chain_b, None, tokens, BS, None, "GPU", None)], 0)))
    run = [BlockRemoved([h], "GPU") for h in (chain_a[7], chain_a[6], chain_b[5])]
    a.apply_batch(decode_batch(encode_batch(run, 0)))
    assert index.find_matches(local_block_hashes(tokens, BS)) == {(7, 0): 6, (8, 0): 8}
    assert a.counters[("removed", "ok")] == 2 and a.counters[("removed", "block_not_found")] == 1
