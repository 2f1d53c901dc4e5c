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

A rank's live blocks are kept as *runs*: blocks made live together on one chain (a shared document
once, then each reader's question; a conversation in one run that each turn extends). A touch stamps the
runs holding its prompt's live prefix (one per place its chain branches from another, not one per block)
and records only its new blocks, so a conversation's next turn or a document's next question costs the
loop O(log prompt + branch points + new blocks), not O(prompt). A block is live while the last touch
through it is within the horizon, exactly as if every touch had stamped every block of its prompt.

Its work runs on the frontend's event loop, where no step may grow with a prompt's length: a touch's
new blocks are recorded ``SLICE_BLOCKS`` at a time, first blocks first (``settle()``: the frontend calls
it again on the next loop iterations until nothing is left; later touches wait behind it), and expiry
removes at most ``SLICE_BLOCKS`` blocks per call. Until a long prompt is settled, the part not yet
recorded is not live (at most a few loop iterations).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from kvroute_common.hash_shards import MASK, HashShards
from router.selection import WorkerRank

DEFAULT_HORIZON_S = 10.0
# a conversation's next turn pays no room charge on its rank while the rank's live blocks fill less than
# this share of its cache (see ``pressure_blocks``)
ROOM_FREE_FULLNESS = 0.75
# blocks recorded or expired per step: ~0.5 ms of the loop's time (a 128k-token prompt is 4-8k blocks)
SLICE_BLOCKS = 2048


class _Run:
    """Blocks ``start`` to ``end - 1`` of the chain ``seq`` on one rank, made live together: one touch's new
    blocks, and those of the touches that went on from its end; ``at``: the last touch through them."""

    __slots__ = ("seq", "start", "end", "at", "head")

    def __init__(self, seq: Sequence[int], start: int, end: int, at: float, head: _Run | None) -> None:
        self.seq = seq
        self.start = start
        self.end = end
        self.at = at
        # the run now holding blocks recorded with this one below ``start`` (split off when a touch ended
        # inside it); the rank's index still names this run for them
        self.head = head


