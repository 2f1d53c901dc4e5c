"""The router queue's ordering: which held request is released next (pure, no I/O, no clock).

The reference router's queue keys (higher key pops first):

    FCFS (default)  (strict_priority, jump - arrival)
    LCFS            (strict_priority, jump + arrival)
    WSPT            (strict_priority, (1 + jump) / max(1, new_tokens))

``arrival`` is seconds on any monotonic clock (the caller's), ``jump = max(0, priority_jump)``:
a request with priority 5 is treated as if it arrived 5 s earlier (FCFS). ``strict_priority`` is
an unsigned tier: a higher tier always pops before a lower one, whatever the policy key.
``new_tokens`` (WSPT) is the request's uncached prompt tokens on its best eligible worker.
Equal keys pop in insertion order.

A heap with lazy deletion: :meth:`PendingQueue.remove` (a cancelled waiter) is O(1) and the dead
entry is skipped when it reaches the top.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from enum import StrEnum
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class QueuePolicy(StrEnum):
    FCFS = "fcfs"
    LCFS = "lcfs"
    WSPT = "wspt"

    @classmethod
    def parse(cls, value: str | QueuePolicy | None) -> QueuePolicy:
        """Case-insensitive name -> policy; None = FCFS. Unknown names raise ValueError."""
        if value is None:
            return cls.FCFS
        if isinstance(value, QueuePolicy):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"unknown router queue policy {value!r} (expected one of fcfs, lcfs, wspt)") from None


def policy_key(policy: QueuePolicy, arrival: float, priority_jump: float = 0.0, new_tokens: int = 0) -> float:
    """The policy's second key (higher pops first) for one request."""
    jump = priority_jump if priority_jump > 0.0 else 0.0
    if policy is QueuePolicy.FCFS:
        return jump - arrival
    if policy is QueuePolicy.LCFS:
        return jump + arrival
    return (1.0 + jump) / (new_tokens if new_tokens > 1 else 1)


class QueueEntry(Generic[T]):
    """One held request; keep it to :meth:`PendingQueue.remove` it later."""

    __slots__ = ("tier", "key", "seq", "item", "alive")

    def __init__(self, tier: int, key: float, seq: int, item: T) -> None:
        self.tier = tier
        self.key = key
        self.seq = seq
        self.item = item
        self.alive = True

    def __lt__(self, other: QueueEntry[Any]) -> bool:
        # heapq is a min-heap: "less" = pops first = higher tier, then higher key, then older seq.
        if self.tier != other.tier:
            return self.tier > other.tier
        if self.key != other.key:
            return self.key > other.key
        return self.seq < other.seq

    def __repr__(self) -> str:
        return (
            f"QueueEntry(tier={self.tier}, key={self.key:.6g}, seq={self.seq}, alive={self.alive}, item={self.item!r})"
        )


class PendingQueue(Generic[T]):
    """Held requests ordered by (strict_priority tier, policy key, insertion order)."""

    __slots__ = ("policy", "_heap", "_seq", "_live")

    def __init__(self, policy: QueuePolicy | str | None = None) -> None:
        self.policy = QueuePolicy.parse(policy)
        self._heap: list[QueueEntry[T]] = []
        self._seq = 0
        self._live = 0

    def push(
        self,
        item: T,
        arrival: float,
        *,
        strict_priority: int = 0,
        priority_jump: float = 0.0,
        new_tokens: int = 0,
    ) -> QueueEntry[T]:
        tier = strict_priority if strict_priority and strict_priority > 0 else 0
        entry = QueueEntry(tier, policy_key(self.policy, arrival, priority_jump, new_tokens), self._seq, item)
        self._seq += 1
        heapq.heappush(self._heap, entry)
        self._live += 1
        return entry

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and not heap[0].alive:
            heapq.heappop(heap)

    def peek(self) -> QueueEntry[T] | None:
        self._drop_dead_top()
        return self._heap[0] if self._heap else None

    def pop(self) -> T:
        """Remove and return the next item; IndexError when empty."""
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("pop from an empty PendingQueue")
        entry = heapq.heappop(self._heap)
        entry.alive = False
        self._live -= 1
        return entry.item

    def remove(self, entry: QueueEntry[T]) -> bool:
        """Take ``entry`` out (a cancelled waiter). False if it was already popped or removed."""
        if not entry.alive:
            return False
        entry.alive = False
        self._live -= 1
        # keep the heap from filling with corpses when many waiters cancel
        if len(self._heap) > 64 and self._live * 2 < len(self._heap):
            self._heap = [e for e in self._heap if e.alive]
            heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def items_in_order(self) -> Iterator[T]:
        """Live items in pop order (for inspection/tests; O(n log n))."""
        for entry in sorted(e for e in self._heap if e.alive):
            yield entry.item
