"""The KV block index of one (model, tenant): which worker (and DP rank) holds which prompt blocks.

No I/O: the listener (ZMQ), the standalone service (HTTP) and the frontend all drive this core.

Device tier
    A compressed radix tree keyed by *local* block hash (the hash of a block's tokens): each
    ``_Run`` is a run of positions (parallel lists of local and external hashes) with a dict of
    children keyed by the next local hash, the workers covering the whole run (``full``) and those
    covering only its first k positions (``cutoffs``). ``lookup[worker][ext] -> run`` serves
    parent linkage and removals. A query compares whole runs as list slices and touches the holder
    sets only where they change, so the hot path is a handful of dict lookups per query.

    The rules are the reference's single-threaded tree (1.6.1 ``--threads 1``), checked by the
    differential test and a fuzzer against its Python binding: a store walks/splits runs by local
    hash and extends a leaf run in place; a removal cuts the worker's coverage of the *run* that
    holds the block from that block on (deeper runs keep the worker, so re-storing the removed
    block can make blocks the engine still caches reachable again); a run nobody fully covers
    forgets its children and a run nobody holds leaves the tree.

    One deliberate difference from the reference's radix tree: the reference only knows the external hash
    of a position's *first* inserter, so a worker whose engine names a shared block differently
    (vLLM without a shared PYTHONHASHSEED) cannot use its own hash as a parent or remove it, and
    its chain stops growing past the shared prefix. We also index each worker's own external hash
    for the position (``index`` aliases, ``own``), so parent linkage, removals, lower-tier anchors
    and ``/dump`` use the worker's own hashes. When engines agree on external hashes (the normal
    seeded case, and the differential test) both behave identically.

Lower tiers (host_pinned, disk, external)
    Per tier, an edge map ``(parent_ext | None, local) -> _TierEdge(child_ext, owners)``; an existing
    edge with a different child hash wins. Removal drops the worker from that one edge only; deeper
    edges remain but are unreachable until the link is stored again. A query continues each
    worker's device prefix through host, then disk, then external (the reference's tier order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvroute_common.constants import U64_MAX
from kvroute_common.hash_shards import MASK, HashShards

Worker = tuple[int, int]
"""(worker_id, dp_rank)."""

DEVICE = "device"
HOST_PINNED = "host_pinned"
DISK = "disk"
EXTERNAL = "external"
TIERS = (DEVICE, HOST_PINNED, DISK, EXTERNAL)
LOWER_TIERS = (HOST_PINNED, DISK, EXTERNAL)

MEDIUM_TIERS: dict[str | None, str] = {
    None: DEVICE,
    "": DEVICE,
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CPU": HOST_PINNED,
    "CPU_PINNED": HOST_PINNED,
    "CPU_TIER1": HOST_PINNED,
    "CPU_TIER2": DISK,
    "DISK": DISK,
    "NVME": DISK,
    "STORAGE": DISK,
    "EXTERNAL": EXTERNAL,
    "NETWORK": EXTERNAL,
    "REMOTE": EXTERNAL,
    "SHARED": EXTERNAL,
}
"""Engine medium name -> tier (case-sensitive). Unknown media are not indexed."""


def tier_for_medium(medium: str | None) -> str | None:
    """The tier an event's ``medium`` maps to, or None when the event must be dropped."""
    return MEDIUM_TIERS.get(medium)


class LazyHashes(Protocol):
    """A query's local hashes computed on demand (``KvIndex.find_matches_lazy``)."""

    hashes: list[int]
    """The leading hashes computed so far."""
    total: int
    """How many hashes the query has."""

    def fill(self, k: int) -> object:
        """Extend ``hashes`` in place to min(k, total) hashes."""
        ...


class _TierEdge:
    __slots__ = ("child", "owners")

    def __init__(self, child: int) -> None:
        self.child = child
        self.owners: set[Worker] = set()


