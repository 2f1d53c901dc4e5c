"""Live cache footprint (router/footprint.py): what a rank's recent requests used, and what a new prompt
would push out of its cache."""

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute_common.hashing import local_block_hashes, sequence_hashes
from router.footprint import LiveFootprint


def _chain(tokens: list[int]) -> list[int]:
    return sequence_hashes(local_block_hashes(tokens, 4))


def test_live_blocks_are_the_recently_used_ones_and_expire_after_the_horizon() -> None:
    fp = LiveFootprint(horizon_s=10.0)
    a = _chain(list(range(40)))  # 10 blocks
    fp.touch((1, 0), a, now=0.0)
    assert fp.live_blocks((1, 0), 5.0) == 10 and fp.live_blocks((2, 0), 5.0) == 0
    fp.touch((1, 0), a[:4], now=8.0)  # a later request reused the first 4 blocks
    assert fp.live_blocks((1, 0), 9.0) == 10
    assert fp.live_blocks((1, 0), 12.0) == 4  # the tail expired, the reused prefix did not
    assert fp.live_prefix((1, 0), a, 12.0) == 4
    assert fp.live_blocks((1, 0), 20.0) == 0
    assert fp.snapshot(20.0) == {"1:0": 0}


def test_live_prefix_follows_the_chain() -> None:
    fp = LiveFootprint()
    turn1 = _chain(list(range(24)))  # 6 blocks
    turn2 = _chain(list(range(24)) + list(range(100, 116)))  # the same 6 then 4 more
    other = _chain(list(range(200, 224)))
    fp.touch((1, 0), turn1, now=0.0)
    assert fp.live_prefix((1, 0), turn2, 1.0) == 6
    assert fp.live_prefix((1, 0), other, 1.0) == 0
    assert fp.live_prefix((1, 0), turn1[:3], 1.0) == 3
    assert fp.live_prefix((1, 0), [], 1.0) == 0


def test_overflow_counts_only_what_no_longer_fits() -> None:
    fp = LiveFootprint()
    fp.touch((1, 0), _chain(list(range(32))), now=0.0)  # 8 live blocks
    new = _chain(list(range(500, 524)))  # 6 blocks, none live
    assert fp.overflow_blocks((1, 0), new, capacity_blocks=20, now=1.0) == 0  # 8 + 6 fit in 20
    assert fp.overflow_blocks((1, 0), new, capacity_blocks=10, now=1.0) == 4  # 14 in 10: 4 live blocks go
    assert fp.overflow_blocks((1, 0), new, capacity_blocks=4, now=1.0) == 6  # at most what the prompt adds
    # a prompt already live there adds nothing
    assert fp.overflow_blocks((1, 0), _chain(list(range(32))), capacity_blocks=4, now=1.0) == 0
    assert fp.overflow_blocks((2, 0), new, capacity_blocks=4, now=1.0) == 2  # an empty rank: only its own excess


def test_forgetting_a_worker_and_bad_horizons() -> None:
    fp = LiveFootprint()
    fp.touch((1, 0), _chain(list(range(8))), now=0.0)
    fp.touch((1, 1), _chain(list(range(8))), now=0.0)
    fp.touch((2, 0), _chain(list(range(8))), now=0.0)
    fp.forget_worker(1)
    assert fp.snapshot(0.0) == {"2:0": 2}
    with pytest.raises(ValueError):
        LiveFootprint(0.0)
    # a worker forgotten while its long prompt is still being recorded: the touches behind it go on
    sliced = LiveFootprint(slice_blocks=4)
    sliced.touch((1, 0), _chain(list(range(80))), now=0.0)  # 20 blocks: 3 recorded, the rest pending
    sliced.touch((2, 0), _chain(list(range(500, 540))), now=0.0)  # 10 blocks, waiting behind it
    sliced.forget_worker(1)
    for _ in range(10):  # bounded: each call records a slice
        if not sliced.settle():
            break
    assert sliced.snapshot(0.0) == {"2:0": 10} and not sliced.unsettled


