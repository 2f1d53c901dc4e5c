"""A paged KV cache with prefix caching, modelled on vLLM's block pool (one per DP rank).

* ``num_blocks`` physical blocks of ``block_size`` tokens, block 0 of which is vLLM's null block
  (a placeholder never handed out): ``--num-gpu-blocks-override N`` leaves N - 1 usable blocks
  in vLLM, and so here. A block is *active* while running sequences reference it (``ref > 0``)
  and *free* otherwise.
* Full blocks are content-addressed by the chained sequence hash of their tokens
  (``kvroute_common.hashing``), so a new sequence reuses the longest cached prefix. A freed block keeps
  its content until it is reallocated: free blocks form one eviction queue (front = evicted
  first). A sequence's blocks are freed tail first, so within a sequence the leaves go before
  their prefix and across sequences the least recently used goes first (vLLM's order).
* Like vLLM, cached content is not de-duplicated: a block computed while an identical one is
  cached (the last block of a fully cached prompt, which is always recomputed; identical prompts
  in flight) is cached too, under the same hash. Lookups find the oldest copy; every copy is
  evicted, and reported, on its own.
* Every change to what is cached is recorded as a KV event, with the fields vLLM fills for a
  plain full-attention model (``group_idx`` 0, ``kv_cache_spec_kind``, one ``extra_keys`` entry per
  block): ``BlockStored`` when full blocks are cached (one event per sequence and step),
  ``BlockRemoved`` when a cached block is reallocated (one event per block), ``AllBlocksCleared``
  on reset. The engine publishes them once per scheduler step.

External block hashes (what the events carry) are ``xxh3_64(le64(sequence_hash), seed)`` with a
per-process seed, so they look like vLLM's: opaque u64 values unrelated to the router's hashes,
different in every engine process unless ``--seed`` fixes them.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from mocker.mm_keys import ImageKeys

MEDIUM_GPU = "GPU"
GROUP_IDX = 0  # the single KV cache group of a plain decoder
SPEC_KIND = "full_attention"  # vLLM's kv_cache_spec_kind of that group
_pack_u64 = struct.Struct("<Q").pack
_xxh3 = xxhash.xxh3_64_intdigest


class Block:
    """One physical KV block."""

    __slots__ = ("id", "ref", "seq_hash", "local_hash", "ext_hash", "parent_ext")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref = 0
        self.seq_hash: int | None = None  # set while the block is cached (content-addressed)
        self.local_hash: int | None = None
        self.ext_hash: int | None = None
        self.parent_ext: int | None = None


class KvCache:
    """Block pool + prefix cache of one DP rank. Synchronous; no I/O."""

    def __init__(self, num_blocks: int, block_size: int, ext_seed: int, emit_events: bool = True) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError("num_blocks must be >= 2 (one is the null block) and block_size positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ext_seed = ext_seed
        self.emit_events = emit_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block 0 is the null block: never free, never cached (vLLM's BlockPool.null_block)
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks[1:])
        self.cached: dict[int, Block] = {}  # sequence hash -> oldest block holding that content
        self.copies: dict[int, list[Block]] = {}  # sequence hash -> younger copies, oldest first
        self.events: list[KVCacheEvent] = []

    # -- queries ---------------------------------------------------------------------------

    def ext_hash(self, seq_hash: int) -> int:
        """The engine's external hash of a block (what KV events carry)."""
        return _xxh3(_pack_u64(seq_hash), self.ext_seed)

    @property
    def num_usable(self) -> int:
        """Blocks sequences can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by running sequences (vLLM's kv_cache_usage_perc)."""
        return self.num_used / self.num_usable

    def longest_prefix(self, seq_hashes: list[int], max_blocks: int) -> list[Block]:
        """Cached blocks matching the first blocks of ``seq_hashes`` (at most ``max_blocks``)."""
        out: list[Block] = []
        get = self.cached.get
        for h in seq_hashes[:max_blocks]:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_in(self, blocks: list[Block]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them uses free capacity)."""
        return sum(1 for b in blocks if b.ref == 0)

    # -- mutations -------------------------------------------------------------------------

    def touch(self, blocks: list[Block]) -> None:
        """Reference cached blocks a sequence reuses (reactivating free ones)."""
        free = self.free
        for b in blocks:
            if b.ref == 0:
                del free[b.id]
            b.ref += 1

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` blocks from the front of the free queue (evicting their cached content), or None."""
        if n <= 0:
            return []
        if n > len(self.free):
            return None
        out: list[Block] = []
        popitem = self.free.popitem
        for _ in range(n):
            _, b = popitem(last=False)
            if b.seq_hash is not None:
                self._evict(b)
            b.ref = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        """Forget a cached block's content (a younger copy, if any, serves lookups from now on)."""
        h = b.seq_hash
        assert h is not None and b.ext_hash is not None  # a cached block has all its hashes
        copies = self.copies.get(h)
        if self.cached.get(h) is b:
            if copies:
                self.cached[h] = copies.pop(0)
            else:
                del self.cached[h]
        elif copies is not None:
            copies.remove(b)
        if copies is not None and not copies:
            del self.copies[h]
        if self.emit_events:  # one event per block, as vLLM's BlockPool._emit_block_removed_events
            self.events.append(BlockRemoved(block_hashes=[b.ext_hash], medium=MEDIUM_GPU, group_idx=GROUP_IDX))
        b.seq_hash = b.local_hash = b.ext_hash = b.parent_ext = None

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each of a sequence's blocks, tail first (leaves evicted first).

        Blocks without cached content go to the front of the queue, the sequence's tail block
        first (vLLM's free_blocks: prepended in the order freed): they hold nothing worth keeping,
        so they are reused before any cached block is evicted.
        """
        free = self.free
        uncached: list[Block] = []
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                free[b.id] = b
                if b.seq_hash is None:
                    uncached.append(b)
        for b in reversed(uncached):
            free.move_to_end(b.id, last=False)

    def cache_blocks(
        self,
        blocks: list[Block],
        start: int,
        seq_hashes: list[int],
        local_hashes: list[int],
        tokens: list[int],
        lora_name: str | None = None,
        lora_id: int | None = None,
        image_keys: Sequence[ImageKeys | None] = (),
    ) -> None:
        """Mark ``blocks[start:len(seq_hashes)]`` (now full and computed) as cached content.

        As vLLM's cache_full_blocks: a block whose content another block already caches is cached
        as one more copy (block tables are append-only, nothing is de-duplicated), and all the
        blocks become one BlockStored event whose parent is block ``start - 1``.
        """
        bs = self.block_size
        end = len(seq_hashes)
        if start >= end:
            return
        hashes: list[int] = []
        for i in range(start, end):
            b = blocks[i]
            assert b.seq_hash is None, "only newly allocated blocks become full"
            h = seq_hashes[i]
            ext = self.ext_hash(h)
            b.seq_hash, b.local_hash, b.ext_hash = h, local_hashes[i], ext
            b.parent_ext = self.ext_hash(seq_hashes[i - 1]) if i > 0 else None
            if h in self.cached:
                self.copies.setdefault(h, []).append(b)
            else:
                self.cached[h] = b
            hashes.append(ext)
        if self.emit_events:
            self.events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=blocks[start].parent_ext,
                    token_ids=tokens[start * bs : end * bs],
                    block_size=bs,
                    lora_id=lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                    extra_keys=list(image_keys[start:end]) if image_keys else [None] * len(hashes),
                    group_idx=GROUP_IDX,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )

    def reset(self) -> bool:
        """Forget all cached content (vLLM's reset_prefix_cache); False while blocks are in use."""
        if self.num_used:
            return False
        for b in self.blocks:
            b.seq_hash = b.local_hash = b.ext_hash = b.parent_ext = None
        self.cached.clear()
        self.copies.clear()
        if self.emit_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[dict]:
        """The cached blocks, copies included (for debugging and tests): external, parent and local hashes."""
        return [
            {
                "block_hash": b.ext_hash,
                "parent_block_hash": b.parent_ext,
                "tokens_hash": b.local_hash,
                "sequence_hash": b.seq_hash,
                "active": b.ref > 0,
            }
            for h, first in self.cached.items()
            for b in (first, *self.copies.get(h, ()))
        ]
