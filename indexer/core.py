"""The KV block index of one (model, tenant): which worker (and DP rank) holds which prompt blocks.

No I/O: the listener (ZMQ), the standalone service (HTTP) and the frontend all drive this core.

Device tier
    A trie keyed by *local* block hash (the hash of a block's tokens). Each position is a
    ``_Node`` whose ``children`` dict maps the next local hash to the child position, and whose
    ``workers`` dict maps each holding worker ``(worker_id, dp_rank)`` to the *external* hash that
    worker's engine uses for the block. A worker also gets ``lookup[worker][ext] -> node`` for
    parent linkage and removals. Walking a query is one dict lookup per block; no per-block
    objects are allocated on the hot path.

    Invariant: a worker holding a position holds all its ancestors (stores extend a held parent,
    removals cut the whole path below). So along any path the holder sets only shrink, and a
    worker's score is simply the depth of the deepest query position it still holds; find_matches
    only compares set sizes until a size changes.

    External hashes are kept *per worker* (not the first inserter's, as the 1.6.1 reference does,
    its §3.5 quirk): a worker whose engine names a shared block differently can still extend its
    own chain with its own parent hash, and ``/dump`` reports each worker's own hashes so a peer
    restoring the dump resolves that worker's later parents. When all engines agree on external
    hashes (the normal, seeded case) both behaviours are identical.

Lower tiers (host_pinned, disk, external)
    Per tier, an edge map ``(parent_ext | None, local) -> _Edge(child_ext, owners)``; an existing
    edge with a different child hash wins. Removal drops the worker from that one edge only; deeper
    edges remain but are unreachable until the link is stored again. A query continues each
    worker's device prefix through host, then disk, then external (reference §3.6).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

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


class _Node:
    __slots__ = ("local", "parent", "children", "workers")

    def __init__(self, local: int, parent: _Node | None) -> None:
        self.local = local
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.workers: dict[Worker, int] = {}


class _Edge:
    __slots__ = ("child", "owners")

    def __init__(self, child: int) -> None:
        self.child = child
        self.owners: set[Worker] = set()


class _LowerTier:
    """One lower tier: edges keyed by (parent external hash, local hash)."""

    __slots__ = ("edges", "by_worker")

    def __init__(self) -> None:
        self.edges: dict[tuple[int | None, int], _Edge] = {}
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
                edge = edges[key] = _Edge(ext)
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


class KvIndex:
    """Block index of one (model, tenant) partition with a fixed block size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._root = _Node(0, None)
        self._lookup: dict[Worker, dict[int, _Node]] = {}
        self._lower: dict[str, _LowerTier] = {t: _LowerTier() for t in LOWER_TIERS}
        self._size = 0

    # ---------------------------------------------------------------- mutation

    @property
    def size(self) -> int:
        """Number of (worker, device position) entries: what approximate-mode pruning bounds."""
        return self._size

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
        w = (worker_id, dp_rank)
        if parent_ext_hash is not None and any(ext == parent_ext_hash for ext, _ in blocks):
            return False
        if tier != DEVICE:
            self._lower[tier].store(w, parent_ext_hash, blocks)
            return True
        lookup = self._lookup.get(w)
        if parent_ext_hash is None:
            node = self._root
        else:
            node = lookup.get(parent_ext_hash) if lookup is not None else None
            if node is None or w not in node.workers:
                return False
        if lookup is None:
            lookup = self._lookup[w] = {}
        size = self._size
        for ext, local in blocks:
            children = node.children
            if children is None:
                children = node.children = {}
                child = None
            else:
                child = children.get(local)
            if child is None:
                child = children[local] = _Node(local, node)
            holders = child.workers
            if w not in holders:
                size += 1
            holders[w] = ext
            lookup[ext] = child
            node = child
        self._size = size
        return True

    def apply_removed(self, worker_id: int, dp_rank: int, ext_hashes: Iterable[int], tier: str = DEVICE) -> int:
        """Remove blocks by external hash; on the device tier each cuts the worker's path below it.

        Unknown hashes are skipped. Returns how many of the given hashes were found.
        """
        w = (worker_id, dp_rank)
        if tier != DEVICE:
            return self._lower[tier].remove(w, ext_hashes)
        lookup = self._lookup.get(w)
        if not lookup:
            return 0
        found = 0
        for ext in ext_hashes:
            node = lookup.get(ext)
            if node is None or w not in node.workers:
                continue
            found += 1
            self._cut(w, node, lookup)
        if not lookup:
            self._lookup.pop(w, None)
        return found

    def apply_cleared(self, worker_id: int, dp_rank: int) -> None:
        """AllBlocksCleared: the worker's rank loses everything, in every tier."""
        self._drop((worker_id, dp_rank))

    def remove_worker(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Forget a worker (every DP rank it ever stored under, or one rank)."""
        if dp_rank is not None:
            self._drop((worker_id, dp_rank))
            return
        for w in [w for w in self.workers() if w[0] == worker_id]:
            self._drop(w)

    def _drop(self, w: Worker) -> None:
        lookup = self._lookup.pop(w, None)
        if lookup:
            for node in list(lookup.values()):
                if w in node.workers:
                    self._cut(w, node, lookup)
        for tier in self._lower.values():
            tier.drop_worker(w)

    def _cut(self, w: Worker, node: _Node, lookup: dict[int, _Node]) -> None:
        """Remove ``w`` from ``node`` and every deeper position it holds on that path."""
        stack = [node]
        size = self._size
        while stack:
            n = stack.pop()
            ext = n.workers.pop(w, None)
            if ext is None:
                continue
            size -= 1
            if lookup.get(ext) is n:
                del lookup[ext]
            if n.children:
                stack.extend(c for c in n.children.values() if w in c.workers)
            if not n.workers:
                self._detach(n)
        self._size = size

    @staticmethod
    def _detach(n: _Node) -> None:
        parent = n.parent
        if parent is None:
            return
        siblings = parent.children
        if siblings is not None and siblings.get(n.local) is n:
            del siblings[n.local]
            if not siblings:
                parent.children = None

    # ---------------------------------------------------------------- queries

    def find_matches(self, local_hashes: Sequence[int]) -> dict[Worker, int]:
        """Per (worker_id, dp_rank): how many leading query blocks it holds on the device tier."""
        if not local_hashes:
            return {}
        children = self._root.children
        cur = children.get(local_hashes[0]) if children else None
        if cur is None:
            return {}
        scores: dict[Worker, int] = {}
        depth = 1
        held = cur.workers
        for h in local_hashes[1:]:
            children = cur.children
            if children is None:
                break
            nxt = children.get(h)
            if nxt is None:
                break
            nheld = nxt.workers
            if len(nheld) != len(held):  # holders only shrink along a path
                for w in held.keys() - nheld.keys():
                    scores[w] = depth
            cur, held = nxt, nheld
            depth += 1
        for w in held:
            scores[w] = depth
        return scores

    def _device_walk(self, local_hashes: Sequence[int]) -> dict[Worker, tuple[int, int]]:
        """Like find_matches, with the worker's external hash of its last matched block."""
        out: dict[Worker, tuple[int, int]] = {}
        if not local_hashes:
            return out
        children = self._root.children
        cur = children.get(local_hashes[0]) if children else None
        if cur is None:
            return out
        depth = 1
        for h in local_hashes[1:]:
            children = cur.children
            nxt = children.get(h) if children else None
            if nxt is None:
                break
            if len(nxt.workers) != len(cur.workers):
                for w in cur.workers.keys() - nxt.workers.keys():
                    out[w] = (depth, cur.workers[w])
            cur = nxt
            depth += 1
        for w, ext in cur.workers.items():
            out[w] = (depth, ext)
        return out

    def tier_matches(self, local_hashes: Sequence[int]) -> dict[Worker, tuple[int, int, int]]:
        """Per worker: (device blocks, device+host blocks, device+host+disk+external blocks).

        Includes workers that reach the query only through lower tiers (device 0).
        """
        device = self._device_walk(local_hashes)
        lower = [t for t in (self._lower[HOST_PINNED], self._lower[DISK], self._lower[EXTERNAL])]
        if not any(t.edges for t in lower) or not local_hashes:
            return {w: (d, d, d) for w, (d, _) in device.items()}
        candidates: dict[Worker, tuple[int, int | None]] = dict(device)
        root_key = (None, local_hashes[0])
        for t in lower:
            edge = t.edges.get(root_key)
            if edge is not None:
                for w in edge.owners:
                    candidates.setdefault(w, (0, None))
        host, disk, external = lower
        out: dict[Worker, tuple[int, int, int]] = {}
        for w, (d, anchor) in candidates.items():
            h, anchor = host.walk(w, anchor, local_hashes, d)
            k, anchor = disk.walk(w, anchor, local_hashes, d + h)
            x, _ = external.walk(w, anchor, local_hashes, d + h + k)
            if d or h or k or x:
                out[w] = (d, d + h, d + h + k + x)
        return out

    # ---------------------------------------------------------------- dump / restore

    def dump_events(self) -> list[dict[str, Any]]:
        """The index as RouterEvents (the reference's /dump shape); device tier breadth-first.

        Device runs of positions with one child and identical holders become one event per
        holder; each lower-tier edge becomes one single-block event per owner.
        """
        events: list[dict[str, Any]] = []
        event_id = 0
        queue: deque[_Node] = deque()
        if self._root.children:
            queue.extend(self._root.children.values())
        while queue:
            start = queue.popleft()
            run = [start]
            node = start
            while node.children and len(node.children) == 1:
                (child,) = node.children.values()
                if child.workers.keys() != node.workers.keys():
                    break
                run.append(child)
                node = child
            if node.children:
                queue.extend(node.children.values())
            parent = start.parent
            for w in start.workers:
                parent_hash = parent.workers.get(w) if parent is not None and parent is not self._root else None
                blocks = [{"block_hash": n.workers[w], "tokens_hash": n.local, "mm_extra_info": None} for n in run]
                events.append(_router_event(w, DEVICE, event_id, parent_hash, blocks))
                event_id += 1
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


def _router_event(w: Worker, tier: str, event_id: int, parent_hash: int | None, blocks: list[dict[str, Any]]) -> dict[str, Any]:
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


_U64 = (1 << 64) - 1


def _u64(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer")
    return value & _U64


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
