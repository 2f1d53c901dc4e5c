"""KvIndex (indexer/core.py): examples verified on the 1.6.1 radix tree and our own rules."""

from __future__ import annotations

import pytest

from indexer.core import DEVICE, DISK, EXTERNAL, HOST_PINNED, KvIndex, apply_router_event, tier_for_medium

BS = 16
W = (1, 0)


def blocks(*pairs: int) -> list[tuple[int, int]]:
    """(ext, local) with local = ext + 100, so tests read in external hashes."""
    return [(e, e + 100) for e in pairs]


def q(*exts: int) -> list[int]:
    return [e + 100 for e in exts]


def test_stored_chain_matches_leading_blocks_only() -> None:
    ix = KvIndex(BS)
    assert ix.apply_stored(1, 0, None, blocks(11, 12, 13))
    assert ix.find_matches(q(11, 12, 13)) == {W: 3}
    assert ix.find_matches(q(11, 12, 99)) == {W: 2}
    assert ix.find_matches(q(99, 12, 13)) == {}  # no zero entries
    assert ix.find_matches([]) == {}
    assert ix.size == 3


def test_removal_cuts_the_path_below_and_restore_does_not_revive_same_run() -> None:
    """As the reference: remove 12 -> 1 block; re-store 12 under 11 -> 2 (13 not revived)."""
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(11, 12, 13))
    assert ix.apply_removed(1, 0, [12]) == 1
    assert ix.find_matches(q(11, 12, 13)) == {W: 1}
    assert ix.apply_stored(1, 0, 11, blocks(12))
    assert ix.find_matches(q(11, 12, 13)) == {W: 2}


def test_removal_leaves_deeper_runs_so_a_restore_reaches_them_again() -> None:
    """After another worker split the run, the cut stops at the run boundary (reference behaviour)."""
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(1, 2, 3, 4))
    ix.apply_stored(2, 0, None, blocks(1, 2, 5))
    ix.apply_removed(1, 0, [1])
    assert ix.find_matches(q(1, 2, 3, 4)) == {(2, 0): 2}
    ix.apply_stored(1, 0, None, blocks(1, 2))
    assert ix.find_matches(q(1, 2, 3, 4)) == {(1, 0): 4, (2, 0): 2}


def test_other_workers_keep_shared_positions() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(11, 12, 13))
    ix.apply_stored(2, 0, None, blocks(11, 12))
    ix.apply_removed(1, 0, [11])
    assert ix.find_matches(q(11, 12, 13)) == {(2, 0): 2}


def test_parent_must_be_held_and_not_repeated() -> None:
    ix = KvIndex(BS)
    assert not ix.apply_stored(1, 0, 77, blocks(12))  # unknown parent: whole event dropped
    ix.apply_stored(1, 0, None, blocks(11))
    assert not ix.apply_stored(1, 0, 11, blocks(12, 11))  # parent repeated among the blocks
    assert ix.apply_stored(1, 0, 11, blocks(12, 13))
    assert ix.find_matches(q(11, 12, 13)) == {W: 3}
    ix.apply_removed(1, 0, [11])
    assert not ix.apply_stored(1, 0, 13, blocks(14))  # parent no longer held


def test_unknown_removals_are_skipped() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(11, 12))
    assert ix.apply_removed(1, 0, [999, 12]) == 1
    assert ix.find_matches(q(11, 12)) == {W: 1}
    assert ix.apply_removed(5, 0, [11]) == 0


def test_dp_ranks_are_separate_workers() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(11, 12))
    ix.apply_stored(1, 1, None, blocks(11))
    assert ix.find_matches(q(11, 12)) == {(1, 0): 2, (1, 1): 1}
    ix.apply_cleared(1, 1)
    assert ix.find_matches(q(11, 12)) == {(1, 0): 2}


def test_cleared_and_worker_removal_cover_all_tiers_and_ranks() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(10))
    ix.apply_stored(1, 0, 10, blocks(11), HOST_PINNED)
    ix.apply_stored(1, 3, None, blocks(10))  # a rank never registered (batch override)
    ix.apply_stored(2, 0, None, blocks(10))
    ix.apply_cleared(1, 0)
    assert ix.tier_matches(q(10, 11)) == {(1, 3): (1, 1, 1), (2, 0): (1, 1, 1)}
    ix.remove_worker(1)
    assert ix.tier_matches(q(10, 11)) == {(2, 0): (1, 1, 1)}
    ix.remove_worker(2, 0)
    assert ix.tier_matches(q(10, 11)) == {}
    assert ix.workers() == set()