class _LowerTier:
    """One lower tier: edges keyed by (parent external hash, local hash)."""

    __slots__ = ("edges", "by_worker")

    def __init__(self) -> None:
        self.edges: dict[tuple[int | None, int], _TierEdge] = {}
        self.by_worker: dict[Worker, dict[int, tuple[int | None, int]]] = {}

    def store(self, w: Worker, parent: int | None, blocks: Sequence[tuple[int, int]]) -> None:
        edges = self.edges
        mine = self.by_worker.get(w)
        if mine is None:
            mine = self.by_worker[w] = {}
        prev = parent
        for ext, local in blocks:
            key = (prev, local)
            edge = edges.get(key)
            if edge is None:
                edge = edges[key] = _TierEdge(ext)
            if edge.child == ext:  # an existing edge with another child hash wins
                edge.owners.add(w)
                mine[ext] = key
            prev = ext

    def remove(self, w: Worker, ext_hashes: Iterable[int]) -> int:
        mine = self.by_worker.get(w)
        if not mine:
            return 0
        removed = 0
        for ext in ext_hashes:
            key = mine.pop(ext, None)
            if key is None:
                continue
            edge = self.edges.get(key)
            if edge is not None and w in edge.owners:
                edge.owners.discard(w)
                removed += 1
                if not edge.owners:
                    del self.edges[key]
        if not mine:
            del self.by_worker[w]
        return removed

    def drop_worker(self, w: Worker) -> None:
        mine = self.by_worker.pop(w, None)
        if mine:
            self.remove_keys(w, mine.values())

    def remove_keys(self, w: Worker, keys: Iterable[tuple[int | None, int]]) -> None:
        edges = self.edges
        for key in list(keys):
            edge = edges.get(key)
            if edge is not None:
                edge.owners.discard(w)
                if not edge.owners:
                    del edges[key]

    def walk(self, w: Worker, anchor: int | None, query: Sequence[int], start: int) -> tuple[int, int | None]:
        """(blocks extended, new anchor) following ``w``'s edges from ``query[start]``."""
        edges = self.edges
        i, n = start, len(query)
        while i < n:
            edge = edges.get((anchor, query[i]))
            if edge is None or w not in edge.owners:
                break
            anchor = edge.child
            i += 1
        return i - start, anchor


class _Run:
    """One compressed edge of the device tree: a run of positions with the same children structure.

    ``locals``/``exts`` are the run's blocks (external hash of the first inserter), ``index`` maps
    every external hash known for a position (the first inserter's and other workers' aliases)
    to its offset, ``own`` records a worker's external hash where it differs from ``exts``.
    ``full`` holds the workers covering the whole run, ``cutoffs[w] = k`` a worker covering only
    the first k positions (0 < k < len).
    """

    __slots__ = ("locals", "exts", "index", "own", "full", "cutoffs", "children", "internal", "parent")

    def __init__(self, locals_: list[int], exts: list[int], internal: bool = False, parent: _Run | None = None) -> None:
        self.parent = parent
        self.locals = locals_
        self.exts = exts
        self.index: dict[int, int] = {e: i for i, e in enumerate(exts)}
        self.own: dict[tuple[Worker, int], int] | None = None
        self.full: set[Worker] = set()
        self.cutoffs: dict[Worker, int] = {}
        self.children: dict[int, _Run] = {}
        self.internal = internal  # once a run had children it is never extended in place again

    def covers(self, w: Worker, pos: int) -> bool:
        if w in self.full:
            return True
        c = self.cutoffs.get(w)
        return c is not None and pos < c

    def cutoff(self, w: Worker) -> int:
        if w in self.full:
            return len(self.locals)
        return self.cutoffs.get(w, 0)

    def has_workers(self) -> bool:
        return bool(self.full) or bool(self.cutoffs)

    def ext_of(self, w: Worker, pos: int) -> int:
        """The external hash ``w`` uses for position ``pos``."""
        own = self.own
        if own:
            e = own.get((w, pos))
            if e is not None:
                return e
        return self.exts[pos]

    def promote(self, w: Worker) -> bool:
        if w in self.full:
            return False
        self.cutoffs.pop(w, None)
        self.full.add(w)
        return True

    def cover_prefix(self, w: Worker, k: int) -> bool:
        if k <= 0:
            return False
        if k >= len(self.locals):
            return self.promote(w)
        if w in self.full:
            return False
        if self.cutoffs.get(w, 0) >= k:
            return False
        self.cutoffs[w] = k
        return True

    def drop(self, w: Worker) -> None:
        self.full.discard(w)
        self.cutoffs.pop(w, None)

    def note_exts(self, w: Worker, start: int, exts: list[int]) -> None:
        """Remember ``w``'s own external hashes for positions start.. where they differ."""
        mine = self.exts
        if mine[start : start + len(exts)] == exts:  # the normal case: same hashes as the first inserter
            return
        for k, ext in enumerate(exts):
            pos = start + k
            if mine[pos] != ext:
                self.index.setdefault(ext, pos)
                if self.own is None:
                    self.own = {}
                self.own[(w, pos)] = ext

    def append(self, w: Worker, exts: list[int], locs: list[int]) -> None:
        """Leaf extension: other full holders now cover only the old length."""
        old = len(self.locals)
        if len(self.full) > 1 or w not in self.full:
            for other in [x for x in self.full if x != w]:
                self.full.discard(other)
                self.cutoffs[other] = old
            self.promote(w)
        self.locals.extend(locs)
        self.exts.extend(exts)
        self.index.update(zip(exts, range(old, old + len(exts)), strict=True))


