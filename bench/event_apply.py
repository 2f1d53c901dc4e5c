"""How long one engine step's KV events hold the event loop: a batch applied to the index, decode included.

    python -m bench event_apply                          # this checkout
    python -m bench event_apply --before /tmp/before     # and another checkout, alternating, in one run

The batches are shaped as a vLLM engine (and the mocker) publishes them for long prompts: chunked
prefill of 8,192 tokens a step, so a step stores 512 blocks of 16 tokens (with their token ids), and
once the cache is full the same step evicts 512 older blocks, one ``BlockRemoved`` event per block,
the oldest prompt's tail first. Twelve prompts of 8,192 blocks (128 k tokens) go through a cache
that holds three. Each batch is decoded and applied (``decode_batch`` + ``EventApplier.apply_batch``,
what the KV-event listener does on the loop per message) and timed alone; reported per kind of batch
(storing only, storing and evicting): median, p90 and worst milliseconds, over ``--rounds`` rounds
per checkout, each in a fresh process, checkouts alternating.

The same again through a full cache of 131,072 blocks (2 M tokens, an 8B model's cache on one H200): 40
prompts through a cache that holds 16, with random 64-bit block hashes as engines send them. There the
worker's map of cached blocks is large enough that rebuilding it in one call shows in the worst batch.

After each cache's batches, the worker is removed (``KvIndex.remove_worker``: an engine that died or left,
what an engine restart's ``reset_rank`` does too), timed alone: one sample per cache and round.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

BLOCK_SIZE = 16
STEP_BLOCKS = 512  # 8,192 tokens a step
PROMPT_BLOCKS = 8192  # 128 k tokens
# (label suffix, prompts, prompts the cache holds before it evicts the oldest, random 64-bit block hashes)
CACHES = [("", 12, 3, False), (", 131,072-block cache", 40, 16, True)]


def _batches(prompts: int, held_prompts: int, random_hashes: bool) -> Iterator[tuple[bool, bytes]]:
    """(evicts, payload) per engine step."""
    from indexer.wire import BlockRemoved, BlockStored, encode_batch

    rng = random.Random(1)
    vocabulary = range(30000)
    held: list[list[int]] = []
    next_hash = 1
    for _ in range(prompts):
        if random_hashes:
            hashes = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        else:
            hashes = list(range(next_hash, next_hash + PROMPT_BLOCKS))
            next_hash += PROMPT_BLOCKS
        tokens = rng.choices(vocabulary, k=PROMPT_BLOCKS * BLOCK_SIZE)
        held.append(hashes)
        evict = list(reversed(held.pop(0))) if len(held) > held_prompts else []
        for s in range(PROMPT_BLOCKS // STEP_BLOCKS):
            lo, hi = s * STEP_BLOCKS, (s + 1) * STEP_BLOCKS
            events: list[Any] = [BlockRemoved([h], "GPU", group_idx=0) for h in evict[lo:hi]]
            events.append(
                BlockStored(
                    hashes[lo:hi],
                    None if s == 0 else hashes[lo - 1],
                    tokens[lo * BLOCK_SIZE : hi * BLOCK_SIZE],
                    BLOCK_SIZE,
                    None,
                    "GPU",
                    None,
                    group_idx=0,
                )
            )
            yield bool(evict), encode_batch(events, 0, 1.0)


def measure() -> dict[str, list[float]]:
    """Milliseconds per batch, by kind, in this process (the checkout on ``sys.path``)."""
    from indexer.core import KvIndex
    from indexer.normalize import EventApplier
    from indexer.wire import decode_batch

    out: dict[str, list[float]] = {}
    perf = time.perf_counter
    for label, prompts, held, random_hashes in CACHES:
        applier = EventApplier(KvIndex(BLOCK_SIZE), 1, 0)
        storing, evicting = out.setdefault("storing" + label, []), out.setdefault("storing and evicting" + label, [])
        for evicts, payload in list(_batches(prompts, held, random_hashes)):
            t = perf()
            applier.apply_batch(decode_batch(payload))
            (evicting if evicts else storing).append((perf() - t) * 1e3)
        if applier.index.size != held * PROMPT_BLOCKS:
            raise RuntimeError(f"the index holds {applier.index.size} blocks, expected {held * PROMPT_BLOCKS}")
        t = perf()
        applier.index.remove_worker(1)  # the engine died, or left: its whole cache forgotten in one call
        out.setdefault("worker removed" + label, []).append((perf() - t) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--measure"]:  # one round, importing the measured checkout
        print(json.dumps(measure()))
        return 0
    from bench.report import checkout_main

    return checkout_main(__file__, "python -m bench event_apply", __doc__, "per_batch", argv)


if __name__ == "__main__":
    sys.exit(main())