def test_a_long_prompt_is_recorded_a_slice_at_a_time_and_ends_as_if_at_once() -> None:
    """No step of the event loop grows with a prompt: a touch starts (one unit of the slice) and records
    at most slice_blocks new blocks, first blocks first, and settle() the rest, a slice a call, later
    touches waiting behind it; settled, the footprint is the same as one recorded at once, and expiry
    removes at most a slice per call, a chain's tail first."""
    long = _chain(list(range(4 * 100)))  # 100 blocks
    short = _chain(list(range(1000, 1016)))  # 4 blocks, touched while the long one is pending
    eager = LiveFootprint(slice_blocks=1000)
    sliced = LiveFootprint(slice_blocks=30)
    for fp in (eager, sliced):
        fp.touch((1, 0), long, now=0.0)
        if fp is sliced:  # the long prompt's first 29 blocks
            assert sliced.live_blocks((1, 0), 0.0) == 29 and sliced.unsettled
            assert sliced.live_prefix((1, 0), long, 0.0) == 29
        fp.touch((1, 0), short, now=0.5)  # settles another slice of the older touch first
    assert not eager.unsettled and eager.live_blocks((1, 0), 1.0) == 104
    assert sliced.live_blocks((1, 0), 1.0) == 59 and sliced.live_prefix((1, 0), short, 1.0) == 0
    assert sliced.settle()  # long[59:89]
    assert sliced.live_blocks((1, 0), 1.0) == 89
    assert not sliced.settle()  # long[89:], then the short prompt
    assert set(sliced._ranks[(1, 0)].blocks.keys()) == set(eager._ranks[(1, 0)].blocks.keys()) == set(long) | set(short)
    assert sliced.live_prefix((1, 0), long, 1.0) == 100 and sliced.live_prefix((1, 0), short, 1.0) == 4
    # expiry: all 104 blocks are past the horizon; each call removes at most a slice, oldest run first, tail first
    assert sliced.live_blocks((1, 0), 100.0) == 74
    assert sliced.live_prefix((1, 0), long, 100.0) == 40  # another slice gone, still prefix-closed: tail first
    for _ in range(3):
        sliced.live_blocks((1, 0), 100.0)
    assert sliced.live_blocks((1, 0), 100.0) == 0
    with pytest.raises(ValueError):
        LiveFootprint(slice_blocks=0)


def test_a_conversation_keeps_one_run_however_many_turns_it_has() -> None:
    """A touch stamps one run per place its chain branches, so the work of a next turn does not grow with
    the turns before it: fifty turns of a conversation extend one run; a second conversation on the same
    system prompt splits it once (the system prompt, the first conversation's rest, the second's)."""
    fp = LiveFootprint()
    system = list(range(40))  # 10 blocks
    turns: list[int] = []
    for t in range(50):
        turns += list(range(1000 + 8 * t, 1008 + 8 * t))  # 2 blocks a turn
        fp.touch((1, 0), _chain(system + turns), now=0.1 * t)
    rank = fp._ranks[(1, 0)]
    assert len(rank.runs) == 1 and fp.live_blocks((1, 0), 5.0) == 110
    fp.touch((1, 0), _chain(system + list(range(5000, 5008))), now=5.0)
    assert len(rank.runs) == 3 and fp.live_blocks((1, 0), 5.0) == 112
    # ten seconds after the first conversation's last turn only the second conversation is live
    assert fp.live_blocks((1, 0), 14.95) == 12 and fp.live_prefix((1, 0), _chain(system + turns), 14.95) == 10


def _settled(fp: LiveFootprint, key: tuple[int, int], now: float) -> int:
    """The rank's live blocks once every pending touch is recorded and every expired block removed."""
    for _ in range(1000):  # bounded: each call records or removes at least one unit of work
        if not fp.settle():
            break
    live = fp.live_blocks(key, now)
    for _ in range(1000):
        after = fp.live_blocks(key, now)
        if after == live:
            return live
        live = after
    raise AssertionError("expiry did not finish")


