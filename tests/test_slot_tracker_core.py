"""Slot tracker core: tables verified on the 1.6.1 binaries (decode blocks as distinct prompt-path prefixes, prefill
tokens per slot) and the lifecycle rules."""

from __future__ import annotations

import random

import pytest

from slot_tracker.core import EXPIRY_ENV, SlotRegistry, SlotTrackerError, expiry_from_env


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def one_slot_tracker(clock=None):
    reg = SlotRegistry(clock=clock or FakeClock())
    reg.register(1, "m", "default", 16, 0, 1)
    return reg, reg.get("m", "default")


def test_active_decode_blocks_count_distinct_path_prefixes_43():
    """Decode blocks (verified on 1.6.1): r1 [1,2,3] + r2 [1,2,4,5] => 5; + r3 [7,7,8] => 8; + r4 [4,5] => 10;
    free r2 => 8."""
    _, t = one_slot_tracker()
    t.add("r1", 1, 0, [1, 2, 3])
    t.add("r2", 1, 0, [1, 2, 4, 5])
    assert t.active_decode_blocks(1, 0) == 5
    t.add("r3", 1, 0, [7, 7, 8])
    assert t.active_decode_blocks(1, 0) == 8  # both 7s count
    t.add("r4", 1, 0, [4, 5])
    assert t.active_decode_blocks(1, 0) == 10  # rooted [4,5] differs from 1,2,4,5
    assert t.free("r2") is True
    assert t.active_decode_blocks(1, 0) == 8


@pytest.mark.parametrize(
    "query, d, expected",
    [
        ([1, 2, 6], 2, 6),
        ([6, 1, 2], 0, 8),
        ([1, 4], 1, 6),
        ([4, 5], 0, 7),
        ([2], 0, 6),
        ([6, 6], 0, 7),
        ([1, 1], 1, 6),
        ([3, 2, 1], 0, 8),
        ([1, 2, 3, 4, 5], 3, 7),
        ([], 0, 5),
    ],
)
def test_potential_decode_blocks_table_44(query, d, expected):
    """Prefill tokens (verified on 1.6.1): slot with r1 [1,2,3] isl 40 and r2 [1,2,4,5] isl 10 (50 tokens /
    5 blocks)."""
    reg, t = one_slot_tracker()
    t.add("r1", 1, 0, [1, 2, 3], 40)
    t.add("r2", 1, 0, [1, 2, 4, 5], 10)
    assert t.active_prefill_tokens(1, 0) == 50 and t.active_decode_blocks(1, 0) == 5
    [load] = t.potential_loads(query, 48)
    assert load == (1, 0, 50 + 48, expected, 2)
    assert expected == 5 + len(query) - d


def test_idle_slots_and_every_slot_reported():
    reg = SlotRegistry(clock=FakeClock())
    reg.register(7, "m", "default", 16, 0, 2)
    reg.register(3, "m", "default", 16, 4, 1)
    t = reg.get("m", "default")
    t.add("a", 7, 1, [5, 6], 10)
    loads = t.potential_loads([5, 6, 6], 4)
    assert sorted(loads) == [(3, 4, 4, 3, 0), (7, 0, 4, 3, 0), (7, 1, 14, 3, 1)]  # duplicates in q not deduplicated


def test_document_example_projection():
    """The document's /add then /potential_loads example: 48 + 48 tokens, 3 blocks + 1 new."""
    reg = SlotRegistry(clock=FakeClock())
    reg.register(7, "llama-3-8b", "default", 16, 0, 2)
    t = reg.get("llama-3-8b", "default")
    t.add("req-123", 7, 0, [101, (-22) & ((1 << 64) - 1), 303], 48)
    t.add("req-124", 7, 0, [101], 0)
    loads = {(row[0], row[1]): row for row in t.potential_loads([101, (-22) & ((1 << 64) - 1), 303, 404], 48)}
    assert loads[(7, 0)] == (7, 0, 96, 4, 2)
    assert loads[(7, 1)] == (7, 1, 48, 4, 0)


