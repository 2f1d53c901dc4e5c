"""hypothesis state machine for the slot-tracker core (slot_tracker/core.py) against a plain model.

The model keeps, per request, its (worker, rank), its prompt path (u64 hashes) and its pending
prefill tokens; loads are recomputed from it by brute force: prefill tokens summed, decode blocks =
distinct path prefixes on the slot, potential decode blocks = decode blocks + len(q) - the longest
prefix of q some request on the slot holds. Every step checks the tracker's answers against it.
Invariants: loads never negative, free idempotent, every load 0 (and the shared trie empty) once
everything is freed, errors (404 / 409) leave the state unchanged. Hashes above i64 max are sent
as u64 (as the frontend does) or as their signed-i64 alias (as the HTTP API carries them) at random,
the alias through the service's mapping (``u64_path``) as the HTTP layer hands it to the core.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute_common.constants import U64_MAX
from slot_tracker.core import SlotRegistry, SlotTrackerError
from slot_tracker.service import u64_path

MODEL, TENANT = "m", "default"
EXPIRY = 100.0
BIG = (1 << 63) + 5  # above i64 max: has a distinct signed alias
HASHES = [1, 2, 3, BIG]
WORKERS = [1, 2, 3]
REQUESTS = [f"r{i}" for i in range(6)]

hashes = st.lists(st.sampled_from(HASHES), max_size=5)
as_sent = st.booleans()  # send big hashes as their i64 alias?


def _wire(path: list[int], alias: bool) -> list[int]:
    return [h - (1 << 64) if alias and h > (1 << 63) - 1 else h for h in path]


class SlotTrackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.registry = SlotRegistry(expiry_secs=EXPIRY, clock=lambda: self.now)
        self.workers: dict[int, tuple[int, int]] = {}  # worker -> (dp_start, dp_size)
        self.requests: dict[
            str, tuple[tuple[int, int], list[int], int, float]
        ] = {}  # rid -> (slot, path, prefill, added)

    # ---- helpers
    def tracker(self):
        return self.registry.get(MODEL, TENANT)

    def slots(self) -> list[tuple[int, int]]:
        return sorted((w, r) for w, (s, n) in self.workers.items() for r in range(s, s + n))

    # ---- rules
    @rule(worker=st.sampled_from(WORKERS), dp_start=st.integers(0, 2), dp_size=st.integers(1, 3))
    def register(self, worker: int, dp_start: int, dp_size: int) -> None:
        try:
            self.registry.register(worker, MODEL, TENANT, 16, dp_start, dp_size)
        except SlotTrackerError as exc:
            assert exc.status == 409 and worker in self.workers
            return
        assert worker not in self.workers
        self.workers[worker] = (dp_start, dp_size)

    @rule(worker=st.sampled_from(WORKERS))
    def unregister(self, worker: int) -> None:
        try:
            self.registry.unregister(worker, MODEL, TENANT)
        except SlotTrackerError as exc:
            assert exc.status == 404 and worker not in self.workers
            return
        del self.workers[worker]
        self.requests = {rid: r for rid, r in self.requests.items() if r[0][0] != worker}

    @rule(
        rid=st.sampled_from(REQUESTS),
        worker=st.sampled_from(WORKERS),
        rank=st.integers(0, 4),
        path=hashes,
        isl=st.integers(0, 50),
        alias=as_sent,
    )
    def add(self, rid: str, worker: int, rank: int, path: list[int], isl: int, alias: bool) -> None:
        tracker = self.tracker()
        if tracker is None:
            assert not self.workers
            return
        try:
            tracker.add(rid, worker, rank, u64_path(_wire(path, alias)), isl)
        except SlotTrackerError as exc:
            if exc.status == 409:
                assert rid in self.requests
            else:
                assert exc.status == 404 and (worker, rank) not in self.slots()
            return
        assert rid not in self.requests and (worker, rank) in self.slots()
        self.requests[rid] = ((worker, rank), [h & U64_MAX for h in path], isl, self.now)

    @rule(rid=st.sampled_from(REQUESTS))
    def prefill_complete(self, rid: str) -> None:
        tracker = self.tracker()
        if tracker is None:
            return
        try:
            tracker.prefill_complete(rid)
        except SlotTrackerError as exc:
            assert exc.status == 404 and rid not in self.requests
            return
        slot, path, _, added = self.requests[rid]
        self.requests[rid] = (slot, path, 0, added)

    @rule(rid=st.sampled_from(REQUESTS))
    def free_twice(self, rid: str) -> None:
        """free is idempotent: the second call frees nothing and changes nothing."""
        tracker = self.tracker()
        if tracker is None:
            return
        assert tracker.free(rid) == (rid in self.requests)
        self.requests.pop(rid, None)
        before = tracker.loads()
        assert tracker.free(rid) is False
        assert tracker.loads() == before

    @precondition(lambda self: self.tracker() is not None)
    @rule()
    def free_everything(self) -> None:
        tracker = self.tracker()
        for rid in list(self.requests):
            assert tracker.free(rid)
        self.requests.clear()
        assert all(p == 0 and d == 0 for _, _, p, d in tracker.loads())
        assert tracker._root.kids == {}, "the shared prefix trie keeps nodes nobody holds"
        assert len(tracker) == 0

    @rule(dt=st.sampled_from([1.0, 30.0, 60.0, 100.0]))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        self.registry.expire_stale()
        self.requests = {rid: r for rid, r in self.requests.items() if r[3] > self.now - EXPIRY}

    # ---- invariants
    @invariant()
    def loads_match_the_model(self) -> None:
        tracker = self.tracker()
        if tracker is None:
            assert not self.workers and not self.requests
            return
        expected = []
        for slot in self.slots():
            mine = [r for r in self.requests.values() if r[0] == slot]
            prefixes = {tuple(path[: k + 1]) for _, path, _, _ in mine for k in range(len(path))}
            expected.append((*slot, sum(r[2] for r in mine), len(prefixes)))
        assert tracker.loads() == expected
        assert all(p >= 0 and d >= 0 for _, _, p, d in expected)
        assert len(tracker) == len(self.requests)

    @invariant()
    def potential_loads_match_the_model(self) -> None:
        tracker = self.tracker()
        if tracker is None:
            return
        queries = [[], [1], [1, 2, 3], [BIG, 1], [2, 2, 2, 2]] + [r[1] + [3] for r in self.requests.values()]
        for q in queries:
            for alias in (False, True):
                got = tracker.potential_loads(u64_path(_wire(q, alias)), 7)
                expected = []
                for slot in self.slots():
                    mine = [r for r in self.requests.values() if r[0] == slot]
                    prefixes = {tuple(path[: k + 1]) for _, path, _, _ in mine for k in range(len(path))}
                    depth = max((k for k in range(len(q) + 1) if tuple(q[:k]) in prefixes or k == 0), default=0)
                    expected.append((*slot, sum(r[2] for r in mine) + 7, len(prefixes) + len(q) - depth, len(mine)))
                assert got == expected, (q, alias)

    @invariant()
    def the_trie_is_compact(self) -> None:
        """Runs are maximal: every run a request passes through is non-empty, and none could be joined
        to its only child (same requests, none ending in it); the trie holds exactly the active paths."""
        tracker = self.tracker()
        if tracker is None:
            return
        stack = list(tracker._root.kids.values())
        positions = 0
        while stack:
            node = stack.pop()
            assert node.hashes and node.refs > 0
            assert node.ends or len(node.kids) != 1 or next(iter(node.kids.values())).refs != node.refs
            positions += len(node.hashes)
            stack.extend(node.kids.values())
        expected = {tuple(path[: k + 1]) for _, path, _, _ in self.requests.values() for k in range(len(path))}
        assert positions == len(expected)


SlotTrackerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVROUTE_STATE_EXAMPLES", "300")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_slot_tracker_state_machine = SlotTrackerMachine.TestCase
