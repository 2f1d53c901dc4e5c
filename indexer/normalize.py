"""Engine KV events -> index operations (the reference indexer's normalisation: storage medium to tier, local vs
external hashes, groups, salt).

The engine's own block hashes are kept only as *external* hashes (parent links, removals); the
*local* hashes used for matching are recomputed here from the event's token ids with
``kvroute_common.hashing`` so they always agree with what the frontend computes for a prompt.

One ``EventApplier`` per listener: the learned kv-cache groups, the cache-namespace memory and the
block-size warning budget are per (instance, dp_rank) stream, as in the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import xxhash

from indexer.core import DEVICE, KvIndex, tier_for_medium
from indexer.wire import Cleared, DecodedBatch, Removed, Stored
from kvroute_common.hashing import hash_seed, local_block_hashes, mm_object_hash, pack_tokens

log = logging.getLogger("indexer.normalize")

MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SALT_PREFIX = "dynamo-cache-salt:"
_AMBIGUOUS = object()


def _salt_from_extra_keys(
    extra_keys: list[Any] | None, lora_name: str | None, starts_request: bool = True
) -> str | None:
    """The cache salt in the first block's extra keys, read by position as vLLM lays a block's keys out:
    ``[LoRA name if the request has one] + [(image identifier, offset) pairs] + [the request's cache salt, in the
    request's first block only] + [prompt-embedding digests (bytes)]``. So in an event that starts a request
    (no parent), the first bare string after the LoRA name is the salt, whatever it looks like (a salt that is a
    64-hex digest is not an image: images are pairs). A ``dynamo-cache-salt:<ns>`` string (Dynamo's workers'
    form) is that namespace in any event."""
    if not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    items = list(first)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    for item in items:
        if isinstance(item, str) and item.startswith(SALT_PREFIX) and len(item) > len(SALT_PREFIX):
            return item[len(SALT_PREFIX) :]
    if not starts_request:
        return None
    return next((item for item in items if isinstance(item, str) and item), None)


def _mm_from_extra_keys(extra_keys: list[Any] | None) -> list[list[int] | None] | None:
    """Per block, the multimodal objects vLLM keys it with: its ``(identifier, offset)`` pairs (vLLM >= 0.19).
    Bare strings (a LoRA name, a cache salt) and bytes (prompt embeddings) are not images."""
    if not extra_keys:
        return None
    out: list[list[int] | None] = []
    found = False
    for entry in extra_keys:
        keys: list[int] | None = None
        if isinstance(entry, (list, tuple)):
            for item in entry:
                if (
                    isinstance(item, (list, tuple))
                    and len(item) == 2
                    and isinstance(item[0], str)
                    and isinstance(item[1], int)
                ):
                    keys = keys or []
                    keys.append(mm_object_hash(item[0]))
        found = found or keys is not None
        out.append(keys)
    return out if found else None


_PLAIN_SEED = hash_seed()
_xxh3 = xxhash.xxh3_64_intdigest


def _plain_hashes(tokens: list[int], block_size: int) -> list[int]:
    """``local_block_hashes(tokens, block_size)`` (no LoRA, salt, multimodal or Eagle term) without
    its per-call option handling: most events are plain and short, so that handling was a fifth of
    their hashing time."""
    step = block_size * 4
    n = len(tokens) // block_size
    if n <= 0:
        return []
    view = memoryview(pack_tokens(tokens))
    seed = _PLAIN_SEED
    return [_xxh3(view[i : i + step], seed) for i in range(0, n * step, step)]


def _single_block_run_end(events: list[Stored | Removed | Cleared], start: int) -> int:
    """The end of the run of removals from ``start`` that each name one block, with the same medium,
    group and locality as the first."""
    first = events[start]
    if len(first.block_hashes) != 1:  # type: ignore[union-attr]
        return start + 1
    medium, group, locality = first.medium, first.group_idx, first.locality  # type: ignore[union-attr]
    end, n = start + 1, len(events)
    while end < n:
        ev = events[end]
        if (
            type(ev) is not Removed
            or len(ev.block_hashes) != 1
            or ev.medium != medium
            or ev.group_idx != group
            or ev.locality != locality
        ):
            break
        end += 1
    return end


class EventApplier:
    """Applies decoded batches of one listener to a KvIndex, filtering like the reference."""

    def __init__(
        self, index: KvIndex, instance_id: int, dp_rank: int, counters: dict[tuple[str, str], int] | None = None
    ) -> None:
        self.index = index
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        self.counters: dict[tuple[str, str], int] = counters if counters is not None else {}
        self._groups: dict[tuple[int, int], str] = {}
        self._namespaces: dict[tuple[int, int], Any] = {}  # (dp_rank, ext) -> namespace | _AMBIGUOUS
        self._block_size_warnings = 0
        self.blocks_applied = 0
        # blocks dropped because the engine's block size is not the partition's (hash parity evidence)
        self.blocks_block_size_mismatch = 0
        self.last_foreign_block_size: int | None = None

    def _count(self, event_type: str, status: str) -> None:
        key = (event_type, status)
        self.counters[key] = self.counters.get(key, 0) + 1

    def apply_batch(self, batch: DecodedBatch) -> None:
        dp = self.dp_rank if batch.dp_rank is None else batch.dp_rank & 0xFFFFFFFF
        events = batch.events
        i, n = 0, len(events)
        while i < n:
            ev = events[i]
            t = type(ev)
            if t is Stored:
                self._stored(ev, dp)  # type: ignore[arg-type]
            elif t is Removed:
                end = _single_block_run_end(events, i)
                if end - i > 1:
                    self._removed_run(events[i:end], dp)  # type: ignore[arg-type]
                    i = end
                    continue
                self._removed(ev, dp)  # type: ignore[arg-type]
            elif t is Cleared:
                self.index.apply_cleared(self.instance_id, dp)
                self._forget_rank(dp)
                self._count("cleared", "ok")
            i += 1

    def reset_rank(self) -> None:
        """The engine behind this listener restarted: its rank's blocks are gone, in every tier."""
        self.index.apply_cleared(self.instance_id, self.dp_rank)
        self._forget_rank(self.dp_rank)

    # -- filters

    def _group_kept(self, dp: int, group_idx: int | None, kind: str | None, learn: bool) -> bool:
        if kind is not None:
            if learn and group_idx is not None:
                self._groups[(dp, group_idx)] = kind
            return kind in MAIN_ATTENTION_KINDS
        if group_idx is None:
            return True
        learned = self._groups.get((dp, group_idx))
        if learned is None:
            return group_idx == 0
        return learned in MAIN_ATTENTION_KINDS

    # -- events

    def _stored(self, ev: Stored, dp: int) -> None:
        if ev.medium is None and ev.locality is None and ev.group_idx is None and ev.kv_cache_spec_kind is None:
            tier = DEVICE  # vLLM's usual event: the medium, locality and group filters below all pass it
        else:
            maybe_tier = tier_for_medium(ev.medium)
            if maybe_tier is None or (ev.locality is not None and ev.locality != "LOCAL"):
                self._count("stored", "filtered")
                return
            if not self._group_kept(dp, ev.group_idx, ev.kv_cache_spec_kind, learn=True):
                self._count("stored", "filtered")
                return
            tier = maybe_tier
        hashes = ev.block_hashes
        parent = ev.parent_block_hash
        if len(set(hashes)) != len(hashes) or (parent is not None and parent in hashes):
            self._count("stored", "duplicate")
            return
        bs = self.index.block_size
        if ev.block_size != bs:
            if self._block_size_warnings < 3:
                self._block_size_warnings += 1
                log.warning(
                    "Block not published: instance %s dp_rank %s sent block_size %s, registered %s",
                    self.instance_id,
                    dp,
                    ev.block_size,
                    bs,
                )
            self._count("stored", "block_size_mismatch")
            self.blocks_block_size_mismatch += len(ev.block_hashes)
            self.last_foreign_block_size = ev.block_size
            return
        namespace = ev.cache_salt or _salt_from_extra_keys(ev.extra_keys, ev.lora_name, parent is None)
        if namespace is None and parent is not None and self._namespaces:
            inherited = self._namespaces.get((dp, parent))
            if inherited is _AMBIGUOUS:
                self._count("stored", "filtered")
                return
            namespace = inherited
        n_blocks = len(hashes)
        tokens = ev.token_ids
        need = n_blocks * bs + (1 if ev.eagle else 0)
        if len(tokens) > need:
            tokens = tokens[:need]
        try:
            mm = ev.mm_hashes if ev.mm_hashes is not None else _mm_from_extra_keys(ev.extra_keys)
            if namespace is None and ev.lora_name is None and mm is None and not ev.eagle and bs > 0:
                local = _plain_hashes(tokens, bs)
            else:
                local = local_block_hashes(tokens, bs, ev.lora_name, namespace, mm, ev.eagle)
        except ValueError:
            self._count("stored", "invalid")
            return
        n = len(local)  # tokens running out drop the remaining blocks
        if not n:
            self._count("stored", "ok")
            return
        exts = hashes if n == n_blocks else hashes[:n]
        if self.index.apply_stored_hashes(self.instance_id, dp, parent, exts, local, tier):
            self.blocks_applied += n
            self._count("stored", "ok")
            if namespace is not None:
                self._remember(dp, exts, namespace)
        else:
            self._count("stored", "parent_not_found")

    def _removed(self, ev: Removed, dp: int) -> None:
        tier = tier_for_medium(ev.medium)
        if tier is None or (ev.locality is not None and ev.locality != "LOCAL"):
            self._count("removed", "filtered")
            return
        if not self._group_kept(dp, ev.group_idx, None, learn=False):
            self._count("removed", "filtered")
            return
        found = self.index.apply_removed(self.instance_id, dp, ev.block_hashes, tier)
        if self._namespaces:
            for ext in ev.block_hashes:
                self._namespaces.pop((dp, ext), None)
        self._count("removed", "ok" if found == len(ev.block_hashes) else "block_not_found")

    def _removed_run(self, run: list[Removed], dp: int) -> None:
        """Consecutive single-block removals with the same medium, group and locality (vLLM publishes one
        event per evicted block): applied and counted as ``_removed`` would one by one, in one index call."""
        first = run[0]
        tier = tier_for_medium(first.medium)
        if tier != DEVICE or self._namespaces:  # lower tiers and remembered namespaces: the general path
            for ev in run:
                self._removed(ev, dp)
            return
        if (first.locality is not None and first.locality != "LOCAL") or not self._group_kept(
            dp, first.group_idx, None, learn=False
        ):
            self._count_n("removed", "filtered", len(run))
            return
        found = self.index.apply_removed_each(self.instance_id, dp, [ev.block_hashes[0] for ev in run])
        self._count_n("removed", "ok", found)
        self._count_n("removed", "block_not_found", len(run) - found)

    def _count_n(self, event_type: str, status: str, n: int) -> None:
        if n:
            key = (event_type, status)
            self.counters[key] = self.counters.get(key, 0) + n

    # -- namespace memory

    def _remember(self, dp: int, hashes: Iterable[int], namespace: str) -> None:
        ns = self._namespaces
        for ext in hashes:
            key = (dp, ext)
            seen = ns.get(key)
            ns[key] = namespace if seen is None or seen == namespace else _AMBIGUOUS

    def _forget_rank(self, dp: int) -> None:
        if self._namespaces:
            for key in [k for k in self._namespaces if k[0] == dp]:
                del self._namespaces[key]