def test_lifecycle_rules_42():
    reg, t = one_slot_tracker()
    with pytest.raises(SlotTrackerError) as e:
        t.add("x", 2, 0, [1])
    assert e.value.status == 404 and "worker_id: 2, dp_rank: 0" in e.value.message
    with pytest.raises(SlotTrackerError) as e:
        t.add("x", 1, 1, [1])
    assert e.value.status == 404
    t.add("x", 1, 0, [1, 2], 30)
    with pytest.raises(SlotTrackerError) as e:
        t.add("x", 1, 0, [9, 9, 9], 5)
    assert e.value.status == 409 and e.value.message.startswith("Request x already exists")
    assert (t.active_prefill_tokens(1, 0), t.active_decode_blocks(1, 0), t.active_requests(1, 0)) == (
        30,
        2,
        1,
    )  # unchanged
    t.prefill_complete("x")
    t.prefill_complete("x")  # repeat is a no-op
    assert t.active_prefill_tokens(1, 0) == 0 and t.active_decode_blocks(1, 0) == 2
    with pytest.raises(SlotTrackerError) as e:
        t.prefill_complete("nope")
    assert e.value.status == 404 and e.value.message == "Request nope not found"
    assert t.free("nope") is False  # idempotent
    assert t.free("x") is True and t.free("x") is False
    assert (t.active_prefill_tokens(1, 0), t.active_decode_blocks(1, 0), t.active_requests(1, 0)) == (0, 0, 0)
    assert t._root.kids == {}  # trie fully released


def test_zero_isl_means_no_prefill_tracking_and_free_releases_pending_prefill():
    _, t = one_slot_tracker()
    t.add("a", 1, 0, [1], 0)
    t.add("b", 1, 0, [1], 25)
    assert t.active_prefill_tokens(1, 0) == 25
    t.free("b")
    assert t.active_prefill_tokens(1, 0) == 0 and t.active_decode_blocks(1, 0) == 1


def test_registration_rules():
    reg = SlotRegistry(clock=FakeClock())
    cases = [
        ((1, "m", "default", 0, 0, 1), 400, "block_size must be greater than 0"),
        ((1, "m", "default", 16, 0, 0), 400, "dp_size must be greater than 0"),
        ((1, "m", "default", 16, 4294967295, 1), 400, "dp range overflows u32: start=4294967295 size=1"),
        ((1, "m", "default", 16, 4294967295, 2), 400, "dp range overflows u32: start=4294967295 size=2"),
        ((1, "m", "default", 16, 0, 4097), 400, "dp_size 4097 exceeds the maximum 4096"),
        (
            (1, "m", "default", 16, 4294967295, 5000),
            400,
            "dp_size 5000 exceeds the maximum 4096",
        ),  # checked before overflow
        ((1, "m", "default", 0, 0, 5000), 400, "block_size must be greater than 0"),
    ]
    for args, status, msg in cases:
        with pytest.raises(SlotTrackerError) as e:
            reg.register(*args)
        assert (e.value.status, e.value.message) == (status, msg)
    reg.register(1, "m", "default", 16, 4294967294, 1)  # exclusive end 2^32-1 still fits
    reg.register(7, "m", "default", 16, 0, 4096)  # the largest range
    assert len(reg.get("m", "default").slots()) == 4097
    reg.unregister(7, "m", "default")
    with pytest.raises(SlotTrackerError) as e:
        reg.register(1, "m", "default", 16, 0, 1)
    assert e.value.status == 409 and "already registered" in e.value.message
    with pytest.raises(SlotTrackerError) as e:
        reg.register(2, "m", "default", 32, 0, 1)
    assert e.value.status == 409 and "existing=16, requested=32" in e.value.message
    reg.register(1, "m", "t2", 32, 0, 1)  # worker ids scoped per (model, tenant)
    assert [(w["worker_id"], w["tenant_id"], w["block_size"]) for w in reg.workers()] == [
        (1, "default", 16),
        (1, "t2", 32),
    ]
    assert [w["tenant_id"] for w in reg.workers(tenant_id="t2")] == ["t2"]
    assert reg.workers(model_name="zz") == []