# a prompt: up to 8 blocks, each one of three labels, so prompts share prefixes and diverge everywhere
_PROMPT = st.lists(st.integers(0, 2), min_size=1, max_size=8)
_TOUCH = st.tuples(st.integers(0, 1), _PROMPT, st.sampled_from([0.0, 0.5, 2.0, 6.0, 11.0]), st.booleans())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOUCH, min_size=1, max_size=25), st.sampled_from([1, 2, 3, 1000]), st.lists(_PROMPT, max_size=4))
def test_the_footprint_is_every_touch_stamping_every_block_of_its_prompt(
    touches: list[tuple[int, list[int], float, bool]], slice_blocks: int, probes: list[list[int]]
) -> None:
    """Whatever the touches (shared prefixes, prompts ending inside others, turns continuing expired ones,
    touches arriving while earlier ones are still being recorded, any slice), once settled the live set
    is the one a model gets by stamping every block of every touched prompt with its time: the same
    count on every rank and the same live prefix for every prompt, at every touch's time and after it."""
    fp = LiveFootprint(horizon_s=10.0, slice_blocks=slice_blocks)
    model: dict[tuple[int, int], dict[int, float]] = {(0, 0): {}, (1, 0): {}}
    now = 0.0

    def chain(labels: list[int]) -> list[int]:
        return _chain([t for label in labels for t in (label, label, label, label)])

    def check(at: float) -> None:
        for key, stamps in model.items():
            alive = {h for h, t in stamps.items() if t >= at - 10.0}
            assert _settled(fp, key, at) == len(alive), key
            if key in fp._ranks:  # the count kept beside the map is the map's size
                assert fp._ranks[key].count == len(fp._ranks[key].blocks), key
            for labels in probes + [p for _, p, _, _ in touches]:
                seq = chain(labels)
                expected = next((i for i, h in enumerate(seq) if h not in alive), len(seq))
                assert fp.live_prefix(key, seq, at) == expected, (key, labels)

    for rank, labels, step, settle in touches:
        now += step
        seq = chain(labels)
        fp.touch((rank, 0), seq, now)
        for h in seq:
            model[(rank, 0)][h] = now
        if settle:
            check(now)
    check(now)
    check(now + 5.0)
    check(now + 10.5)


def test_pressure_grows_with_how_full_the_live_set_makes_the_cache() -> None:
    fp = LiveFootprint()
    fp.touch((1, 0), _chain(list(range(40))), now=0.0)  # 10 live blocks
    assert fp.pressure_blocks((1, 0), capacity_blocks=20, now=1.0) == pytest.approx(5.0)  # half full: 10 x 1/2
    assert fp.pressure_blocks((1, 0), capacity_blocks=10, now=1.0) == pytest.approx(10.0)  # full
    assert fp.pressure_blocks((1, 0), capacity_blocks=5, now=1.0) == pytest.approx(10.0)  # over: at most 1 per block
    assert fp.pressure_blocks((1, 0), capacity_blocks=10_000, now=1.0) < 0.02  # a huge cache: almost nothing
    assert fp.pressure_blocks((2, 0), capacity_blocks=10, now=1.0) == 0.0
    assert fp.pressure_blocks((1, 0), capacity_blocks=0, now=1.0) == 0.0


def test_a_conversations_next_turn_pays_no_room_on_its_rank_while_the_cache_has_room() -> None:
    """The room charge spreads new footprint; a prompt that extends one routed to the rank (its live prefix
    ends where that prompt ended) is not charged there while the live set fills under 3/4 of the cache. A
    shared document's next reader (its live prefix ends inside the first reader's prompt) still is, as is
    every prompt on a rank filled past 3/4; another rank, or an expired turn, charges as before."""
    fp = LiveFootprint(horizon_s=10.0)
    turn1 = _chain(list(range(40)))  # 10 blocks
    turn2 = _chain(list(range(40)) + list(range(100, 120)))  # turn 1, then 5 more blocks
    reader2 = _chain(list(range(24)) + list(range(300, 316)))  # the first 6 blocks of turn 1, then its own
    fp.touch((1, 0), turn1, now=0.0)
    assert fp.extends_prompt((1, 0), turn2, 1.0) and not fp.extends_prompt((1, 0), reader2, 1.0)
    assert not fp.extends_prompt((2, 0), turn2, 1.0)
    assert fp.pressure_blocks((1, 0), 20, 1.0, turn2) == 0.0  # 10 live of 20: room
    assert fp.pressure_blocks((1, 0), 20, 1.0, reader2) == fp.pressure_blocks((1, 0), 20, 1.0) == 10 * 0.5
    assert fp.pressure_blocks((1, 0), 12, 1.0, turn2) == pytest.approx(10 * 10 / 12)  # past 3/4: charged
    assert not fp.extends_prompt((1, 0), turn2, 11.0)  # the turn is no longer live
    fp.touch((1, 0), turn2, now=2.0)  # the next turn went there: it is what a third turn extends
    turn3 = _chain(list(range(40)) + list(range(100, 120)) + list(range(500, 508)))
    assert fp.extends_prompt((1, 0), turn3, 3.0)
    fp.forget_worker(1)
    assert not fp.extends_prompt((1, 0), turn3, 3.0) and fp._tails == {}


