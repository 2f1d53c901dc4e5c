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
PROMPTS = 12
HELD = 3  # prompts the cache holds before it evicts the oldest


def _batches() -> Iterator[tuple[bool, bytes]]:
    """(evicts, payload) per engine step."""
    from indexer.wire import BlockRemoved, BlockStored, encode_batch

    rng = random.Random(1)
    held: list[list[int]] = []
    next_hash = 1
    for _ in range(PROMPTS):
        hashes = list(range(next_hash, next_hash + PROMPT_BLOCKS))
        next_hash += PROMPT_BLOCKS
        tokens = [rng.randrange(30000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)]
        held.append(hashes)
        evict = list(reversed(held.pop(0))) if len(held) > HELD else []
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

    applier = EventApplier(KvIndex(BLOCK_SIZE), 1, 0)
    out: dict[str, list[float]] = {"storing": [], "storing and evicting": []}
    perf = time.perf_counter
    for evicts, payload in list(_batches()):
        t = perf()
        applier.apply_batch(decode_batch(payload))
        out["storing and evicting" if evicts else "storing"].append((perf() - t) * 1e3)
    if applier.index.size != HELD * PROMPT_BLOCKS:
        raise RuntimeError(f"the index holds {applier.index.size} blocks, expected {HELD * PROMPT_BLOCKS}")
    return out


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--measure"]:  # one round, importing the measured checkout
        print(json.dumps(measure()))
        return 0
    from bench.report import checkout_main

    return checkout_main(__file__, "python -m bench event_apply", __doc__, "per_batch", argv)


if __name__ == "__main__":
    sys.exit(main())
