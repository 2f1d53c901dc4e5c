"""The mocker's engine-side image keys, written from vLLM's block hashing, not shared with the router.

vLLM keys each full block of a request with extra keys: for every multimodal item whose placeholder run
overlaps the block, the pair (item identifier, item offset minus the block's first position). Items are
visited in prompt order with a cursor: an item that ends inside a block lets the next item start in that
same block; one that runs past the block's end stops the walk until the next block. The router computes
its own lookups' keys (``kvroute_common.multimodal``); the mocker does not import that code, so the router
tested against mockers is checked against a second implementation of the rule, and against vLLM itself in
``tests/test_vllm_multimodal.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvroute_common.hashing import mm_object_hash

ImageKeys = tuple[tuple[str, int], ...]


class ImageRun(Protocol):
    """Where an image's placeholder tokens lie in the prompt, and its identity."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def identifier(self) -> str: ...


def block_image_keys(images: Sequence[ImageRun], block_size: int, first: int, end: int) -> list[ImageKeys | None]:
    """For blocks ``first`` .. ``end - 1``: the (identifier, offset in block) of each image they hold, None for a
    block that holds none. ``images`` are in prompt order."""
    out: list[ImageKeys | None] = []
    cursor = 0
    for block in range(first, end):
        lo, hi = block * block_size, (block + 1) * block_size
        keys: list[tuple[str, int]] = []
        while cursor < len(images):
            image = images[cursor]
            if image.offset >= hi:
                break  # starts in a later block
            image_end = image.offset + image.length
            if image_end <= lo:
                cursor += 1  # ended before this block
                continue
            keys.append((image.identifier, image.offset - lo))
            if image_end > hi:
                break  # runs on into the next block
            cursor += 1
        out.append(tuple(keys) or None)
    return out


def image_hashes(keys: Sequence[ImageKeys | None]) -> list[list[int] | None]:
    """The per-block image terms of the block hashes (the hashing contract's u64 of each identifier)."""
    return [[mm_object_hash(ident) for ident, _ in ks] if ks else None for ks in keys]