def test_the_frontend_router_keeps_a_conversation_on_its_rank_while_its_cache_has_room() -> None:
    """Rank 1 holds a conversation and other live work (6,000 of 10,000 blocks: room charge 0.25 x 6,000 x
    0.6 = 900 blocks of prefill); rank 2 is empty. The conversation's next turn stays on rank 1 (before,
    the room charge sent it to rank 2, which computed its 100-block history again)."""
    from router.config import RouterConfig

    router, entry = _two_idle_ranks(RouterConfig(router_mode="latency"))
    fp = router.footprint(entry)
    history = list(range(1600))  # 100 blocks of 16
    first = router.route(entry, history, pinned_worker=1)
    router.book(entry, "turn1", first)
    entry.tracker.free("turn1")
    fp.touch((1, 0), list(range(10**6, 10**6 + 5900)), time.monotonic())  # other sessions' live blocks
    while fp.settle():
        pass
    nxt = router.route(entry, history + list(range(9000, 9160)), overlaps={(1, 0): 100}, explain=True)
    assert nxt.worker.id == 1, nxt.costs


def test_the_frontend_router_books_into_the_footprint_and_charges_it() -> None:
    """RequestRouter in latency mode: a booked prompt's blocks become live on its rank, and the next
    prompt, which would overflow that rank's cache, goes to the other rank (equal otherwise). With
    --router-latency-live-horizon 0 nothing is recorded."""
    import time

    from frontend.pool.workers import Worker, WorkerSpec
    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.request_router import RequestRouter
    from router.config import RouterConfig
    from slot_tracker.core import SlotRegistry

    def pool() -> ModelEntry:
        slots = SlotRegistry()
        entry = ModelEntry("m", 16, None, slots, None, None, BusyThresholds())  # type: ignore[arg-type]
        for i in (1, 2):  # routing reads neither the control-plane client nor the upstream pool
            slots.register(i, "m", "default", 16, 0, 1)
            spec = WorkerSpec(i, f"http://w{i}")
            entry.workers[i] = Worker(spec, "cli", None, None, num_gpu_blocks=20, healthy=True)  # type: ignore[arg-type]
        return entry

    def second_costs(horizon: float) -> tuple[RequestRouter, ModelEntry, int, dict[int, float]]:
        """Book a 10-block prompt, let it finish (nothing in flight any more), then price a 15-block one."""
        entry = pool()
        router = RequestRouter(RouterConfig(router_mode="latency", router_latency_live_horizon=horizon))
        first = router.route(entry, list(range(160)))
        router.book(entry, "r1", first)
        entry.tracker.free("r1")
        second = router.route(entry, list(range(1000, 1240)), explain=True)  # 10 + 15 > 20 on the first rank
        assert second.costs is not None
        return router, entry, first.worker.id, {c.worker_id: c.cost for c in second.costs}

    router, entry, used, costs = second_costs(10.0)
    assert router.footprint(entry).live_blocks((used, 0), time.monotonic()) == 10
    other = 3 - used
    assert costs[used] > costs[other]  # 5 live blocks evicted + the room term there
    router, entry, used, costs = second_costs(0.0)  # the cache terms off: nothing recorded, a tie
    assert router.footprint(entry).snapshot(time.monotonic()) == {}
    assert costs[1] == costs[2]


def test_the_recompute_weight_flag_reaches_the_estimate() -> None:
    """--router-latency-recompute-weight: with 480 tokens queued on the rank holding half the prompt, the
    idle rank wins at weight 1 (320 + 160 recomputed < 480 + 160 there) and loses at 4 (320 + 4 x 160)."""
    from frontend.pool.workers import Worker, WorkerSpec
    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.request_router import RequestRouter
    from router.config import RouterConfig
    from slot_tracker.core import SlotRegistry

    def chosen(weight: float) -> int:
        slots = SlotRegistry()
        entry = ModelEntry("m", 16, None, slots, None, None, BusyThresholds())  # type: ignore[arg-type]
        for i in (1, 2):
            slots.register(i, "m", "default", 16, 0, 1)
            entry.workers[i] = Worker(WorkerSpec(i, f"http://w{i}"), "cli", None, None, healthy=True)  # type: ignore[arg-type]
        config = RouterConfig(router_mode="latency", router_latency_live_horizon=0,
                              router_latency_recompute_weight=weight)  # fmt: skip
        router = RequestRouter(config)
        router.book(entry, "queued", router.route(entry, list(range(5000, 5480)), pinned_worker=1))
        decision = router.route(entry, list(range(320)), overlaps={(1, 0): 10}, explain=True)
        return decision.worker.id

    assert chosen(1.0) == 2
    assert chosen(4.0) == 1


