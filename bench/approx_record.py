"""How long approximate mode's predicted cache (``--no-router-kv-events``) holds the event loop per prompt.

    python -m bench approx_record                          # this checkout
    python -m bench approx_record --before /tmp/before     # and another checkout, alternating, in one run

Each routed prompt is recorded on its rank (``ApproxIndex.record``, then ``settle`` until nothing is left,
as the frontend does a slice per loop iteration, where the checkout has it) and the next decision reads
the prediction (``find_matches``). Timed per prompt: the sum of those calls (the loop's work for that
prompt) and the longest single call (the longest stall). The prediction's defaults (a 120 s TTL, pruned
past 1,048,576 blocks down to 80 %), 16-token blocks, four ranks already holding 96 prompts of 8,192
blocks (786,432 blocks, as a fleet of 8B engines on H200s would), a prompt every 50 ms of virtual time,
the frontend's garbage-collection policy:

- ``new prompt``: 8,192 blocks nobody routed before; past the size bound the oldest are pruned;
- ``next turn``: a conversation of 8,192 blocks (128 k tokens) growing by a 16-block turn;
- ``agentic turn``: a 2,048-block session growing by 16 blocks (the data-path testbed's scale);
- ``expiry``: the TTL passes with every block predicted: the next decisions' calls until all are gone.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

PROMPTS = 60  # per shape and round
STEP_S = 0.05
RANKS = 4
BACKGROUND = 96
BLOCKS = 8192


def _fresh(rng: random.Random, n: int) -> list[int]:
    """``n`` hashes nobody used: random 64-bit values, as xxhash gives them."""
    return [rng.getrandbits(64) for _ in range(n)]


def _shapes() -> dict[str, Callable[[random.Random], Iterator[list[int]]]]:
    def growing(blocks: int) -> Callable[[random.Random], Iterator[list[int]]]:
        def prompts(rng: random.Random) -> Iterator[list[int]]:
            chain = _fresh(rng, blocks)
            while True:
                chain = chain + _fresh(rng, 16)
                yield chain

        return prompts

    def new(rng: random.Random) -> Iterator[list[int]]:
        while True:
            yield _fresh(rng, BLOCKS)

    return {"new prompt": new, "next turn": growing(BLOCKS), "agentic turn": growing(2048)}


class _Timed:
    """The loop's calls for one prompt: each timed."""

    def __init__(self, ax: Any) -> None:
        self.ax = ax
        self.calls: list[float] = []

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        self.calls.append(time.perf_counter() - t)
        return out

    def settle(self) -> None:
        settle = getattr(self.ax, "settle", None)  # a checkout before the sliced prediction has none
        for _ in range(100_000):  # bounded: each call moves a slice
            if settle is None or not self.call(settle):
                return


def _filled(clock: list[float]) -> Any:
    from indexer.approx import ApproxIndex

    ax = ApproxIndex(16, clock=lambda: clock[0])
    rng = random.Random(7)
    for i in range(BACKGROUND):  # each local hash stands for its sequence hash (distinct either way)
        seq = _fresh(rng, BLOCKS)
        ax.record(i % RANKS, 0, seq, seq)
        _Timed(ax).settle()
        clock[0] += STEP_S
    return ax


def measure() -> dict[str, dict[str, list[float]]]:
    """Per shape, milliseconds of loop work per prompt (``total``) and its longest call (``longest``)."""
    from kvroute_common.gc_policy import tune_gc

    tune_gc()  # the frontend's collection policy
    out: dict[str, dict[str, list[float]]] = {}
    for shape, make in _shapes().items():
        clock = [0.0]
        ax = _filled(clock)
        prompts = make(random.Random(1))
        first = next(prompts)  # the conversation's first prompt: every block new
        ax.record(0, 0, first, first)
        _Timed(ax).settle()
        totals, longest = [], []
        for i in range(PROMPTS):
            clock[0] += STEP_S
            seq = next(prompts)
            timed = _Timed(ax)
            timed.call(ax.find_matches, seq)
            timed.call(ax.record, 0 if shape != "new prompt" else i % RANKS, 0, seq, seq)
            timed.settle()
            totals.append(sum(timed.calls) * 1e3)
            longest.append(max(timed.calls) * 1e3)
        out[shape] = {"total": totals, "longest": longest}
    clock = [0.0]
    ax = _filled(clock)
    clock[0] += 200.0  # past the TTL: every prediction expires
    timed = _Timed(ax)
    probe = _fresh(random.Random(3), 16)
    for _ in range(100_000):  # bounded: each decision removes a slice of what expired
        timed.call(ax.find_matches, probe)
        timed.call(ax.record, 0, 0, probe, probe)
        timed.settle()
        if ax.size <= len(probe):
            break
    out["expiry"] = {"total": [sum(timed.calls) * 1e3], "longest": [max(timed.calls) * 1e3]}
    return out


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--measure"]:  # one round, importing the measured checkout
        print(json.dumps(measure()))
        return 0
    from bench.report import checkout_main

    return checkout_main(__file__, "python -m bench approx_record", __doc__, "per_prompt", argv)


if __name__ == "__main__":
    sys.exit(main())
