"""Active-request accounting (the "slot tracker" core): no I/O, one asyncio loop, synchronous calls.

A *slot* is one ``(worker_id, dp_rank)``. Per slot we keep the active requests, the prefill tokens
still pending, and the set of distinct prompt-path *prefix positions* its requests occupy: that set's
size is the slot's ``active_decode_blocks`` (as the reference tracker counts them). Positions are path prefixes, not
hashes: r1 ``[7,7,8]`` occupies three positions although it has two distinct hashes, and ``[4,5]``
rooted at the start is a different position from ``4,5`` reached through ``1,2``.

Why it is fast: every tracker interns path prefixes once, in one trie shared by all its slots whose
nodes are *runs*: maximal chains of positions held by the same requests (a long prompt nobody shares
is one node holding its hashes as a list, not one object per block). Each slot holds a
``node -> refcount`` dict and owns one bit, and every node carries the OR of the bits of the slots
holding it; a slot's decode blocks are the summed lengths of its nodes. A query walks the shared
trie once (one dict probe per run, list-slice comparisons within it); because a slot's node set is
prefix-closed (a request on a node also holds all its ancestors), a slot's longest matched prefix
``D`` is the depth at which its bit leaves the mask. A run splits where a request ends inside it
or leaves it, and merges back with its only child when they hold the same requests again, so the
cost of booking, freeing and querying grows with the number of runs on the path, not with the
prompt's length. Hashes may arrive as u64 or as their signed-i64 JSON form: a path with any
negative value is converted once.

Output blocks (the frontend's ``--router-track-output-blocks``; the reference keeps them only in its frontend) are kept
outside the trie: each request may carry unshared output blocks and an OSL decay weight; only
slots that have such requests pay for the fractional sum.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from kvroute_common.constants import U32_MAX
from kvroute_common.errors import ServiceError

DEFAULT_EXPIRY_SECS = 300.0
MAX_DP_SIZE = 4096  # the reference refuses larger ranges (400), which also bounds slots per worker
EXPIRY_ENV = "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"


_TWO64 = 1 << 64


def expiry_from_env(default: float = DEFAULT_EXPIRY_SECS) -> float:
    """Stale-request expiry: ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`` if set to a positive number."""
    raw = os.environ.get(EXPIRY_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            return default
        if value > 0:
            return value
    return default


class SlotTrackerError(ServiceError):
    """A refused operation; ``status`` is the HTTP status the service answers with."""


class PotentialLoad(NamedTuple):
    """Field names of the plain tuples ``potential_loads`` returns (plain tuples: 8x cheaper to build)."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class LifecycleEvent(NamedTuple):
    """What a lifecycle observer (replica sync) is told after a local change succeeded."""

    kind: str  # "add" | "prefill_complete" | "free"
    model_name: str
    tenant_id: str
    block_size: int
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: Sequence[int]  # u64, only for "add"
    new_isl_tokens: int  # only for "add"


Observer = Callable[[LifecycleEvent], None]


class _Node:
    """A run of consecutive prompt-path prefix positions held by the same requests, shared by every
    slot of a tracker."""

    __slots__ = ("kids", "parent", "hashes", "refs", "mask", "ends")

    def __init__(self, parent: _Node | None, hashes: list[int]) -> None:
        self.kids: dict[int, _Node] = {}  # first hash of the child's run -> child
        self.parent = parent
        self.hashes = hashes  # u64 sequence hashes of the run's positions, root side first
        self.refs = 0  # active requests (all slots) whose path runs through this run
        self.mask = 0  # OR of the bits of the slots holding this run
        self.ends = 0  # active requests whose path ends at this run's last position


class _Slot:
    """One (worker_id, dp_rank): its requests' prefix positions, prefill tokens and counts."""

    __slots__ = ("worker_id", "dp_rank", "bit", "nodes", "blocks", "active_requests", "prefill_tokens", "decayed")

    def __init__(self, worker_id: int, dp_rank: int, bit: int) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.bit = bit  # this slot's bit in _Node.mask (unique among the tracker's live slots)
        self.nodes: dict[_Node, int] = {}  # trie run -> number of this slot's requests through it
        self.blocks = 0  # distinct positions held: the summed run lengths of ``nodes``
        self.active_requests = 0
        self.prefill_tokens = 0
        # requests on this slot with output blocks or an OSL decay (usually empty)
        self.decayed: dict[str, _Request] = {}