class _Rank:
    """One rank's live blocks: each sequence hash names the run it was recorded with (``owner`` follows
    the run's ``head`` links to the run holding it now); runs oldest touch first, and every run before
    the runs holding its chain's prefix, so expiry removes a chain's tail before its prefix."""

    __slots__ = ("blocks", "count", "runs")

    def __init__(self) -> None:
        self.blocks: HashShards[_Run] = HashShards()
        self.count = 0  # len(blocks), kept as blocks are recorded and expired (read per decision)
        self.runs: OrderedDict[_Run, None] = OrderedDict()

    def owner(self, seq_hash: int, position: int) -> _Run:
        """The run holding the block at ``position`` of its chain (it is live)."""
        run = self.blocks[seq_hash]
        while position < run.start:  # bounded: each link goes to a run starting lower on the chain
            assert run.head is not None
            run = run.head
        return run

    def prefix(self, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are recorded here (the recorded set is prefix-closed)."""
        parts = self.blocks.parts
        lo, hi = 0, len(seq_hashes)  # invariant: the first lo blocks are live, block hi-1 onwards are not known
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = seq_hashes[mid - 1]
            if h in parts[h & MASK]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def refresh(self, seq_hashes: Sequence[int], live: int, now: float) -> None:
        """A touch through the chain's first ``live`` blocks (all recorded): the runs holding them are
        stamped ``now`` and move behind every other run, the one holding its last block first; a run the
        touch ends inside is split there, its blocks past the touch keeping their stamp and place."""
        runs = self.runs
        pos = live
        while pos > 0:  # bounded: each run starts lower on the chain
            run = self.owner(seq_hashes[pos - 1], pos - 1)
            if run.end > pos:
                head = _Run(run.seq, run.start, pos, now, run.head)
                run.start, run.head = pos, head
                run = head
            run.at = now
            runs[run] = None
            runs.move_to_end(run)
            pos = run.start

    def expire(self, cutoff: float, budget: int, recording: _Run | None) -> None:
        """Remove up to ``budget`` blocks of runs last touched before ``cutoff``, oldest run first, each
        from its last block (the chain stays prefix-closed)."""
        runs, parts = self.runs, self.blocks.parts
        while budget > 0 and runs:
            run = next(iter(runs))
            if run.at >= cutoff or run is recording:
                break
            seq, end = run.seq, run.end
            stop = max(run.start, end - budget)
            for i in range(end - 1, stop - 1, -1):
                h = seq[i]
                del parts[h & MASK][h]
            self.count -= end - stop
            budget -= max(1, end - stop)
            run.end = stop
            if stop == run.start:
                runs.popitem(last=False)


class LiveFootprint:
    """Per rank, the blocks touched within ``horizon_s`` seconds, as runs of chains (``_Rank``).

    A chain's prefix is never older than its tail: expiry removes tails before prefixes and every rank's
    live set stays prefix-closed per chain, which lets ``live_prefix`` binary-search instead of looking
    up every block.
    """

    __slots__ = ("horizon_s", "slice_blocks", "_ranks", "_pending", "_recording", "_tails")

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S, slice_blocks: int = SLICE_BLOCKS) -> None:
        if horizon_s <= 0:
            raise ValueError("the live horizon must be > 0 s")
        if slice_blocks < 1:
            raise ValueError("a slice is at least one block")
        self.horizon_s = horizon_s
        self.slice_blocks = slice_blocks
        self._ranks: dict[WorkerRank, _Rank] = {}
        # touches not fully recorded, oldest first: (rank, sequence hashes, time)
        self._pending: deque[tuple[WorkerRank, Sequence[int], float]] = deque()
        # the run of the oldest pending touch, once started: its blocks from ``end`` on are still to record
        self._recording: _Run | None = None
        # per rank, the last block of each prompt touched within the horizon (where a next turn resumes)
        self._tails: dict[WorkerRank, OrderedDict[int, float]] = {}

    def _live(self, key: WorkerRank, now: float) -> _Rank | None:
        rank = self._ranks.get(key)
        if rank is not None:
            rank.expire(now - self.horizon_s, self.slice_blocks, self._recording)
        return rank

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
            self._pending.append((key, seq_hashes, now))
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
        """Apply the pending touches, oldest first, recording up to ``slice_blocks`` new blocks (each touch
        refreshes its live prefix's runs when it starts, then records its new blocks first to last);
        returns whether any are left."""
        budget = self.slice_blocks
        pending = self._pending
        while budget > 0 and pending:
            key, seq, now = pending[0]
            rank = self._ranks.get(key)
            if rank is None:
                rank = self._ranks[key] = _Rank()
            run = self._recording
            if run is None:  # the touch starts: its live prefix's runs refreshed, a run for the rest
                live = rank.prefix(seq)
                budget -= 1
                if live < len(seq):
                    last = rank.owner(seq[live - 1], live - 1) if live else None
                    if last is not None and last.end == live:
                        # the chain goes on where its last run ends: that run grows (a conversation keeps one
                        # run); another branch from there splits it off again when it is touched
                        run = last
                        run.seq = seq
                    else:
                        run = _Run(seq, live, live, now, None)
                        rank.runs[run] = None  # before the prefix's runs, which move behind it
                    self._recording = run
                rank.refresh(seq, live, now)
                if run is None:
                    pending.popleft()
                    continue
            stop = min(len(seq), run.end + budget)
            rank.blocks.set_all(seq[run.end : stop], run)
            rank.count += stop - run.end
            budget -= stop - run.end
            run.end = stop
            if stop == len(seq):
                pending.popleft()
                self._recording = None
        return bool(pending)

    def forget_worker(self, worker_id: int) -> None:
        for key in [k for k in self._ranks if k[0] == worker_id]:
            del self._ranks[key]
        for key in [k for k in self._tails if k[0] == worker_id]:
            del self._tails[key]
        if self._pending and self._pending[0][0][0] == worker_id:
            self._recording = None
        self._pending = deque(p for p in self._pending if p[0][0] != worker_id)

    def snapshot(self, now: float) -> dict[str, int]:
        return {f"{w}:{r}": self.live_blocks((w, r), now) for (w, r) in sorted(self._ranks)}