def test_lower_tier_breakdown_examples() -> None:
    """Tiers as the reference orders them: device [10], host [11, 12] chained on it, disk [13] -> 1 / 3 / 4 blocks."""
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(10))
    ix.apply_stored(1, 0, 10, blocks(11, 12), HOST_PINNED)
    ix.apply_stored(1, 0, 12, blocks(13), DISK)
    query = q(10, 11, 12, 13)
    assert ix.tier_matches(query) == {W: (1, 3, 4)}
    ix.apply_removed(1, 0, [12], HOST_PINNED)
    assert ix.tier_matches(query) == {W: (1, 2, 2)}
    ix.apply_stored(1, 0, 11, blocks(12), HOST_PINNED)  # the missing link makes disk 13 reachable again
    assert ix.tier_matches(query) == {W: (1, 3, 4)}
    ix.apply_removed(1, 0, [10])
    assert ix.tier_matches(query) == {}  # lower tiers need a device anchor or a root edge


def test_lower_tier_must_continue_from_the_device_anchor() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(10))
    # The host copy of the same tokens under other external hashes: a root chain 20 -> 21.
    ix.apply_stored(1, 0, None, [(20, 110), (21, 111)], HOST_PINNED)
    assert ix.tier_matches(q(10, 11)) == {W: (1, 1, 1)}  # host cannot continue from device hash 10


def test_lower_tier_only_worker_and_external_counts_in_disk() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(2, 0, None, blocks(10), DISK)
    ix.apply_stored(2, 0, 10, blocks(11), EXTERNAL)
    assert ix.tier_matches(q(10, 11)) == {(2, 0): (0, 0, 2)}
    assert ix.find_matches(q(10, 11)) == {}


def test_lower_tier_existing_edge_wins() -> None:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, [(10, 500)], HOST_PINNED)
    ix.apply_stored(2, 0, None, [(20, 500)], HOST_PINNED)  # same content, another external hash
    assert ix.tier_matches([500]) == {(1, 0): (0, 1, 1)}


def test_divergent_external_hashes_still_extend_their_own_chain() -> None:
    """Our answer to the reference's first-inserter quirk (it keeps only the first inserter's external hash of
    a position): B uses its own hashes."""
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, [(11, 101), (12, 102)])
    ix.apply_stored(2, 0, None, [(21, 101), (22, 102)])  # same tokens, B's engine names them 21, 22
    assert ix.apply_stored(2, 0, 22, [(23, 103)])  # the reference drops this (parent not found)
    assert ix.find_matches([101, 102, 103]) == {(1, 0): 2, (2, 0): 3}
    ix.apply_stored(2, 0, 23, [(24, 104)], HOST_PINNED)  # B's own hash anchors its host chain
    assert ix.tier_matches([101, 102, 103, 104])[(2, 0)] == (3, 4, 4)
    assert ix.apply_removed(2, 0, [22]) == 1
    assert ix.find_matches([101, 102, 103]) == {(1, 0): 2, (2, 0): 1}


def test_medium_table() -> None:
    for medium in (None, "", "GPU", "DEVICE"):
        assert tier_for_medium(medium) == DEVICE
    for medium in ("CPU", "CPU_PINNED", "CPU_TIER1"):
        assert tier_for_medium(medium) == HOST_PINNED
    for medium in ("CPU_TIER2", "DISK", "NVME", "STORAGE"):
        assert tier_for_medium(medium) == DISK
    for medium in ("EXTERNAL", "NETWORK", "REMOTE", "SHARED"):
        assert tier_for_medium(medium) == EXTERNAL
    for medium in ("cpu", "FOO", "FS", "OBJ"):
        assert tier_for_medium(medium) is None