class _Request:
    __slots__ = ("request_id", "slot", "leaf", "prefill_tokens", "added_at", "output_blocks", "decay")

    def __init__(self, request_id: str, slot: _Slot, leaf: _Node, prefill_tokens: int, added_at: float) -> None:
        self.request_id = request_id
        self.slot = slot
        self.leaf = leaf  # the run its path ends in (the root for an empty path); the path is its ancestry
        self.prefill_tokens = prefill_tokens  # 0 once prefill completed (or never tracked)
        self.added_at = added_at
        self.output_blocks = 0
        self.decay = 1.0


class SlotTracker:
    """Active requests of one (model_name, tenant_id): every slot of every registered worker."""

    def __init__(
        self,
        model_name: str,
        tenant_id: str,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        observer: Observer | None = None,
    ) -> None:
        self.model_name = model_name
        self.tenant_id = tenant_id
        self.block_size = block_size
        self._clock = clock
        self.observer = observer
        self._workers: dict[int, tuple[int, int]] = {}  # worker_id -> (dp_start, dp_size)
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._by_bit: dict[int, _Slot] = {}
        self._slot_list: list[_Slot] = []  # sorted by (worker_id, dp_rank)
        self._free_bits: list[int] = []  # bits of removed slots, reused first (masks stay small)
        self._next_bit = 1
        self._requests: dict[str, _Request] = {}  # insertion order == admission order
        self._root = _Node(None, [])  # the shared prefix trie (the root is no position)

    # ----- topology (driven by SlotRegistry) -----

    def _add_worker(self, worker_id: int, dp_start: int, dp_size: int) -> None:
        self._workers[worker_id] = (dp_start, dp_size)
        for rank in range(dp_start, dp_start + dp_size):
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = self._next_bit
                self._next_bit <<= 1
            slot = self._slots[(worker_id, rank)] = _Slot(worker_id, rank, bit)
            self._by_bit[bit] = slot
        self._slot_list = sorted(self._slots.values(), key=lambda s: (s.worker_id, s.dp_rank))

    def _remove_worker(self, worker_id: int) -> None:
        dp_start, dp_size = self._workers.pop(worker_id)
        doomed = [r for r in self._requests.values() if r.slot.worker_id == worker_id]
        for req in doomed:
            self._release(req)
        for rank in range(dp_start, dp_start + dp_size):
            bit = self._slots.pop((worker_id, rank)).bit  # its nodes are all released
            del self._by_bit[bit]
            self._free_bits.append(bit)
        self._slot_list = sorted(self._slots.values(), key=lambda s: (s.worker_id, s.dp_rank))

    @property
    def workers(self) -> dict[int, tuple[int, int]]:
        """worker_id -> (dp_start, dp_size); read-only view for listings."""
        return self._workers

    def has_slot(self, worker_id: int, dp_rank: int) -> bool:
        return (worker_id, dp_rank) in self._slots

    def slots(self) -> list[tuple[int, int]]:
        return [(s.worker_id, s.dp_rank) for s in self._slot_list]

    def __len__(self) -> int:
        """Number of active requests."""
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_slot(self, request_id: str) -> tuple[int, int] | None:
        req = self._requests.get(request_id)
        return None if req is None else (req.slot.worker_id, req.slot.dp_rank)

    # ----- lifecycle -----

    def add(
        self,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        notify: bool = True,
    ) -> None:
        """Book a request's prompt path on a slot; 404 unknown slot, 409 duplicate id (booking unchanged)."""
        slot = self._slots.get((worker_id, dp_rank))
        if slot is None:
            raise SlotTrackerError(
                404, f"Worker WorkerWithDpRank {{ worker_id: {worker_id}, dp_rank: {dp_rank} }} not found"
            )
        existing = self._requests.get(request_id)
        if existing is not None:
            s = existing.slot
            raise SlotTrackerError(
                409,
                f"Request {request_id} already exists (assigned to worker WorkerWithDpRank "
                f"{{ worker_id: {s.worker_id}, dp_rank: {s.dp_rank} }})",
            )
        seq = _path(sequence_hashes)
        n = len(seq)
        path: list[_Node] = []
        node = self._root
        pos = 0
        while pos < n:
            child = node.kids.get(seq[pos])
            if child is None:  # a new branch: the rest of the path is one run
                child = node.kids[seq[pos]] = _Node(node, seq[pos:])
                pos = n
            else:
                k = _common_prefix(child.hashes, seq, pos)
                if k < len(child.hashes):  # the path ends or leaves inside the run: split it there
                    child = self._split(child, k)
                pos += k
            path.append(child)
            node = child
        slot_nodes = slot.nodes
        bit = slot.bit
        for nd in path:
            nd.refs += 1
            held = slot_nodes.get(nd, 0)
            if not held:
                nd.mask |= bit
                slot.blocks += len(nd.hashes)
            slot_nodes[nd] = held + 1
        node.ends += 1
        tokens = new_isl_tokens if new_isl_tokens > 0 else 0
        self._requests[request_id] = _Request(request_id, slot, node, tokens, self._clock())
        slot.active_requests += 1
        slot.prefill_tokens += tokens
        if notify and self.observer is not None:
            self.observer(
                LifecycleEvent(
                    "add",
                    self.model_name,
                    self.tenant_id,
                    self.block_size,
                    request_id,
                    worker_id,
                    dp_rank,
                    sequence_hashes,
                    new_isl_tokens,
                )
            )

    def prefill_complete(self, request_id: str, *, notify: bool = True) -> None:
        """Drop the request's pending prefill tokens; repeats are no-ops; 404 unknown request."""
        req = self._requests.get(request_id)
        if req is None:
            raise SlotTrackerError(404, f"Request {request_id} not found")
        if req.prefill_tokens:
            req.slot.prefill_tokens -= req.prefill_tokens
            req.prefill_tokens = 0
        if notify and self.observer is not None:
            self._notify("prefill_complete", req)

    def free(self, request_id: str, *, notify: bool = True) -> bool:
        """Release a request (idempotent: an unknown id is a no-op). True when something was freed."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._release(req)
        if notify and self.observer is not None:
            self._notify("free", req)
        return True

    def _notify(self, kind: str, req: _Request) -> None:
        assert self.observer is not None
        s = req.slot
        self.observer(
            LifecycleEvent(
                kind, self.model_name, self.tenant_id, self.block_size, req.request_id, s.worker_id, s.dp_rank, (), 0
            )
        )

    def _release(self, req: _Request) -> None:
        del self._requests[req.request_id]
        slot = req.slot
        slot.active_requests -= 1
        slot.prefill_tokens -= req.prefill_tokens
        slot.decayed.pop(req.request_id, None)
        slot_nodes = slot.nodes
        clear = ~slot.bit
        root = self._root
        node = req.leaf
        node.ends -= 1
        while node is not root:
            parent = node.parent
            assert parent is not None
            n = slot_nodes[node] - 1
            if n:
                slot_nodes[node] = n
            else:
                del slot_nodes[node]
                node.mask &= clear
                slot.blocks -= len(node.hashes)
            node.refs -= 1
            if not node.refs:  # refs never grow with depth: its descendants on this path went before
                del parent.kids[node.hashes[0]]
            else:
                self._merge_into_child(node)
            node = parent

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node``'s run after its first ``k`` positions; returns the new head run (the tail
        keeps the node, so requests ending in it keep their leaf)."""
        parent = node.parent
        assert parent is not None
        head = _Node(parent, node.hashes[:k])
        node.hashes = node.hashes[k:]
        head.refs, head.mask = node.refs, node.mask
        head.kids[node.hashes[0]] = node
        parent.kids[head.hashes[0]] = head
        node.parent = head
        mask = node.mask
        while mask:  # every slot holding the run holds both halves, as often
            low = mask & -mask
            slot = self._by_bit[low]
            slot.nodes[head] = slot.nodes[node]
            mask ^= low
        return head

    def _merge_into_child(self, node: _Node) -> None:
        """Join ``node`` to its only child when both hold the same requests again (no request ends
        at ``node``, equal counts): runs stay maximal, so paths stay short."""
        if node.ends or len(node.kids) != 1:
            return
        child = next(iter(node.kids.values()))
        if child.refs != node.refs:
            return
        parent = node.parent
        assert parent is not None
        child.hashes = node.hashes + child.hashes
        child.parent = parent
        parent.kids[node.hashes[0]] = child
        mask = node.mask
        while mask:
            low = mask & -mask
            del self._by_bit[low].nodes[node]
            mask ^= low

    def expire_stale(self, now: float, expiry_secs: float) -> list[str]:
        """Free requests admitted ``expiry_secs`` or more before ``now``; returns their ids."""
        cutoff = now - expiry_secs
        expired: list[str] = []
        for req in self._requests.values():  # admission order: stop at the first young one
            if req.added_at > cutoff:
                break
            expired.append(req.request_id)
        for rid in expired:
            self._release(self._requests[rid])
        return expired

    # ----- output blocks (frontend only: the standalone service never adds them) -----

    def add_output_block(
        self, request_id: str, expected_output_tokens: int | None = None, generated_tokens: int = 0
    ) -> bool:
        """Count one more (unshared) output block for the request and refresh its OSL decay.

        With an expected output length ``E`` the request's output blocks and the exclusive suffix of
        its prompt path weigh ``max(0, 1 - generated_tokens / max(E, 1))``. False if unknown request.
        """
        req = self._requests.get(request_id)
        if req is None:
            return False
        req.output_blocks += 1
        if expected_output_tokens is not None:
            req.decay = max(0.0, 1.0 - generated_tokens / max(expected_output_tokens, 1))
        req.slot.decayed[request_id] = req
        return True

    def output_blocks(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return 0 if req is None else req.output_blocks

    # ----- loads -----

    def _decode_blocks(self, slot: _Slot) -> int:
        if not slot.decayed:
            return slot.blocks
        total = float(slot.blocks)
        nodes = slot.nodes
        root = self._root
        for req in slot.decayed.values():
            total += req.decay * req.output_blocks
            if req.decay != 1.0:
                # the structurally exclusive suffix: positions only this request holds on the slot
                exclusive = 0
                node: _Node | None = req.leaf
                while node is not root and node is not None and nodes[node] == 1:
                    exclusive += len(node.hashes)
                    node = node.parent
                total -= (1.0 - req.decay) * exclusive
        return int(math.floor(total + 0.5))

    def active_prefill_tokens(self, worker_id: int, dp_rank: int) -> int:
        return self._slots[(worker_id, dp_rank)].prefill_tokens

    def active_decode_blocks(self, worker_id: int, dp_rank: int) -> int:
        return self._decode_blocks(self._slots[(worker_id, dp_rank)])

    def active_requests(self, worker_id: int, dp_rank: int) -> int:
        return self._slots[(worker_id, dp_rank)].active_requests

    def loads(self) -> list[tuple[int, int, int, int]]:
        """(worker_id, dp_rank, active_prefill_tokens, active_decode_blocks) per slot, sorted."""
        return [(s.worker_id, s.dp_rank, s.prefill_tokens, self._decode_blocks(s)) for s in self._slot_list]

    def potential_loads(
        self, sequence_hashes: Sequence[int], new_isl_tokens: int = 0
    ) -> list[tuple[int, int, int, int, int]]:
        """Loads of every slot if a request with this prompt path and ISL were added there.

        Rows are ``(worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks,
        active_requests)`` (see PotentialLoad), sorted by (worker_id, dp_rank).

        ``potential_prefill_tokens = active + new_isl_tokens`` (not discounted by overlap);
        ``potential_decode_blocks = active + len(q) - D`` with ``D`` the longest prefix of ``q``
        that some active request on the slot holds.
        """
        # One walk; a slot's bit leaves the mask at the depth where its matched prefix ends.
        seq = _path(sequence_hashes)
        n = len(seq)
        depth_of: dict[int, int] = {}  # slot bit -> D, for slots with D > 0
        held = 0
        depth = 0
        kids = self._root.kids
        while depth < n:
            node = kids.get(seq[depth])
            if node is None:
                break
            mask = node.mask
            if mask != held:
                gone = held & ~mask
                while gone:
                    low = gone & -gone
                    depth_of[low] = depth
                    gone ^= low
                held = mask
            k = _common_prefix(node.hashes, seq, depth)
            depth += k
            if k < len(node.hashes):
                break
            kids = node.kids
        while held:
            low = held & -held
            depth_of[low] = depth
            held ^= low
        q = len(sequence_hashes)
        out: list[tuple[int, int, int, int, int]] = []
        append = out.append
        get_depth = depth_of.get
        for slot in self._slot_list:
            d = get_depth(slot.bit, 0)
            decode = slot.blocks if not slot.decayed else self._decode_blocks(slot)
            # (worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks, active_requests)
            append(
                (
                    slot.worker_id,
                    slot.dp_rank,
                    slot.prefill_tokens + new_isl_tokens,
                    decode + q - d,
                    slot.active_requests,
                )
            )
        return out


def _path(hashes: Sequence[int]) -> list[int]:
    """The path as a list; its values are u64 (the service maps the API's signed i64 at its boundary)."""
    return hashes if isinstance(hashes, list) else list(hashes)


def _common_prefix(run: list[int], seq: list[int], pos: int) -> int:
    """How many leading positions of ``run`` equal ``seq[pos:]`` (>= 1: the first one keyed the run).
    List-slice comparisons (a binary search when they differ), never one Python step per position."""
    m = min(len(run), len(seq) - pos)
    if seq[pos : pos + m] == run[:m]:
        return m
    lo, hi = 1, m - 1  # equal up to lo; unequal at length m
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seq[pos : pos + mid] == run[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SlotRegistry:
    """All trackers, keyed by (model_name, tenant_id); a tracker lives while it has workers."""

    def __init__(
        self,
        expiry_secs: float | None = DEFAULT_EXPIRY_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.expiry_secs = DEFAULT_EXPIRY_SECS if expiry_secs is None else expiry_secs
        self.clock = clock
        self._trackers: dict[tuple[str, str], SlotTracker] = {}
        self._observer: Observer | None = None

    @property
    def observer(self) -> Observer | None:
        return self._observer

    @observer.setter
    def observer(self, fn: Observer | None) -> None:
        """Told about every successful local add/prefill_complete/free (replica sync publishes them)."""
        self._observer = fn
        for tracker in self._trackers.values():
            tracker.observer = fn

    def register(
        self, worker_id: int, model_name: str, tenant_id: str, block_size: int, dp_start: int, dp_size: int
    ) -> None:
        if block_size <= 0:
            raise SlotTrackerError(400, "block_size must be greater than 0")
        if dp_size <= 0:
            raise SlotTrackerError(400, "dp_size must be greater than 0")
        if dp_size > MAX_DP_SIZE:
            raise SlotTrackerError(400, f"dp_size {dp_size} exceeds the maximum {MAX_DP_SIZE}")
        if dp_start + dp_size > U32_MAX:
            # the reference refuses a range whose exclusive end does not fit in u32 (start=2^32-1 size=1 too)
            raise SlotTrackerError(400, f"dp range overflows u32: start={dp_start} size={dp_size}")
        key = (model_name, tenant_id)
        tracker = self._trackers.get(key)
        if tracker is not None:
            if tracker.block_size != block_size:
                raise SlotTrackerError(
                    409,
                    f"block_size mismatch for model={model_name} tenant_id={tenant_id}: "
                    f"existing={tracker.block_size}, requested={block_size}",
                )
            if worker_id in tracker.workers:
                raise SlotTrackerError(
                    409, f"worker {worker_id} already registered for model={model_name} tenant_id={tenant_id}"
                )
        else:
            tracker = SlotTracker(model_name, tenant_id, block_size, clock=self.clock, observer=self._observer)
            self._trackers[key] = tracker
        tracker._add_worker(worker_id, dp_start, dp_size)

    def unregister(self, worker_id: int, model_name: str, tenant_id: str) -> None:
        """Drop a worker's ranks and requests; the tracker goes with its last worker."""
        key = (model_name, tenant_id)
        tracker = self._trackers.get(key)
        if tracker is None or worker_id not in tracker.workers:
            raise SlotTrackerError(404, f"worker {worker_id} not found for model={model_name} tenant_id={tenant_id}")
        tracker._remove_worker(worker_id)
        if not tracker.workers:
            del self._trackers[key]

    def get(self, model_name: str, tenant_id: str = "default") -> SlotTracker | None:
        return self._trackers.get((model_name, tenant_id))

    def tracker(self, model_name: str, tenant_id: str = "default") -> SlotTracker:
        """The tracker or 404 ``no slot tracker for ...``."""
        tracker = self._trackers.get((model_name, tenant_id))
        if tracker is None:
            raise SlotTrackerError(404, f"no slot tracker for model={model_name} tenant_id={tenant_id}")
        return tracker

    def trackers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[SlotTracker]:
        """Trackers matching the optional filters, sorted by (model_name, tenant_id)."""
        return [
            t
            for key, t in sorted(self._trackers.items(), key=lambda kv: kv[0])
            if (model_name is None or key[0] == model_name) and (tenant_id is None or key[1] == tenant_id)
        ]

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for t in self.trackers(model_name, tenant_id):
            for worker_id in sorted(t.workers):
                dp_start, dp_size = t.workers[worker_id]
                out.append(
                    {
                        "worker_id": worker_id,
                        "model_name": t.model_name,
                        "tenant_id": t.tenant_id,
                        "block_size": t.block_size,
                        "dp_start": dp_start,
                        "dp_size": dp_size,
                    }
                )
        return out

    def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for t in self.trackers(model_name, tenant_id):
            for worker_id, dp_rank, prefill, decode in t.loads():
                out.append(
                    {
                        "model_name": t.model_name,
                        "tenant_id": t.tenant_id,
                        "worker_id": worker_id,
                        "dp_rank": dp_rank,
                        "active_prefill_tokens": prefill,
                        "active_decode_blocks": decode,
                    }
                )
        return out

    def expire_stale(self, now: float | None = None) -> int:
        """Free every request older than ``expiry_secs``; returns how many were freed."""
        if now is None:
            now = self.clock()
        return sum(len(t.expire_stale(now, self.expiry_secs)) for t in list(self._trackers.values()))

    def __iter__(self) -> Iterable[SlotTracker]:
        return iter(list(self._trackers.values()))
