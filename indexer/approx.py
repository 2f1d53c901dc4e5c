"""Approximate mode (``--no-router-kv-events``): predict each worker's cache from our own choices.

Every routing decision records the request's blocks as cached on the chosen (worker, DP rank).
Predictions expire after ``ttl_secs`` and, when the prediction holds more than ``max_tree_size``
blocks, the least recently used ones are pruned down to ``prune_target_ratio * max_tree_size``.

The blocks live in the same ``indexer.core.KvIndex`` the event-driven mode uses (no second radix
tree); this module only decides when blocks enter and leave it. Recency is kept per
(worker, rank, sequence hash) in one ordered dict; within a decision the deepest block is touched
first and the root last, so expiry and pruning always remove children before their parents and
each worker's prediction stays a set of whole prefixes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from indexer.core import KvIndex

Key = tuple[int, int, int]  # (worker_id, dp_rank, sequence hash)


class ApproxIndex:
    """TTL + size-bounded predicted cache on top of a KvIndex."""

    def __init__(
        self,
        block_size: int,
        ttl_secs: float = 120.0,
        max_tree_size: int = 1 << 20,
        prune_target_ratio: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        index: KvIndex | None = None,
    ) -> None:
        if ttl_secs <= 0:
            raise ValueError("ttl_secs must be > 0")
        if max_tree_size <= 0:
            raise ValueError("max_tree_size must be > 0")
        if not 0.0 <= prune_target_ratio <= 1.0:
            raise ValueError("prune_target_ratio must be between 0 and 1")
        self.block_size = block_size
        self.ttl_secs = ttl_secs
        self.max_tree_size = max_tree_size
        self.prune_target = int(max_tree_size * prune_target_ratio)
        self.clock = clock
        self.index = index if index is not None else KvIndex(block_size)
        self._expiry: OrderedDict[Key, float] = OrderedDict()

    def blocks_per_worker(self) -> dict[tuple[int, int], int]:
        """Predicted blocks per (worker, rank)."""
        return self.index.blocks_per_worker()

    @property
    def size(self) -> int:
        """Number of predicted (worker, rank, block) entries."""
        return len(self._expiry)

    def record(self, worker_id: int, dp_rank: int, local_hashes: Sequence[int], seq_hashes: Sequence[int]) -> None:
        """The request with these blocks was sent to (worker_id, dp_rank): predict them cached there."""
        n = len(seq_hashes)
        if n == 0:
            return
        now = self.clock()
        self._expire(now)
        expiry = self._expiry
        # leading blocks already predicted need no index update (prefix-closed per worker rank)
        first_new = 0
        while first_new < n and (worker_id, dp_rank, seq_hashes[first_new]) in expiry:
            first_new += 1
        if first_new < n:
            parent = seq_hashes[first_new - 1] if first_new else None
            self.index.apply_stored(
                worker_id, dp_rank, parent, list(zip(seq_hashes[first_new:], local_hashes[first_new:n], strict=True))
            )
        deadline = now + self.ttl_secs
        move = expiry.move_to_end
        for i in range(n - 1, -1, -1):  # deepest first, root last: children always leave first
            key = (worker_id, dp_rank, seq_hashes[i])
            expiry[key] = deadline
            move(key)
        if len(expiry) > self.max_tree_size:
            self._evict(len(expiry) - self.prune_target)

    def find_matches(self, local_hashes: Sequence[int]) -> dict[tuple[int, int], int]:
        """Predicted leading cached blocks per (worker, rank), after dropping expired predictions."""
        self._expire(self.clock())
        return self.index.find_matches(local_hashes)

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        for key in [k for k in self._expiry if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]:
            del self._expiry[key]
        self.index.remove_worker(worker_id, dp_rank)

    def expire(self) -> None:
        self._expire(self.clock())

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        if not expiry:
            return
        first = next(iter(expiry))
        if expiry[first] > now:
            return
        dead: list[Key] = []
        for key, deadline in expiry.items():
            if deadline > now:
                break
            dead.append(key)
        self._drop(dead)

    def _evict(self, count: int) -> None:
        if count <= 0:
            return
        dead: list[Key] = []
        for key in self._expiry:
            if len(dead) >= count:
                break
            dead.append(key)
        self._drop(dead)

    def _drop(self, keys: list[Key]) -> None:
        by_rank: dict[tuple[int, int], list[int]] = {}
        for key in keys:
            del self._expiry[key]
            by_rank.setdefault((key[0], key[1]), []).append(key[2])
        for (worker_id, dp_rank), hashes in by_rank.items():
            self.index.apply_removed(worker_id, dp_rank, hashes)
