"""Maps keyed by block hashes, split over dicts by the hash's low bits, so no single call rebuilds all of one.

CPython grows a dict, and compacts it after enough deletions, in one call that re-inserts every entry: about
50 ns an entry on a 2-vCPU guest (5 ms at 90 k entries, 50 ms at 700 k; twice that when the table is
compacted after churn), all of it on the calling thread. A worker's cached blocks in the index, or a rank's
live blocks in latency mode's footprint, reach those sizes, and the calling thread is the event loop: every
request in flight waits out the rebuild. Split over ``SHARDS`` dicts, a rebuild moves 1/``SHARDS`` of the
entries; a lookup costs one list index more.

Hot loops index ``parts[h & MASK]`` themselves; the methods here are for the rest. Block hashes are uniform
64-bit values (xxhash, or an engine's own hash), so the low bits spread them evenly; any int works (Python's
``&`` on a negative int gives its two's-complement low bits).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")

SHARD_BITS = 6
SHARDS = 1 << SHARD_BITS
MASK = SHARDS - 1


class HashShards(Generic[V]):
    """A map from int hashes to ``V`` over ``SHARDS`` dicts (``parts``), shard ``h & MASK`` holding ``h``."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[dict[int, V]] = [{} for _ in range(SHARDS)]

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __contains__(self, h: int) -> bool:
        return h in self.parts[h & MASK]

    def __getitem__(self, h: int) -> V:
        return self.parts[h & MASK][h]

    def __setitem__(self, h: int, value: V) -> None:
        self.parts[h & MASK][h] = value

    def __delitem__(self, h: int) -> None:
        del self.parts[h & MASK][h]

    def get(self, h: int) -> V | None:
        return self.parts[h & MASK].get(h)

    def pop(self, h: int) -> V | None:
        """Remove ``h``; its value, or None when absent."""
        return self.parts[h & MASK].pop(h, None)

    def set_all(self, hashes: Iterable[int], value: V) -> None:
        """``self[h] = value`` for every hash."""
        parts = self.parts
        for h in hashes:
            parts[h & MASK][h] = value

    def values(self) -> Iterator[V]:
        for part in self.parts:
            yield from part.values()

    def keys(self) -> Iterator[int]:
        for part in self.parts:
            yield from part
