"""When each rank last used each block of its chains, kept as runs, with the loop's work bounded.

Two parts of the frontend keep, per (worker, DP rank), the blocks of the prompts routed there with the
time each was last used, and forget blocks not used for a while: latency mode's live footprint
(``router/footprint.py``: what a rank's cache still needs) and approximate mode's predicted cache
(``indexer/approx.py``: what a rank's cache probably holds, without KV events). This is their common core.

Blocks made live together are kept as *runs*: blocks ``start`` to ``end - 1`` of one chain of sequence
hashes, with one stamp. A touch stamps the runs holding its prompt's live prefix (one per place its chain
branches from another, not one per block) and records only its new blocks, so a conversation's next turn
or a document's next question costs O(log prompt + branch points + new blocks), not O(prompt). A block is
live while the last touch through it is within the horizon, exactly as if every touch had stamped every
block of its prompt. Runs are kept oldest stamp first, and every run before the runs holding its chain's
prefix, so removing from the oldest run's end keeps every rank's set prefix-closed per chain.

Its work runs on the frontend's event loop, where no step may grow with a prompt's length: a touch's new
blocks are recorded ``SLICE_BLOCKS`` at a time, first blocks first (``settle()``: the caller calls it again
on the next loop iterations until it returns False; later touches wait behind it), and removals take at
most a slice per call. Until a long prompt is settled, the part not yet recorded is not live.

An ``observer`` hears of every block recorded and removed (approximate mode mirrors them in a block index).
No I/O; the caller passes the time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from kvroute_common.hash_shards import MASK, HashShards

WorkerRank = tuple[int, int]

# blocks recorded or removed per step: ~0.5 ms of the loop's time (a 128k-token prompt is 4-8k blocks)
SLICE_BLOCKS = 2048


class RunObserver(Protocol):
    """Told of blocks as they are recorded and removed."""

    def stored(self, key: WorkerRank, seq: Sequence[int], local: Sequence[int] | None, start: int, stop: int) -> None:
        """Blocks ``start`` to ``stop - 1`` of the chain ``seq`` (local hashes ``local``, as the touch gave them)
        are recorded on ``key``; block ``start - 1`` was recorded before them."""

    def removed(self, key: WorkerRank, seq: Sequence[int], start: int, stop: int) -> None:
        """Blocks ``start`` to ``stop - 1`` of the chain ``seq`` left ``key`` (none after them is left there)."""


class Run:
    """Blocks ``start`` to ``end - 1`` of the chain ``seq`` on one rank, made live together: one touch's new
    blocks, and those of the touches that went on from its end; ``at``: the last touch through them."""

    __slots__ = ("seq", "start", "end", "at", "head")

    def __init__(self, seq: Sequence[int], start: int, end: int, at: float, head: Run | None) -> None:
        self.seq = seq
        self.start = start
        self.end = end
        self.at = at
        # the run now holding blocks recorded with this one below ``start`` (split off when a touch ended
        # inside it); the rank's map still names this run for them
        self.head = head


class RankRuns:
    """One rank's live blocks: each sequence hash names the run it was recorded with (``owner`` follows
    the run's ``head`` links to the run holding it now); runs oldest touch first, and every run before
    the runs holding its chain's prefix, so removal takes a chain's tail before its prefix."""

    __slots__ = ("blocks", "count", "runs")

    def __init__(self) -> None:
        self.blocks: HashShards[Run] = HashShards()
        self.count = 0  # len(blocks), kept as blocks are recorded and removed (read per decision)
        self.runs: OrderedDict[Run, None] = OrderedDict()

    def owner(self, seq_hash: int, position: int) -> Run:
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
                head = Run(run.seq, run.start, pos, now, run.head)
                run.start, run.head = pos, head
                run = head
            run.at = now
            runs[run] = None
            runs.move_to_end(run)
            pos = run.start

    def expire(
        self,
        cutoff: float,
        budget: int,
        recording: Run | None,
        observer: RunObserver | None = None,
        key: WorkerRank = (0, 0),
    ) -> int:
        """Remove up to ``budget`` blocks of runs last touched before ``cutoff``, oldest run first, each
        from its last block (the chain stays prefix-closed); returns the budget left."""
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
            if observer is not None and end > stop:
                observer.removed(key, seq, stop, end)
        return budget

    def oldest(self, recording: Run | None) -> float | None:
        """The stamp of the run the next removal would take from (None: nothing can go now)."""
        if not self.runs:
            return None
        run = next(iter(self.runs))
        return None if run is recording else run.at


class RecencyRuns:
    """Per rank, the blocks touched within ``horizon_s`` seconds, as runs of chains (``RankRuns``).

    A chain's prefix is never older than its tail: removal takes tails before prefixes and every rank's
    live set stays prefix-closed per chain, which lets ``RankRuns.prefix`` binary-search instead of looking
    up every block.
    """

    __slots__ = ("horizon_s", "slice_blocks", "observer", "_ranks", "_pending", "_recording")

    def __init__(self, horizon_s: float, slice_blocks: int = SLICE_BLOCKS, observer: RunObserver | None = None) -> None:
        if horizon_s <= 0:
            raise ValueError("the horizon must be > 0 s")
        if slice_blocks < 1:
            raise ValueError("a slice is at least one block")
        self.horizon_s = horizon_s
        self.slice_blocks = slice_blocks
        self.observer = observer
        self._ranks: dict[WorkerRank, RankRuns] = {}
        # touches not fully recorded, oldest first: (rank, sequence hashes, time, local hashes)
        self._pending: deque[tuple[WorkerRank, Sequence[int], float, Sequence[int] | None]] = deque()
        # the run of the oldest pending touch, once started: its blocks from ``end`` on are still to record
        self._recording: Run | None = None

    @property
    def total(self) -> int:
        """Live blocks on every rank (each rank's count; expired ones not yet removed included)."""
        return sum(rank.count for rank in self._ranks.values())

    def record(
        self, key: WorkerRank, seq_hashes: Sequence[int], now: float, local_hashes: Sequence[int] | None = None
    ) -> None:
        """The prompt was routed to the rank: its blocks are live there from now (its new blocks a slice at
        a time, by ``settle``, after the touches before it). ``local_hashes`` go to the observer."""
        if seq_hashes:
            self._pending.append((key, seq_hashes, now, local_hashes))
        self.settle()

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
        observer = self.observer
        while budget > 0 and pending:
            key, seq, now, local = pending[0]
            rank = self._ranks.get(key)
            if rank is None:
                rank = self._ranks[key] = RankRuns()
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
                        run = Run(seq, live, live, now, None)
                        rank.runs[run] = None  # before the prefix's runs, which move behind it
                    self._recording = run
                rank.refresh(seq, live, now)
                if run is None:
                    pending.popleft()
                    continue
            start = run.end
            stop = min(len(seq), start + budget)
            rank.blocks.set_all(seq[start:stop], run)
            rank.count += stop - start
            budget -= stop - start
            run.end = stop
            if observer is not None and stop > start:
                observer.stored(key, seq, local, start, stop)
            if stop == len(seq):
                pending.popleft()
                self._recording = None
        return bool(pending)

    def expire_rank(self, key: WorkerRank, now: float) -> RankRuns | None:
        """The rank, its blocks older than the horizon removed (up to a slice of them)."""
        rank = self._ranks.get(key)
        if rank is not None:
            rank.expire(now - self.horizon_s, self.slice_blocks, self._recording, self.observer, key)
        return rank

    def expire(self, now: float, budget: int) -> int:
        """Remove up to ``budget`` blocks older than the horizon, on every rank; returns the budget left (0:
        more may be left)."""
        cutoff = now - self.horizon_s
        for key, rank in self._ranks.items():
            if budget <= 0:
                break
            budget = rank.expire(cutoff, budget, self._recording, self.observer, key)
        return budget

    def drop_oldest(self, count: int) -> int:
        """Remove up to ``count`` blocks, least recently touched first across ranks, whatever their age (a
        size bound); returns how many went."""
        dropped = 0
        recording = self._recording
        while dropped < count:  # bounded: each pass removes a block or an emptied run, or stops
            best: tuple[float, WorkerRank, RankRuns] | None = None
            for key, rank in self._ranks.items():
                at = rank.oldest(recording)
                if at is not None and (best is None or at < best[0]):
                    best = (at, key, rank)
            if best is None:
                break
            _, key, rank = best
            run = next(iter(rank.runs))
            before = rank.count
            # this run alone: the rank's next one may be newer than another rank's oldest
            rank.expire(float("inf"), max(1, min(count - dropped, run.end - run.start)), recording, self.observer, key)
            dropped += before - rank.count
        return dropped

    def forget_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Drop the worker's (or one of its ranks') blocks at once, without telling the observer."""
        gone = [k for k in self._ranks if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)]
        for key in gone:
            del self._ranks[key]
        if self._pending and self._pending[0][0] in gone:
            self._recording = None
        self._pending = deque(p for p in self._pending if p[0] not in gone)