def test_unregister_drops_requests_and_deletes_tracker_with_last_worker():
    reg = SlotRegistry(clock=FakeClock())
    reg.register(1, "m", "default", 16, 0, 2)
    reg.register(2, "m", "default", 16, 0, 1)
    t = reg.get("m", "default")
    t.add("a", 1, 1, [1, 2], 10)
    t.add("b", 2, 0, [1, 2], 10)
    reg.unregister(1, "m", "default")
    assert not t.has_request("a") and t.has_request("b")
    t.add("a", 2, 0, [1, 3])  # the id is free again
    with pytest.raises(SlotTrackerError) as e:
        reg.unregister(1, "m", "default")
    assert e.value.status == 404 and e.value.message == "worker 1 not found for model=m tenant_id=default"
    reg.unregister(2, "m", "default")
    assert reg.get("m", "default") is None and reg.loads() == []
    reg.register(3, "m", "default", 64, 0, 1)  # block size may change once the tracker is gone
    assert reg.get("m", "default").block_size == 64


def test_request_ids_unique_per_tracker_only():
    reg = SlotRegistry(clock=FakeClock())
    reg.register(1, "m", "a", 16, 0, 1)
    reg.register(1, "m", "b", 16, 0, 1)
    reg.get("m", "a").add("r", 1, 0, [1])
    reg.get("m", "b").add("r", 1, 0, [1])
    with pytest.raises(SlotTrackerError):
        reg.get("m", "a").add("r", 1, 0, [2])


def test_loads_listing_sorted_including_idle_slots():
    reg = SlotRegistry(clock=FakeClock())
    reg.register(9, "m", "default", 16, 0, 1)
    reg.register(2, "m", "default", 16, 1, 2)
    reg.register(5, "a", "z", 8, 0, 1)
    reg.get("m", "default").add("r", 2, 2, [4, 5, 6], 7)
    rows = [
        (
            row["model_name"],
            row["tenant_id"],
            row["worker_id"],
            row["dp_rank"],
            row["active_prefill_tokens"],
            row["active_decode_blocks"],
        )
        for row in reg.loads()
    ]
    assert rows == [
        ("a", "z", 5, 0, 0, 0),
        ("m", "default", 2, 1, 0, 0),
        ("m", "default", 2, 2, 7, 3),
        ("m", "default", 9, 0, 0, 0),
    ]
    assert [row["worker_id"] for row in reg.loads(model_name="m", tenant_id="default")] == [2, 2, 9]


def test_stale_expiry_is_absolute_age_since_add_45():
    clock = FakeClock()
    reg, t = one_slot_tracker(clock)
    t.add("old", 1, 0, [1], 5)
    clock.now += 60
    t.add("young", 1, 0, [1, 2], 5)
    t.prefill_complete("old")  # activity does not refresh the age
    clock.now += 239.9
    assert reg.expire_stale() == 0
    clock.now += 0.1  # 300 s after "old"
    assert reg.expire_stale() == 1
    assert not t.has_request("old") and t.has_request("young")
    assert t.active_decode_blocks(1, 0) == 2
    clock.now += 60
    assert reg.expire_stale() == 1 and len(t) == 0


def test_expiry_env_override(monkeypatch):
    monkeypatch.setenv(EXPIRY_ENV, "12.5")
    assert expiry_from_env() == 12.5
    monkeypatch.setenv(EXPIRY_ENV, "junk")
    assert expiry_from_env() == 300.0