def _populated() -> KvIndex:
    ix = KvIndex(BS)
    ix.apply_stored(1, 0, None, blocks(11, 12, 13))
    ix.apply_stored(2, 1, None, blocks(11, 12))
    ix.apply_stored(2, 1, 12, blocks(14))
    ix.apply_stored(3, 0, None, blocks(11, 12, 13, 15))
    ix.apply_removed(3, 0, [15])
    ix.apply_stored(1, 0, 12, blocks(14), HOST_PINNED)
    ix.apply_stored(1, 0, 14, blocks(16), DISK)
    return ix


def test_dump_has_the_reference_shape_and_restores_to_the_same_answers() -> None:
    ix = _populated()
    events = ix.dump_events()
    first = events[0]
    assert set(first) == {"worker_id", "storage_tier", "residency_domain", "event"}
    assert first["residency_domain"] == "worker"
    assert set(first["event"]) == {"event_id", "data", "dp_rank"}
    stored = first["event"]["data"]["stored"]
    assert set(stored) == {"parent_hash", "start_position", "blocks"}
    assert stored["start_position"] is None
    assert set(stored["blocks"][0]) == {"block_hash", "tokens_hash", "mm_extra_info"}
    tiers = [e["storage_tier"] for e in events]
    assert tiers.index("host_pinned") > max(i for i, t in enumerate(tiers) if t == "device")
    assert [e["event"]["event_id"] for e in events if e["storage_tier"] == "device"] == list(
        range(tiers.count("device"))
    )

    copy = KvIndex(BS)
    assert copy.restore_events(events) == len(events)
    for query in (q(11, 12, 13, 15), q(11, 12, 14, 16), q(11), q(12)):
        assert copy.tier_matches(query) == ix.tier_matches(query)


def test_restore_accepts_removed_and_cleared_events_and_rejects_garbage() -> None:
    ix = _populated()
    apply_router_event(
        ix, {"worker_id": 2, "event": {"event_id": 0, "dp_rank": 1, "data": {"removed": {"block_hashes": [12]}}}}
    )
    assert (2, 1) not in ix.find_matches(q(11, 12, 14)) or ix.find_matches(q(11, 12, 14))[(2, 1)] == 1
    apply_router_event(ix, {"worker_id": 1, "event": {"event_id": 1, "dp_rank": 0, "data": "cleared"}})
    apply_router_event(ix, {"worker_id": 3, "event": {"event_id": 2, "dp_rank": 0, "data": {"cleared": None}}})
    assert ix.find_matches(q(11, 12, 13)) == {(2, 1): 1}
    for bad in (
        {},
        {"worker_id": "x"},
        {"worker_id": 1, "event": {"data": {"stored": {"blocks": "no"}}}},
        {"worker_id": 1, "storage_tier": "moon", "event": {}},
    ):
        with pytest.raises(ValueError):
            apply_router_event(ix, bad)


def test_long_query_hot_path_shape() -> None:
    """64-block queries over a shared prefix: per-worker leading counts."""
    ix = KvIndex(BS)
    base = list(range(1000, 1064))
    ix.apply_stored(1, 0, None, [(h, h) for h in base])
    ix.apply_stored(2, 0, None, [(h, h) for h in base[:40]])
    ix.apply_stored(2, 0, base[39], [(5000 + i, 7000 + i) for i in range(10)])
    assert ix.find_matches(base) == {(1, 0): 64, (2, 0): 40}


def test_a_long_run_evicted_tail_first_shrinks_block_by_block() -> None:
    """vLLM evicts a finished request's blocks tail first, one BlockRemoved per block: each removal
    uncovers exactly that block (and touches only the positions still covered)."""
    from indexer.core import KvIndex

    idx = KvIndex(16)
    locs = [1000 + i for i in range(300)]
    exts = [5000 + i for i in range(300)]
    idx.apply_stored(7, 0, None, list(zip(exts, locs, strict=True)))
    idx.apply_stored(8, 0, None, list(zip(exts[:100], locs[:100], strict=True)))
    for k, ext in enumerate(reversed(exts), 1):
        assert idx.apply_removed(7, 0, [ext]) == 1
        expected = {(7, 0): 300 - k} if k < 300 else {}
        expected[(8, 0)] = 100
        assert idx.find_matches(locs) == expected, k
