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

Its work runs on the frontend's event loop, where no step may grow with a prompt's length: a touch
records at most ``SLICE_BLOCKS`` blocks at once and queues the rest for ``settle()`` (the frontend
calls it again on the next loop iterations until nothing is left), and expiry removes at most
``SLICE_BLOCKS`` blocks per call. Until a long prompt is settled, the part not yet recorded is not
live (at most a few loop iterations).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from router.selection import WorkerRank

DEFAULT_HORIZON_S = 10.0
# a conversation's next turn pays no room charge on its rank while the rank's live blocks fill less than
# this share of its cache (see ``pressure_blocks``)
ROOM_FREE_FULLNESS = 0.75
# blocks recorded or expired per step: ~0.5 ms of the loop's time (a 128k-token prompt is 4-8k blocks)
SLICE_BLOCKS = 2048


class LiveFootprint:
    """Per rank, the sequence hashes touched within ``horizon_s`` seconds, oldest first.

    A prompt's blocks are touched last block first, so a chain's prefix is never older than its tail:
    expiry removes tails before prefixes and every rank's live set stays prefix-closed per chain,
    which lets ``live_prefix`` binary-search instead of looking up every block.
    """

    __slots__ = ("horizon_s", "slice_blocks", "_ranks", "_pending", "_tails")

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S, slice_blocks: int = SLICE_BLOCKS) -> None:
        if horizon_s <= 0:
            raise ValueError("the live horizon must be > 0 s")
        if slice_blocks < 1:
            raise ValueError("a slice is at least one block")
        self.horizon_s = horizon_s
        self.slice_blocks = slice_blocks
        self._ranks: dict[WorkerRank, OrderedDict[int, float]] = {}
        # touches not fully recorded: [rank, sequence hashes, blocks of it still to record (a prefix), time]
        self._pending: deque[list] = deque()
        # per rank, the last block of each prompt touched within the horizon (where a next turn resumes)
        self._tails: dict[WorkerRank, OrderedDict[int, float]] = {}

    def _live(self, key: WorkerRank, now: float) -> OrderedDict[int, float] | None:
        blocks = self._ranks.get(key)
        if blocks is None:
            return None
        cutoff = now - self.horizon_s
        for _ in range(min(len(blocks), self.slice_blocks)):  # bounded: each pass removes one expired block
            oldest = next(iter(blocks.values()), None)
            if oldest is None or oldest >= cutoff:
                break
            blocks.popitem(last=False)
        return blocks

    def live_blocks(self, key: WorkerRank, now: float) -> int:
        blocks = self._live(key, now)
        return 0 if blocks is None else len(blocks)

    def live_prefix(self, key: WorkerRank, seq_hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of the prompt are live on the rank."""
        blocks = self._live(key, now)
        if not blocks or not seq_hashes:
            return 0
        lo, hi = 0, len(seq_hashes)  # invariant: the first lo blocks are live, block hi-1 onwards are not known
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if seq_hashes[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

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
        """The prompt was routed to the rank: its blocks are live there from now (the first
        ``slice_blocks`` at once, the rest by ``settle``)."""
        if seq_hashes:
            self._pending.append([key, seq_hashes, len(seq_hashes), now])
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
        self.settle()
        self._live(key, now)

    @property
    def unsettled(self) -> bool:
        """Whether touched blocks are still waiting to be recorded (call ``settle`` again)."""
        return bool(self._pending)

    def settle(self) -> bool:
        """Record up to ``slice_blocks`` blocks of the pending touches, oldest touch first and each
        prompt last block first (so a chain's prefix is never older than its tail); returns whether
        any are left."""
        budget = self.slice_blocks
        pending = self._pending
        while budget > 0 and pending:
            item = pending[0]
            key, seq, end, now = item
            blocks = self._ranks.get(key)
            if blocks is None:
                blocks = self._ranks[key] = OrderedDict()
            start = max(0, end - budget)
            for i in range(end - 1, start - 1, -1):
                h = seq[i]
                blocks[h] = now
                blocks.move_to_end(h)
            budget -= end - start
            if start == 0:
                pending.popleft()
            else:
                item[2] = start
        return bool(pending)

    def forget_worker(self, worker_id: int) -> None:
        for key in [k for k in self._ranks if k[0] == worker_id]:
            del self._ranks[key]
        for key in [k for k in self._tails if k[0] == worker_id]:
            del self._tails[key]
        self._pending = deque(p for p in self._pending if p[0][0] != worker_id)

    def snapshot(self, now: float) -> dict[str, int]:
        return {f"{w}:{r}": self.live_blocks((w, r), now) for (w, r) in sorted(self._ranks)}
