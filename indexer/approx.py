"""Approximate mode (``--no-router-kv-events``): predict each worker's cache from our own choices.

Every routing decision records the request's blocks as cached on the chosen (worker, DP rank).
Predictions expire ``ttl_secs`` after the last request that used them and, when the prediction holds
more than ``max_tree_size`` blocks, the least recently used ones are pruned down to
``prune_target_ratio * max_tree_size``.

The blocks live in the same ``indexer.core.KvIndex`` the event-driven mode uses (no second radix
tree); this module only decides when blocks enter and leave it. When each was last used is kept as runs
of chains (``kvroute_common/recency_runs.py``, as latency mode's live footprint keeps it): a decision costs
the event loop O(log prompt + branch points + new blocks), not O(prompt); new blocks enter, and expired or
pruned ones leave, at most ``SLICE_BLOCKS`` per step (``settle()``, which the frontend calls on the next
loop iterations while ``unsettled``); tails leave before their prefixes, so each worker's prediction
stays a set of whole prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from indexer.core import KvIndex
from kvroute_common.recency_runs import RecencyRuns, WorkerRank

# blocks entering or leaving the prediction per step: each also enters or leaves the block index (~1 us a
# block in all), so a step holds the loop ~1 ms
SLICE_BLOCKS = 1024


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
        slice_blocks: int = SLICE_BLOCKS,
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
        self._runs = RecencyRuns(ttl_secs, slice_blocks, observer=self)
        self._pruning = False  # over max_tree_size: pruning down to prune_target, a slice per step
        self._expiring = False  # expired blocks are left to remove

    def blocks_per_worker(self) -> dict[tuple[int, int], int]:
        """Predicted blocks per (worker, rank)."""
        return self.index.blocks_per_worker()

    @property
    def size(self) -> int:
        """Number of predicted (worker, rank, block) entries."""
        return self._runs.total

    def record(self, worker_id: int, dp_rank: int, local_hashes: Sequence[int], seq_hashes: Sequence[int]) -> None:
        """The request with these blocks was sent to (worker_id, dp_rank): predict them cached there (the
        first slice now, the rest by ``settle``)."""
        if not seq_hashes:
            return
        now = self.clock()
        self._runs.record((worker_id, dp_rank), seq_hashes, now, local_hashes)
        self._upkeep(now)

    def find_matches(self, local_hashes: Sequence[int]) -> dict[tuple[int, int], int]:
        """Predicted leading cached blocks per (worker, rank), after dropping expired predictions (a slice)."""
        self._upkeep(self.clock())
        return self.index.find_matches(local_hashes)

    @property
    def unsettled(self) -> bool:
        """Whether blocks are still waiting to enter or leave the index (call ``settle`` again)."""
        return self._runs.unsettled or self._pruning or self._expiring

    def settle(self) -> bool:
        """A slice of the pending work: recording, then expiry and pruning; returns whether any is left."""
        self._runs.settle()
        self._upkeep(self.clock())
        return self.unsettled

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        self._runs.forget_worker(worker_id, dp_rank)
        self.index.remove_worker(worker_id, dp_rank)

    def expire(self) -> None:
        self._upkeep(self.clock())

    def _upkeep(self, now: float) -> None:
        """Up to a slice of expired blocks removed, then of pruned ones while the prediction is too large."""
        runs = self._runs
        budget = runs.expire(now, runs.slice_blocks)
        self._expiring = budget <= 0
        if not self._pruning and runs.total > self.max_tree_size:
            self._pruning = True
        if self._pruning:
            over = runs.total - self.prune_target
            if over > 0 and budget > 0:
                over -= runs.drop_oldest(min(over, budget))
            self._pruning = over > 0

    # -- RunObserver: the index follows the runs

    def stored(self, key: WorkerRank, seq: Sequence[int], local: Sequence[int] | None, start: int, stop: int) -> None:
        assert local is not None  # every record passes its local hashes
        parent = seq[start - 1] if start else None
        self.index.apply_stored_hashes(key[0], key[1], parent, list(seq[start:stop]), list(local[start:stop]))

    def removed(self, key: WorkerRank, seq: Sequence[int], start: int, stop: int) -> None:
        self.index.apply_removed(key[0], key[1], list(seq[start:stop])[::-1])  # deepest first, as an engine frees
