"""A paged KV cache with prefix caching, modelled on vLLM's block pool (one per DP rank).

* ``num_blocks`` physical blocks of ``block_size`` tokens. A block is *active* while running
  sequences reference it (``ref > 0``) and *free* otherwise.
* Full blocks are content-addressed by the chained sequence hash of their tokens
  (``kvroute_common.hashing``), so a new sequence reuses the longest cached prefix. A freed block keeps
  its content until it is reallocated: free blocks form one eviction queue (front = evicted
  first). A sequence's blocks are freed tail first, so within a sequence the leaves go before
  their prefix and across sequences the least recently used goes first (vLLM's order).
* Every change to what is cached is recorded as a KV event (``BlockStored`` when a full block is
  first cached, ``BlockRemoved`` when a cached block is reallocated, ``AllBlocksCleared`` on
  reset) for the engine to publish once per scheduler step.

External block hashes (what the events carry) are ``xxh3_64(le64(sequence_hash), seed)`` with a
per-process seed, so they look like vLLM's: opaque u64 values unrelated to the router's hashes,
different in every engine process unless ``--seed`` fixes them.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import xxhash

from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

MEDIUM_GPU = "GPU"
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
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ext_seed = ext_seed
        self.emit_events = emit_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # sequence hash -> block holding that content
        self.events: list[KVCacheEvent] = []

    # -- queries ---------------------------------------------------------------------------

    def ext_hash(self, seq_hash: int) -> int:
        """The engine's external hash of a block (what KV events carry)."""
        return _xxh3(_pack_u64(seq_hash), self.ext_seed)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vLLM's kv_cache_usage_perc)."""
        return self.num_used / self.num_blocks

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
        removed: list[int] = []
        popitem = self.free.popitem
        for _ in range(n):
            _, b = popitem(last=False)
            if b.seq_hash is not None:
                if self.cached.get(b.seq_hash) is b:
                    del self.cached[b.seq_hash]
                    assert b.ext_hash is not None  # a cached block has all its hashes
                    removed.append(b.ext_hash)
                b.seq_hash = b.local_hash = b.ext_hash = b.parent_ext = None
            b.ref = 1
            out.append(b)
        if removed and self.emit_events:
            self.events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_GPU))
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each of a sequence's blocks, tail first (leaves evicted first).

        Blocks without cached content go to the front of the queue: they hold nothing worth
        keeping, so they are reused before any cached block is evicted.
        """
        free = self.free
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                free[b.id] = b
                if b.seq_hash is None:
                    free.move_to_end(b.id, last=False)

    def cache_blocks(
        self,
        blocks: list[Block],
        start: int,
        seq_hashes: list[int],
        local_hashes: list[int],
        tokens: list[int],
    ) -> None:
        """Mark ``blocks[start:len(seq_hashes)]`` (now full and computed) as cached content.

        If another block already caches the same content (two identical prompts computed at the
        same time), the sequence switches to that block and frees its own copy, so every full
        block a running sequence holds is cached and a parent is never evicted before its child.
        Consecutive newly cached blocks become one BlockStored event.
        """
        bs = self.block_size
        pending_hashes: list[int] = []
        pending_tokens: list[int] = []
        pending_parent: int | None = None
        for i in range(start, len(seq_hashes)):
            b = blocks[i]
            h = seq_hashes[i]
            if b.seq_hash is not None:  # reused from the prefix cache
                continue
            other = self.cached.get(h)
            if other is not None:
                self.touch([other])
                self.release([b])
                blocks[i] = other
                if pending_hashes:
                    self._stored(pending_hashes, pending_parent, pending_tokens)
                    pending_hashes, pending_tokens = [], []
                continue
            parent_ext = self.ext_hash(seq_hashes[i - 1]) if i > 0 else None
            ext = self.ext_hash(h)
            b.seq_hash, b.local_hash, b.ext_hash, b.parent_ext = h, local_hashes[i], ext, parent_ext
            self.cached[h] = b
            if not pending_hashes:
                pending_parent = parent_ext
            pending_hashes.append(ext)
            pending_tokens.extend(tokens[i * bs : (i + 1) * bs])
        if pending_hashes:
            self._stored(pending_hashes, pending_parent, pending_tokens)

    def _stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        if self.emit_events:
            self.events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                )
            )

    def reset(self) -> bool:
        """Forget all cached content (vLLM's reset_prefix_cache); False while blocks are in use."""
        if self.num_used:
            return False
        for b in self.blocks:
            b.seq_hash = b.local_hash = b.ext_hash = b.parent_ext = None
        self.cached.clear()
        if self.emit_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[dict]:
        """The cached blocks (for debugging and tests): external, parent and local hashes."""
        return [
            {
                "block_hash": b.ext_hash,
                "parent_block_hash": b.parent_ext,
                "tokens_hash": b.local_hash,
                "sequence_hash": b.seq_hash,
                "active": b.ref > 0,
            }
            for b in self.cached.values()
        ]
