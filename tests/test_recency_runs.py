"""Recency runs (kvroute_common/recency_runs.py): the blocks each rank used recently, removed tail first,
with an observer that sees every block come and go."""

from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute_common.hashing import local_block_hashes, sequence_hashes
from kvroute_common.recency_runs import RecencyRuns, WorkerRank


class Mirror:
    """What an observer would hold: every block it was told is there, in the order it was told."""

    def __init__(self) -> None:
        self.blocks: dict[WorkerRank, dict[int, int]] = {}  # rank -> sequence hash -> local hash
        self.events: list[tuple[str, WorkerRank, int]] = []

    def stored(self, key: WorkerRank, seq: Sequence[int], local: Sequence[int] | None, start: int, stop: int) -> None:
        assert local is not None and len(local) == len(seq)
        held = self.blocks.setdefault(key, {})
        assert start == 0 or seq[start - 1] in held  # stored below a block it holds
        for i in range(start, stop):
            assert seq[i] not in held
            held[seq[i]] = local[i]
            self.events.append(("stored", key, seq[i]))

    def removed(self, key: WorkerRank, seq: Sequence[int], start: int, stop: int) -> None:
        held = self.blocks[key]
        for i in range(stop - 1, start - 1, -1):
            assert i + 1 >= len(seq) or seq[i + 1] not in held  # nothing after it left behind
            del held[seq[i]]
            self.events.append(("removed", key, seq[i]))


def _prompt(labels: list[int]) -> tuple[list[int], list[int]]:
    local = local_block_hashes([t for label in labels for t in (label, label, label, label)], 4)
    return local, sequence_hashes(local)


def _blocks(runs: RecencyRuns, key: WorkerRank) -> set[int]:
    rank = runs._ranks.get(key)
    return set() if rank is None else set(rank.blocks.keys())


_PROMPT = st.lists(st.integers(0, 2), min_size=1, max_size=8)
_STEP = st.one_of(
    st.tuples(st.just("touch"), st.integers(0, 1), _PROMPT, st.sampled_from([0.0, 0.5, 2.0, 11.0])),
    st.tuples(st.just("expire"), st.integers(1, 5)),
    st.tuples(st.just("drop"), st.integers(1, 5)),
    st.tuples(st.just("settle")),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, min_size=1, max_size=30), st.sampled_from([1, 2, 3, 1000]))
def test_the_observer_sees_exactly_the_blocks_the_runs_hold(steps: list[tuple], slice_blocks: int) -> None:
    """Whatever the touches, expiries and size-bound drops (any slice, touches still being recorded), the
    observer told of each block stored and removed holds exactly the runs' blocks, each rank's blocks stay
    prefix-closed on every touched chain, and no step moves more than a slice of blocks."""
    mirror = Mirror()
    runs = RecencyRuns(10.0, slice_blocks, observer=mirror)
    now = 0.0
    chains: list[list[int]] = []
    for step in steps:
        before = len(mirror.events)
        if step[0] == "touch":
            _, rank, labels, dt = step
            now += dt
            local, seq = _prompt(labels)
            chains.append(seq)
            runs.record((rank, 0), seq, now, local)
        elif step[0] == "expire":
            runs.expire(now + step[1], slice_blocks)
        elif step[0] == "drop":
            runs.drop_oldest(step[1])
        else:
            runs.settle()
        moved = len(mirror.events) - before
        assert moved <= slice_blocks or step[0] == "drop", step
        for key in ((0, 0), (1, 0)):
            held = _blocks(runs, key)
            assert set(mirror.blocks.get(key, {})) == held
            assert runs._ranks.get(key) is None or runs._ranks[key].count == len(held)
            for seq in chains:
                live = [h in held for h in seq]
                assert live == sorted(live, reverse=True), "a block is held without the blocks before it"
    assert runs.total == sum(len(m) for m in mirror.blocks.values())


def test_drop_oldest_takes_the_least_recently_used_blocks_across_ranks_tail_first() -> None:
    mirror = Mirror()
    runs = RecencyRuns(1000.0, observer=mirror)
    a_local, a = _prompt([1, 1, 1, 1])
    b_local, b = _prompt([2, 2, 2])
    runs.record((0, 0), a, 1.0, a_local)
    runs.record((1, 0), b, 2.0, b_local)
    runs.record((0, 0), a[:1], 3.0, a_local[:1])  # the first block of A is now the most recent
    assert runs.drop_oldest(4) == 4
    # A's three later blocks (last first), then B's last block: B is older than A's refreshed first block
    assert [e[2] for e in mirror.events[-4:]] == [a[3], a[2], a[1], b[2]]
    assert _blocks(runs, (0, 0)) == {a[0]} and _blocks(runs, (1, 0)) == {b[0], b[1]}
    assert runs.drop_oldest(10) == 3 and runs.total == 0
    assert runs.drop_oldest(1) == 0
