"""Live cache footprint per rank: which blocks the requests routed there used recently.

A prefix cache that evicts keeps what was used last; a block used within the last ``horizon_s`` seconds
is *live* (the workload is likely to use it again: the next turn of a session, the next reader of a
document). While a rank's live blocks fit in its KV cache, piling more sessions on it costs nothing
but queueing; once they do not, every block a request adds there pushes out a live block that some
later request computes again. The latency mode charges that future recompute (``overflow_blocks``),
which is what sticky policies miss: they win while one engine holds everything and lose as soon as it
evicts.

The set is the router's own record of its decisions (each booked request touches its prompt's chained
sequence hashes on the chosen rank), not the engine's cache: what the engine holds is the block
index's business; what of it is still wanted is not in any event. No I/O; the caller passes the time.

A rank's live blocks are kept as runs of chains (``kvroute_common/recency_runs.py``, shared with
approximate mode's predicted cache): a touch costs the loop O(log prompt + branch points + new blocks),
its new blocks are recorded a slice at a time (the frontend calls ``settle()`` on the next loop iterations
until nothing is left), and expiry removes at most a slice per call. Until a long prompt is settled, the
part not yet recorded is not live (at most a few loop iterations).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvroute_common.recency_runs import SLICE_BLOCKS, RankRuns, RecencyRuns
from router.selection import WorkerRank

DEFAULT_HORIZON_S = 10.0
# a conversation's next turn pays no room charge on its rank while the rank's live blocks fill less than
# this share of its cache (see ``pressure_blocks``)
ROOM_FREE_FULLNESS = 0.75


class LiveFootprint(RecencyRuns):
    """Per rank, the blocks touched within ``horizon_s`` seconds, as runs of chains
    (``kvroute_common/recency_runs.py``), and what they mean for the next decision.

    A chain's prefix is never older than its tail: expiry removes tails before prefixes and every rank's
    live set stays prefix-closed per chain, which lets ``live_prefix`` binary-search instead of looking
    up every block.
    """

    __slots__ = ("_tails",)

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S, slice_blocks: int = SLICE_BLOCKS) -> None:
        super().__init__(horizon_s, slice_blocks)
        # per rank, the last block of each prompt touched within the horizon (where a next turn resumes)
        self._tails: dict[WorkerRank, OrderedDict[int, float]] = {}

    def _live(self, key: WorkerRank, now: float) -> RankRuns | None:
        return self.expire_rank(key, now)

    def live_blocks(self, key: WorkerRank, now: float) -> int:
        rank = self._live(key, now)
        return 0 if rank is None else rank.count

    def live_prefix(self, key: WorkerRank, seq_hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of the prompt are live on the rank."""
        rank = self._live(key, now)
        if rank is None or not seq_hashes:
            return 0
        return rank.prefix(seq_hashes)

    def overflow_blocks(
        self, key: WorkerRank, seq_hashes: Sequence[int], capacity_blocks: int, now: float, prefix: int | None = None
    ) -> int:
        """Live blocks the rank would lose if this prompt went there: its blocks not yet live there, beyond
        what the cache has room for next to the live ones. ``prefix``: the prompt's ``live_prefix`` there,
        when the caller has it."""
        live = self.live_blocks(key, now)
        added = len(seq_hashes) - (self.live_prefix(key, seq_hashes, now) if prefix is None else prefix)
        excess = live + added - capacity_blocks
        return 0 if excess <= 0 else min(added, excess)

    def extends_prompt(self, key: WorkerRank, seq_hashes: Sequence[int], now: float, prefix: int | None = None) -> bool:
        """Whether the prompt continues one routed to the rank within the horizon: its live prefix there
        (``prefix``, when the caller has it) ends where such a prompt ended (a conversation's next turn; a
        shared document's next reader ends its live prefix inside another prompt)."""
        n = self.live_prefix(key, seq_hashes, now) if prefix is None else prefix
        if not n:
            return False
        tails = self._tails.get(key)
        at = None if tails is None else tails.get(seq_hashes[n - 1])
        return at is not None and at >= now - self.horizon_s

    def pressure_blocks(
        self,
        key: WorkerRank,
        capacity_blocks: int,
        now: float,
        seq_hashes: Sequence[int] = (),
        prefix: int | None = None,
    ) -> float:
        """The rank's live blocks weighted by how full they make its cache (live / capacity, at most 1): a
        rank whose live set fills half its cache weighs a quarter of a full one's, block for block.

        0 for ``seq_hashes`` continuing a prompt routed there while the live set fills less than
        ``ROOM_FREE_FULLNESS`` of the cache: the charge spreads new footprint before caches fill, and
        moving a conversation off a rank with room only computes its history again."""
        live = self.live_blocks(key, now)
        if capacity_blocks <= 0:
            return 0.0
        if (
            seq_hashes
            and live < ROOM_FREE_FULLNESS * capacity_blocks
            and self.extends_prompt(key, seq_hashes, now, prefix)
        ):
            return 0.0
        return live * min(1.0, live / capacity_blocks)

    def touch(self, key: WorkerRank, seq_hashes: Sequence[int], now: float) -> None:
        """The prompt was routed to the rank: its blocks are live there from now (its new blocks a slice at
        a time, by ``settle``, after the touches before it)."""
        if seq_hashes:
            tails = self._tails.get(key)
            if tails is None:
                tails = self._tails[key] = OrderedDict()
            tails[seq_hashes[-1]] = now
            tails.move_to_end(seq_hashes[-1])
            cutoff = now - self.horizon_s
            for _ in range(min(len(tails), self.slice_blocks)):  # bounded: each pass removes one expired tail
                if next(iter(tails.values())) >= cutoff:
                    break
                tails.popitem(last=False)
        self.record(key, seq_hashes, now)
        self._live(key, now)

    def forget_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        super().forget_worker(worker_id, dp_rank)
        for key in [k for k in self._tails if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]:
            del self._tails[key]

    def snapshot(self, now: float) -> dict[str, int]:
        return {f"{w}:{r}": self.live_blocks((w, r), now) for (w, r) in sorted(self._ranks)}