class KvIndex:
    """Block index of one (model, tenant) partition with a fixed block size.

    The device tier reproduces the reference's compressed radix tree (1.6.1, ``--threads 1``):
    a removal cuts the worker's coverage of the *run* holding the block from that block on, but
    not of deeper runs, so re-storing the removed block can make deeper blocks the engine still
    holds reachable again; a run nobody fully covers forgets its children.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._root = _Run([], [], internal=True)
        self._lookup: dict[Worker, HashShards[_Run]] = {}  # per worker: external hash -> the run holding it
        self._lower: dict[str, _LowerTier] = {t: _LowerTier() for t in LOWER_TIERS}

    # ---------------------------------------------------------------- mutation

    @property
    def size(self) -> int:
        """Number of (worker, external hash) entries: what approximate-mode pruning bounds."""
        return sum(len(m) for m in self._lookup.values())

    def blocks_per_worker(self) -> dict[Worker, int]:
        """Device-tier blocks held per (worker_id, dp_rank): what the dashboard shows as blocks indexed."""
        return {w: len(m) for w, m in self._lookup.items() if m}

    def workers(self) -> set[Worker]:
        """Every (worker_id, dp_rank) holding at least one block in any tier."""
        out = {w for w, m in self._lookup.items() if m}
        for tier in self._lower.values():
            out.update(w for w, m in tier.by_worker.items() if m)
        return out

    def apply_stored(
        self,
        worker_id: int,
        dp_rank: int,
        parent_ext_hash: int | None,
        blocks: Sequence[tuple[int, int]],
        tier: str = DEVICE,
    ) -> bool:
        """Store ``blocks`` = [(external hash, local hash), ...] below ``parent_ext_hash``.

        Returns False (nothing stored) when the parent is not a block this worker holds, or the
        parent reappears among the blocks.
        """
        return self.apply_stored_hashes(
            worker_id, dp_rank, parent_ext_hash, [b[0] for b in blocks], [b[1] for b in blocks], tier
        )

    def apply_stored_hashes(
        self,
        worker_id: int,
        dp_rank: int,
        parent_ext_hash: int | None,
        exts: list[int],
        locs: list[int],
        tier: str = DEVICE,
    ) -> bool:
        """apply_stored with parallel lists of external and local hashes (the ingest path)."""
        w = (worker_id, dp_rank)
        if parent_ext_hash is not None and parent_ext_hash in exts:
            return False
        if tier != DEVICE:
            self._lower[tier].store(w, parent_ext_hash, list(zip(exts, locs, strict=True)))
            return True
        lookup = self._lookup_of(w)
        if parent_ext_hash is None:
            parent = self._root
        else:
            node = lookup.get(parent_ext_hash)
            if node is None:
                return False
            ppos = node.index.get(parent_ext_hash)
            if ppos is None:
                return False
            if not node.covers(w, ppos):
                del lookup[parent_ext_hash]
                return False
            if self._reuse_parent_run(w, node, ppos, exts, locs, lookup):
                return True
            if ppos != len(node.locals) - 1:
                self._split(node, ppos + 1)
            parent = node
        i, n = 0, len(exts)
        while i < n:
            child = parent.children.get(locs[i])
            if child is None:
                rest_e, rest_l = exts[i:], locs[i:]
                if parent is not self._root and not parent.internal and parent.covers(w, len(parent.locals) - 1):
                    parent.append(w, rest_e, rest_l)
                    lookup.set_all(rest_e, parent)
                    break
                new = _Run(rest_l, rest_e, parent=parent)
                new.full.add(w)
                parent.internal = True
                parent.children[rest_l[0]] = new
                lookup.set_all(rest_e, new)
                break
            run_locs = child.locals
            run_len = len(run_locs)
            lim = min(run_len, n - i)
            if run_locs[:lim] == locs[i : i + lim]:
                m = lim
            else:
                m = 1
                while locs[i + m] == run_locs[m]:
                    m += 1
            if m < run_len:
                if m == n - i:  # the store ends inside this run
                    child.cover_prefix(w, m)
                    child.note_exts(w, 0, exts[i:])
                    lookup.set_all(exts[i:], child)
                    break
                self._split(child, m)
                child.promote(w)
                child.note_exts(w, 0, exts[i : i + m])
                lookup.set_all(exts[i : i + m], child)
                tail_e, tail_l = exts[i + m :], locs[i + m :]
                tail_run = _Run(tail_l, tail_e, parent=child)
                tail_run.full.add(w)
                child.internal = True
                child.children[tail_l[0]] = tail_run
                lookup.set_all(tail_e, tail_run)
                break
            child.promote(w)
            seg = exts[i : i + run_len]
            child.note_exts(w, 0, seg)
            lookup.set_all(seg, child)
            i += run_len
            parent = child
        return True

    def _reuse_parent_run(
        self, w: Worker, node: _Run, ppos: int, exts: list[int], locs: list[int], lookup: HashShards[_Run]
    ) -> bool:
        """A store continuing inside the parent's run (same local AND external hashes) reuses it."""
        start = ppos + 1
        suffix_len = len(node.locals) - start
        k = min(suffix_len, len(exts))
        if k and (node.locals[start : start + k] != locs[:k] or node.exts[start : start + k] != exts[:k]):
            return False
        if len(exts) <= suffix_len:
            node.cover_prefix(w, start + len(exts))
            lookup.set_all(exts, node)
            return True
        if not node.internal:
            node.append(w, exts[suffix_len:], locs[suffix_len:])
            lookup.set_all(exts, node)
            return True
        return False

    def _split(self, node: _Run, pos: int) -> None:
        """Cut ``node`` at ``pos``; the tail becomes its only child, holders carried over."""
        suffix = _Run(node.locals[pos:], node.exts[pos:], internal=node.internal, parent=node)
        del node.locals[pos:]
        del node.exts[pos:]
        suffix.index = {}
        kept: dict[int, int] = {}
        for ext, p in node.index.items():
            if p >= pos:
                suffix.index[ext] = p - pos
            else:
                kept[ext] = p
        node.index = kept
        if node.own:
            own, node.own, suffix.own = node.own, {}, {}
            for (w, p), ext in own.items():
                if p >= pos:
                    suffix.own[(w, p - pos)] = ext
                else:
                    node.own[(w, p)] = ext
        suffix.full = set(node.full)
        for w, c in list(node.cutoffs.items()):
            if c < pos:
                continue
            del node.cutoffs[w]
            node.full.add(w)
            if c > pos:
                suffix.cutoffs[w] = c - pos
        suffix.children = node.children
        for child in suffix.children.values():
            child.parent = suffix
        node.children = {suffix.locals[0]: suffix}
        node.internal = True
        for w in suffix.full:
            self._lookup_of(w).set_all([suffix.ext_of(w, p) for p in range(len(suffix.locals))], suffix)
        for w, c in suffix.cutoffs.items():
            self._lookup_of(w).set_all([suffix.ext_of(w, p) for p in range(c)], suffix)

    def _lookup_of(self, w: Worker) -> HashShards[_Run]:
        """The worker's map of external hash -> run, made empty the first time (not built only to be
        thrown away, as ``setdefault`` would: a map is 64 dicts)."""
        lookup = self._lookup.get(w)
        if lookup is None:
            lookup = self._lookup[w] = HashShards()
        return lookup

    def apply_removed(self, worker_id: int, dp_rank: int, ext_hashes: Iterable[int], tier: str = DEVICE) -> int:
        """Remove blocks by external hash. Unknown hashes are skipped; returns how many were found.

        On the device tier a removal drops the worker's coverage of the block's run from that
        block on (consecutive hashes of one run are handled as one cut, as the reference does).
        """
        w = (worker_id, dp_rank)
        if tier != DEVICE:
            return self._lower[tier].remove(w, ext_hashes)
        if not isinstance(ext_hashes, list):
            ext_hashes = list(ext_hashes)
        lookup = self._lookup_of(w)
        parts = lookup.parts
        found = 0
        eagerly_removed: set[int] = set()
        i, n = 0, len(ext_hashes)
        while i < n:
            h = ext_hashes[i]
            i += 1
            node = parts[h & MASK].pop(h, None)
            if node is None:
                if h in eagerly_removed:
                    found += 1
                continue
            first = node.index.get(h)
            if first is None:
                parts[h & MASK][h] = node
                continue
            found += 1
            min_pos, min_hash = first, h
            if node.covers(w, first):
                while i < n:
                    c = ext_hashes[i]
                    if parts[c & MASK].get(c) is not node:
                        break
                    cp = node.index.get(c)
                    if cp is None or not node.covers(w, cp):
                        break
                    if cp < min_pos:
                        min_pos, min_hash = cp, c
                    found += 1
                    i += 1
            for s in self._cut(w, lookup, node, min_pos, min_hash):
                eagerly_removed.add(s)
        return found

    def apply_removed_each(self, worker_id: int, dp_rank: int, ext_hashes: list[int]) -> int:
        """``apply_removed`` of one device-tier block per hash, in order, as that many single-block events
        (what vLLM publishes for every evicted block); returns how many were found. One call for the run
        instead of one per event: an engine evicting a long prompt sends hundreds per batch.

        vLLM frees a request's blocks last first, so its evictions name a run's blocks at falling
        positions: each such event cuts the run where the one before cut it, and the whole stretch is
        one cut at its lowest position (the same blocks lost, each event found)."""
        w = (worker_id, dp_rank)
        lookup = self._lookup_of(w)
        parts = lookup.parts
        found = 0
        cut = self._cut
        i, n = 0, len(ext_hashes)
        while i < n:
            h = ext_hashes[i]
            i += 1
            node = parts[h & MASK].pop(h, None)
            if node is None:
                continue
            index = node.index
            pos = index.get(h)
            if pos is None:
                parts[h & MASK][h] = node
                continue
            found += 1
            while i < n:
                c = ext_hashes[i]
                cp = index.get(c)
                if cp is None or cp >= pos or parts[c & MASK].get(c) is not node:
                    break
                pos, h = cp, c
                found += 1
                i += 1
            cut(w, lookup, node, pos, h)
        return found

    def _cut(self, w: Worker, lookup: HashShards[_Run], node: _Run, pos: int, ext: int) -> list[int]:
        """``w`` loses ``node`` from ``pos`` (the block ``ext``) on: the external hashes it no longer holds
        there, gone from its lookup."""
        current = node.cutoff(w)
        if pos >= current:
            stale = [ext]
        else:
            # only the positions it still covered: a run evicted tail first costs one step per block
            stale = [node.ext_of(w, p) for p in range(pos, current)]
            if pos == 0:
                node.drop(w)
            else:
                node.full.discard(w)
                node.cutoffs[w] = pos
        self._after_loss(node)
        parts = lookup.parts
        for s in stale:
            parts[s & MASK].pop(s, None)
        return stale

    @staticmethod
    def _after_loss(node: _Run) -> None:
        """A run nobody fully covers forgets its children; a run nobody holds leaves the tree."""
        if not node.full:
            node.children = {}
            if not node.cutoffs and node.parent is not None:
                siblings = node.parent.children
                if siblings.get(node.locals[0]) is node:
                    del siblings[node.locals[0]]

    def apply_cleared(self, worker_id: int, dp_rank: int) -> None:
        """AllBlocksCleared: the worker's rank loses everything, in every tier."""
        self._drop((worker_id, dp_rank))

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Forget a worker (every DP rank it ever stored under, or one rank)."""
        if dp_rank is not None:
            self._drop((worker_id, dp_rank))
            return
        ranks = {w for w in self._lookup if w[0] == worker_id}
        ranks.update(w for w in self.workers() if w[0] == worker_id)
        for w in ranks:
            self._drop(w)

    def _drop(self, w: Worker) -> None:
        lookup = self._lookup.pop(w, None)
        if lookup:
            # each run once, in the order its first block was met; deduplicated in C (runs hash by identity):
            # a worker holds up to hundreds of thousands of blocks in a few thousand runs
            runs: dict[_Run, None] = {}
            for part in lookup.parts:
                runs.update(dict.fromkeys(part.values()))
            for node in runs:
                node.drop(w)
                self._after_loss(node)
        for tier in self._lower.values():
            tier.drop_worker(w)

    # ---------------------------------------------------------------- queries

    def find_matches(self, local_hashes: Sequence[int]) -> dict[Worker, int]:
        """Per (worker_id, dp_rank): how many leading query blocks it holds on the device tier."""
        return self._find(local_hashes, len(local_hashes), None)

    def find_matches_lazy(self, query: LazyHashes) -> dict[Worker, int]:
        """find_matches on hashes the walk asks ``query`` for run by run: the walk usually stops at
        the first block nobody holds, long before the prompt's end, so the rest is never hashed."""
        return self._find(query.hashes, query.total, query.fill)

    def _find(self, local_hashes: Sequence[int], n: int, fill: Callable[[int], object] | None) -> dict[Worker, int]:
        """find_matches over the first ``n`` hashes; ``fill(k)``, when given, extends ``local_hashes``
        in place to min(k, n) hashes before they are read."""
        if not n:
            return {}
        if fill is not None:
            fill(1)
        node = self._root.children.get(local_hashes[0])
        scores: dict[Worker, int] = {}
        active: set[Worker] | None = None
        depth = 0
        while node is not None:
            locs = node.locals
            run_len = len(locs)
            lim = run_len if run_len <= n - depth else n - depth
            if fill is not None:
                fill(depth + lim + 1)  # this run's blocks and the next child's key
            if locs[:lim] == local_hashes[depth : depth + lim]:
                m = lim
            else:
                m = 1
                while m < lim and locs[m] == local_hashes[depth + m]:
                    m += 1
            if active is None:
                active = set(node.full)
                for w, c in node.cutoffs.items():
                    scores[w] = c if c < m else m
            elif not active <= node.full:
                full, cutoffs = node.full, node.cutoffs
                for w in [x for x in active if x not in full]:
                    c = cutoffs.get(w, 0)
                    scores[w] = depth + (c if c < m else m)
                    active.discard(w)
            depth += m
            if not active or m < run_len or depth == n:
                break
            node = node.children.get(local_hashes[depth])
        if active:
            for w in active:
                scores[w] = depth
        return scores

    def _device_walk(self, local_hashes: Sequence[int]) -> dict[Worker, tuple[int, int | None]]:
        """find_matches plus each worker's external hash of its last matched block."""
        out: dict[Worker, tuple[int, int | None]] = {}
        n = len(local_hashes)
        if not n:
            return out
        node = self._root.children.get(local_hashes[0])
        active: set[Worker] | None = None
        depth = 0
        last: tuple[_Run, int] | None = None  # (run, offset) of the last matched block
        while node is not None:
            locs = node.locals
            run_len = len(locs)
            lim = min(run_len, n - depth)
            m = 1
            while m < lim and locs[m] == local_hashes[depth + m]:
                m += 1
            if active is None:
                active = set(node.full)
                for w, c in node.cutoffs.items():
                    k = min(c, m)
                    out[w] = (k, node.ext_of(w, k - 1))
            else:
                full, cutoffs = node.full, node.cutoffs
                for w in [x for x in active if x not in full]:
                    k = min(cutoffs.get(w, 0), m)
                    if k:
                        out[w] = (depth + k, node.ext_of(w, k - 1))
                    else:
                        assert last is not None
                        out[w] = (depth, last[0].ext_of(w, last[1]))
                    active.discard(w)
            depth += m
            last = (node, m - 1)
            if not active or m < run_len or depth == n:
                break
            node = node.children.get(local_hashes[depth])
        if active and last is not None:
            for w in active:
                out[w] = (depth, last[0].ext_of(w, last[1]))
        return out

    def has_lower_tiers(self) -> bool:
        """Whether any worker holds blocks below the device tier (queries then walk those tiers too)."""
        lower = self._lower
        return bool(lower[HOST_PINNED].edges or lower[DISK].edges or lower[EXTERNAL].edges)

    def tier_matches(self, local_hashes: Sequence[int]) -> dict[Worker, tuple[int, int, int]]:
        """Per worker: (device blocks, device+host blocks, device+host+disk+external blocks).

        Includes workers that reach the query only through lower tiers (device 0).
        """
        lower = (self._lower[HOST_PINNED], self._lower[DISK], self._lower[EXTERNAL])
        if not local_hashes or not any(t.edges for t in lower):
            return {w: (d, d, d) for w, d in self.find_matches(local_hashes).items()}
        device = self._device_walk(local_hashes)
        candidates: dict[Worker, tuple[int, int | None]] = {w: v for w, v in device.items() if v[0]}
        root_key = (None, local_hashes[0])
        for t in lower:
            edge = t.edges.get(root_key)
            if edge is not None:
                for w in edge.owners:
                    candidates.setdefault(w, (0, None))
        host, disk, external = lower
        out: dict[Worker, tuple[int, int, int]] = {}
        for w, (d, anchor) in candidates.items():
            if not d:
                anchor = None
            h, anchor = host.walk(w, anchor, local_hashes, d)
            k, anchor = disk.walk(w, anchor, local_hashes, d + h)
            x, _ = external.walk(w, anchor, local_hashes, d + h + k)
            if d or h or k or x:
                out[w] = (d, d + h, d + h + k + x)
        return out

    # ---------------------------------------------------------------- dump / restore

    def dump_events(self) -> list[dict[str, Any]]:
        """The index as RouterEvents (the reference's /dump shape); device tier breadth-first.

        Chains of runs with the same full holders (and no partial ones) are merged into one
        event per holder; each lower-tier edge becomes one single-block event per owner.
        """
        events: list[dict[str, Any]] = []
        event_id = 0
        queue: deque[tuple[_Run, _Run | None]] = deque((c, None) for c in self._root.children.values())
        while queue:
            start, parent = queue.popleft()
            chain: list[_Run] = []
            cur = start
            while True:
                if not cur.has_workers() and not cur.children:
                    break
                chain.append(cur)
                live = [c for c in cur.children.values() if c.has_workers() or c.children]
                if (
                    not cur.cutoffs
                    and len(live) == 1
                    and not live[0].cutoffs
                    and live[0].full == cur.full
                    and live[0].has_workers()
                ):
                    cur = live[0]
                    continue
                if not chain:
                    break
                holders = [(w, None) for w in sorted(cur.full)] + sorted(cur.cutoffs.items())
                for w, cutoff in holders:
                    blocks = []
                    for r in chain:
                        stop = len(r.locals) if (cutoff is None or r is not cur) else cutoff
                        for p in range(stop):
                            blocks.append(
                                {"block_hash": r.ext_of(w, p), "tokens_hash": r.locals[p], "mm_extra_info": None}
                            )
                    parent_hash = parent.ext_of(w, len(parent.locals) - 1) if parent is not None else None
                    events.append(_router_event(w, DEVICE, event_id, parent_hash, blocks))
                    event_id += 1
                for child in live:
                    queue.append((child, cur))
                break
        for tier_name in LOWER_TIERS:
            event_id = 0
            for (parent_hash, local), edge in self._lower[tier_name].edges.items():
                blocks = [{"block_hash": edge.child, "tokens_hash": local, "mm_extra_info": None}]
                for w in sorted(edge.owners):
                    events.append(_router_event(w, tier_name, event_id, parent_hash, blocks))
                    event_id += 1
        return events

    def restore_events(self, events: Iterable[dict[str, Any]]) -> int:
        """Apply RouterEvents (a /dump's ``events``); returns how many were applied.

        Raises ValueError on an event that is not a RouterEvent.
        """
        applied = 0
        for ev in events:
            applied += apply_router_event(self, ev)
        return applied