def test_observer_sees_local_changes_only():
    reg = SlotRegistry(clock=FakeClock())
    seen = []
    reg.observer = seen.append
    reg.register(1, "m", "default", 16, 0, 1)
    t = reg.get("m", "default")
    t.add("a", 1, 0, [1, 2], 3)
    t.prefill_complete("a")
    t.free("a")
    t.free("a")  # unknown now: nothing to tell
    t.add("b", 1, 0, [1], 0, notify=False)
    assert [(e.kind, e.request_id, e.worker_id, e.dp_rank) for e in seen] == [
        ("add", "a", 1, 0),
        ("prefill_complete", "a", 1, 0),
        ("free", "a", 1, 0),
    ]
    assert list(seen[0].sequence_hashes) == [1, 2] and seen[0].new_isl_tokens == 3 and seen[0].block_size == 16


def test_output_blocks_with_osl_decay_47():
    _, t = one_slot_tracker()
    t.add("shared", 1, 0, [1, 2])
    t.add("r", 1, 0, [1, 2, 3, 4])  # exclusive suffix: positions 3, 4
    assert t.active_decode_blocks(1, 0) == 4
    t.add_output_block("r")  # no expected length: weight 1
    t.add_output_block("r")
    assert t.active_decode_blocks(1, 0) == 6
    # E = 100, 50 generated: decay 0.5 -> shared 2 + exclusive 2*0.5 + output 2*0.5 = 4
    t.add_output_block("r", expected_output_tokens=100, generated_tokens=50)
    # now 3 output blocks: 2 + 1 + 1.5 = 4.5 -> rounds half up to 5
    assert t.active_decode_blocks(1, 0) == 5
    t.add_output_block("r", expected_output_tokens=100, generated_tokens=150)  # decay floors at 0
    assert t.active_decode_blocks(1, 0) == 2
    [load] = t.potential_loads([1, 2, 9], 0)
    assert load[3] == 3  # potential_decode_blocks
    t.free("r")
    assert t.active_decode_blocks(1, 0) == 2 and t.output_blocks("r") == 0
    assert t.add_output_block("r") is False


def _brute_force(paths_by_slot, query):
    """Oracle: decode blocks = distinct path prefixes; D = longest prefix of query held on the slot."""
    out = {}
    for slot, paths in paths_by_slot.items():
        prefixes = {tuple(p[: i + 1]) for p in paths for i in range(len(p))}
        d = 0
        while d < len(query) and tuple(query[: d + 1]) in prefixes:
            d += 1
        out[slot] = (len(prefixes), len(prefixes) + len(query) - d)
    return out


def test_randomised_against_brute_force_oracle():
    rng = random.Random(20261122)
    reg = SlotRegistry(clock=FakeClock())
    reg.register(1, "m", "default", 16, 0, 3)
    reg.register(2, "m", "default", 16, 0, 2)
    t = reg.get("m", "default")
    live: dict[str, tuple[tuple[int, int], list[int]]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.5 or not live:
            slot = rng.choice(t.slots())
            base = rng.choice([[], [1], [1, 2], [1, 2, 3], [5, 5]])
            path = base + [rng.randrange(6) for _ in range(rng.randrange(5))]
            rid = f"r{step}"
            t.add(rid, slot[0], slot[1], path)
            live[rid] = (slot, path)
        else:
            rid = rng.choice(sorted(live))
            t.free(rid)
            del live[rid]
        query = [rng.randrange(6) for _ in range(rng.randrange(6))]
        if rng.random() < 0.5 and live:
            query = list(live[rng.choice(sorted(live))][1][: rng.randrange(6)]) + query[:1]
        by_slot = {s: [p for (sl, p) in live.values() if sl == s] for s in t.slots()}
        expect = _brute_force(by_slot, query)
        for load in t.potential_loads(query):
            slot = (load[0], load[1])
            assert (t.active_decode_blocks(*slot), load[3]) == expect[slot], (step, slot, query)