def test_the_frontend_settles_a_long_prompt_a_slice_per_loop_iteration() -> None:
    import asyncio

    from frontend.routing.request_router import _settle_soon

    async def run() -> list[int]:
        fp = LiveFootprint(slice_blocks=3)
        chain = _chain(list(range(40)))  # 10 blocks
        fp.touch((1, 0), chain, now=0.0)
        seen = [fp.live_blocks((1, 0), 0.0)]
        _settle_soon(fp)
        for _ in range(10):  # bounded: each iteration of the loop runs one step
            await asyncio.sleep(0)
            seen.append(fp.live_blocks((1, 0), 0.0))
            if not fp.unsettled:
                break
        return seen

    assert asyncio.run(run()) == [2, 5, 8, 10]  # the touch's start takes one unit of its first slice


def test_latency_mode_follows_a_prefix_just_routed_before_its_kv_events_arrive() -> None:
    """A group's second user arrives while the first one's shared prefix is still being prefilled (no KV
    event yet): with --router-latency-predict-routed (the default) it goes where the prefix was routed,
    with the decision's overlap still the index's (what the parity alarm compares); without it, the
    rank that holds nothing yet looks as good and the idle one wins."""
    from router.config import RouterConfig

    def second_choice(predict: bool) -> tuple[int, int, int]:
        router, entry = _two_idle_ranks(RouterConfig(router_mode="latency", router_latency_predict_routed=predict))
        prefix = list(range(1600))  # 100 blocks
        first = router.route(entry, prefix + list(range(5000, 5016)))
        router.book(entry, "r1", first)
        second = router.route(entry, prefix + list(range(6000, 6016)))
        return first.worker.id, second.worker.id, second.overlap_blocks

    first, second, overlap = second_choice(True)
    assert second == first and overlap == 0  # followed the prefix; the index holds nothing yet
    first, second, overlap = second_choice(False)
    assert second != first  # the first rank is busy with the prefill, nothing is known to be cached


def test_latency_mode_books_only_the_rest_of_a_prompt_whose_prefix_it_just_routed_there() -> None:
    """With --router-latency-book-predicted, a group's second user (routed after its prefix, before the KV
    events) books only its own tokens as queued prefill, so the group's third user follows too; booked in
    full (the default), the rank looks loaded by the prefix it holds and the third user computes the prefix
    again elsewhere. The decisions' overlap stays the index's either way (what the parity alarm compares)."""
    from router.config import RouterConfig

    def group(book: bool) -> tuple[list[int], int, list[int]]:
        router, entry = _two_idle_ranks(RouterConfig(router_mode="latency", router_latency_book_predicted=book))
        prefix = list(range(1600))  # 100 blocks
        chosen, overlaps = [], []
        for k in range(3):
            d = router.route(entry, prefix + list(range(5000 + 100 * k, 5016 + 100 * k)))
            router.book(entry, f"r{k}", d)
            chosen.append(d.worker.id)
            overlaps.append(d.overlap_blocks)
        queued = {p[0]: p[2] for p in entry.tracker.potential_loads([], 0)}
        return chosen, queued[chosen[0]], overlaps

    chosen, queued, overlaps = group(True)
    assert chosen == [chosen[0]] * 3
    assert queued == 1616 + 16 + 16  # the first prompt in full, then each user's own block
    assert overlaps == [0, 0, 0]
    chosen, queued, overlaps = group(False)
    assert chosen[1] == chosen[0] and chosen[2] != chosen[0]  # the third computes the prefix again
    assert queued == 1616 + 1616
    assert overlaps == [0, 0, 0]


def _two_idle_ranks(config: Any) -> tuple[Any, Any]:
    """A request router with ``config`` and a model entry of two idle single-rank workers of 10,000 blocks."""
    from frontend.pool.workers import Worker, WorkerSpec
    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.request_router import RequestRouter
    from slot_tracker.core import SlotRegistry

    slots = SlotRegistry()
    entry = ModelEntry("m", 16, None, slots, None, None, BusyThresholds())  # type: ignore[arg-type]
    for i in (1, 2):
        slots.register(i, "m", "default", 16, 0, 1)
        spec = WorkerSpec(i, f"http://w{i}")
        entry.workers[i] = Worker(spec, "cli", None, None, num_gpu_blocks=10_000, healthy=True)  # type: ignore[arg-type]
    return RequestRouter(config), entry