def _router_event(
    w: Worker, tier: str, event_id: int, parent_hash: int | None, blocks: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "worker_id": w[0],
        "storage_tier": tier,
        "residency_domain": "worker",
        "event": {
            "event_id": event_id,
            "data": {"stored": {"parent_hash": parent_hash, "start_position": None, "blocks": blocks}},
            "dp_rank": w[1],
        },
    }


def _u64(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer")
    return value & U64_MAX


def apply_router_event(index: KvIndex, ev: dict[str, Any]) -> int:
    """Apply one dump RouterEvent (stored / removed / cleared) to ``index``; 1 if applied."""
    if not isinstance(ev, dict):
        raise ValueError("router event must be an object")
    worker_id = _u64(ev.get("worker_id"), "worker_id")
    tier = ev.get("storage_tier", DEVICE) or DEVICE
    if tier not in TIERS:
        raise ValueError(f"unknown storage_tier {tier!r}")
    inner = ev.get("event")
    if not isinstance(inner, dict):
        raise ValueError("router event needs an `event` object")
    dp_rank = inner.get("dp_rank", 0) or 0
    if not isinstance(dp_rank, int):
        raise ValueError("dp_rank must be an integer")
    data = inner.get("data")
    if data == "cleared" or (isinstance(data, dict) and "cleared" in data):
        index.apply_cleared(worker_id, dp_rank)
        return 1
    if not isinstance(data, dict):
        raise ValueError("event data must be stored, removed or cleared")
    if "stored" in data:
        stored = data["stored"]
        if not isinstance(stored, dict) or not isinstance(stored.get("blocks"), list):
            raise ValueError("stored event needs blocks")
        parent = stored.get("parent_hash")
        parent = None if parent is None else _u64(parent, "parent_hash")
        blocks = []
        for b in stored["blocks"]:
            if not isinstance(b, dict):
                raise ValueError("block must be an object")
            blocks.append((_u64(b.get("block_hash"), "block_hash"), _u64(b.get("tokens_hash"), "tokens_hash")))
        return int(index.apply_stored(worker_id, dp_rank, parent, blocks, tier))
    if "removed" in data:
        removed = data["removed"]
        hashes = removed.get("block_hashes") if isinstance(removed, dict) else None
        if not isinstance(hashes, list):
            raise ValueError("removed event needs block_hashes")
        index.apply_removed(worker_id, dp_rank, [_u64(h, "block_hash") for h in hashes], tier)
        return 1
    raise ValueError("event data must be stored, removed or cleared")
