"""Router queue ordering (router/queue.py): policies, strict tiers, priority shift, removal."""

from __future__ import annotations

import random

import pytest

from router.queue import PendingQueue, QueuePolicy, policy_key


def drain(q: PendingQueue) -> list:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_policy_parse():
    assert QueuePolicy.parse(None) is QueuePolicy.FCFS
    assert QueuePolicy.parse("WSPT") is QueuePolicy.WSPT
    assert QueuePolicy.parse(" lcfs ") is QueuePolicy.LCFS
    assert QueuePolicy.parse(QueuePolicy.LCFS) is QueuePolicy.LCFS
    with pytest.raises(ValueError, match="unknown router queue policy"):
        QueuePolicy.parse("sjf")


def test_fcfs_pops_oldest_first():
    q = PendingQueue("fcfs")
    for i, t in enumerate([3.0, 1.0, 2.0, 0.5]):
        q.push(f"r{i}", t)
    assert drain(q) == ["r3", "r1", "r2", "r0"]


def test_lcfs_pops_newest_first():
    q = PendingQueue("lcfs")
    for i, t in enumerate([3.0, 1.0, 2.0, 0.5]):
        q.push(f"r{i}", t)
    assert drain(q) == ["r0", "r2", "r1", "r3"]


def test_default_policy_is_fcfs():
    assert PendingQueue().policy is QueuePolicy.FCFS


def test_wspt_pops_smallest_job_first_weighted_by_priority():
    q = PendingQueue("wspt")
    q.push("big", 0.0, new_tokens=4000)
    q.push("small", 1.0, new_tokens=100)
    q.push("cached", 2.0, new_tokens=0)  # fully cached: max(1, 0) = 1
    q.push("mid", 3.0, new_tokens=1000)
    assert drain(q) == ["cached", "small", "mid", "big"]
    # priority weights the job: (1 + 9) / 1000 = 0.01 > (1 + 0) / 200 = 0.005
    q.push("light", 0.0, new_tokens=200)
    q.push("heavy-important", 1.0, new_tokens=1000, priority_jump=9)
    assert drain(q) == ["heavy-important", "light"]


def test_priority_shifts_arrival_earlier_by_jump_seconds_fcfs():
    q = PendingQueue("fcfs")
    q.push("early", 10.0)
    q.push("late-prio-5", 14.0, priority_jump=5)  # effective arrival 9.0 -> before "early"
    q.push("late-prio-3", 14.0, priority_jump=3)  # effective 11.0 -> after "early"
    assert drain(q) == ["late-prio-5", "early", "late-prio-3"]


def test_priority_shift_lcfs():
    q = PendingQueue("lcfs")
    q.push("newest", 10.0)
    q.push("older-prio", 8.0, priority_jump=3)  # key 11 > 10
    q.push("old", 5.0)
    assert drain(q) == ["older-prio", "newest", "old"]


def test_negative_priority_has_no_effect():
    q = PendingQueue("fcfs")
    q.push("a", 1.0)
    q.push("b", 2.0, priority_jump=-100)
    q.push("c", 3.0)
    assert drain(q) == ["a", "b", "c"]
    assert policy_key(QueuePolicy.FCFS, 2.0, -5) == policy_key(QueuePolicy.FCFS, 2.0, 0)


@pytest.mark.parametrize("policy", ["fcfs", "lcfs", "wspt"])
def test_strict_priority_tier_beats_any_policy_key(policy):
    q = PendingQueue(policy)
    q.push("t0-best-key", 0.0, priority_jump=1e9, new_tokens=1)
    q.push("t2", 5.0, strict_priority=2, new_tokens=10_000)
    q.push("t1", 3.0, strict_priority=1, new_tokens=10_000)
    q.push("t2-b", 6.0, strict_priority=2, new_tokens=10_000)
    order = drain(q)
    assert order[0] in ("t2", "t2-b") and set(order[:2]) == {"t2", "t2-b"}
    assert order[2:] == ["t1", "t0-best-key"]
    # within a tier the policy decides
    expected_first = {"fcfs": "t2", "lcfs": "t2-b", "wspt": "t2"}[policy]
    assert order[0] == expected_first


def test_ties_pop_in_insertion_order():
    q = PendingQueue("fcfs")
    for i in range(10):
        q.push(i, 1.0)
    assert drain(q) == list(range(10))
    q = PendingQueue("wspt")
    for i in range(10):
        q.push(i, float(i), new_tokens=50)
    assert drain(q) == list(range(10))


def test_remove_takes_an_entry_out_once():
    q = PendingQueue("fcfs")
    entries = [q.push(i, float(i)) for i in range(5)]
    assert q.remove(entries[0]) and q.remove(entries[3])
    assert not q.remove(entries[3])  # already gone
    assert len(q) == 3
    assert q.peek().item == 1
    assert drain(q) == [1, 2, 4]
    assert not q.remove(entries[1])  # popped entries cannot be removed
    assert len(q) == 0 and not q
    with pytest.raises(IndexError):
        q.pop()


def test_many_removals_compact_and_never_lose_live_entries():
    rng = random.Random(7)
    q = PendingQueue("fcfs")
    live = {}
    for i in range(2000):
        live[i] = q.push(i, rng.random() * 100)
    removed = set(rng.sample(range(2000), 1500))
    for i in removed:
        assert q.remove(live[i])
    assert len(q) == 500
    out = drain(q)
    assert sorted(out) == sorted(set(range(2000)) - removed)
    # still FCFS order by arrival
    arrivals = {i: -live[i].key for i in out}
    assert [arrivals[i] for i in out] == sorted(arrivals[i] for i in out)


def test_items_in_order_matches_pops():
    rng = random.Random(3)
    q = PendingQueue("fcfs")
    for i in range(50):
        q.push(i, rng.random(), strict_priority=rng.randrange(3), priority_jump=rng.random())
    snapshot = list(q.items_in_order())
    assert snapshot == drain(q)
