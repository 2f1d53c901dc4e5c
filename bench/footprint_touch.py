"""How long latency mode's live footprint holds the event loop per routed prompt.

    python -m bench footprint_touch                          # this checkout
    python -m bench footprint_touch --before /tmp/before     # and another checkout, alternating, in one run

Each routed prompt is touched on its rank (``LiveFootprint.touch``, then ``settle`` until nothing is
left, as the frontend does a slice per loop iteration) and the next decision reads the rank (its live
prefix, overflow and pressure). Timed per prompt: the sum of those calls (the loop's work for that
prompt) and the longest single call (the longest stall). Shapes, 16-token blocks, on a rank that also
holds 24 other live conversations of 2,048 blocks, a prompt every 50 ms of virtual time (a 10 s
horizon: older work expires as it goes):

- ``next turn``: a conversation of 8,192 blocks (128 k tokens) growing by a 16-block turn;
- ``second question``: a shared 8,192-block document, each prompt the document and another question;
- ``agentic turn``: a 2,048-block session growing by 16 blocks (the data-path testbed's scale);
- ``new prompt``: 8,192 blocks nobody touched before (every block new: the same work in any design).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterator

PROMPTS = 100  # per shape and round
STEP_S = 0.05
BACKGROUND = 24
RANK = (1, 0)


def _fresh(rng: random.Random, n: int) -> list[int]:
    """``n`` sequence hashes nobody used: random 64-bit values, as xxhash gives them (dicts keyed by
    consecutive integers fill their tables in order, which real hashes never do)."""
    return [rng.getrandbits(64) for _ in range(n)]


def _shapes() -> dict[str, Callable[[random.Random], Iterator[list[int]]]]:
    def growing(blocks: int) -> Callable[[random.Random], Iterator[list[int]]]:
        def prompts(rng: random.Random) -> Iterator[list[int]]:
            chain = _fresh(rng, blocks)
            while True:
                chain = chain + _fresh(rng, 16)
                yield chain

        return prompts

    def questions(rng: random.Random) -> Iterator[list[int]]:
        document = _fresh(rng, 8192)
        while True:
            yield document + _fresh(rng, 16)

    def new(rng: random.Random) -> Iterator[list[int]]:
        while True:
            yield _fresh(rng, 8192)

    return {"next turn": growing(8192), "second question": questions, "agentic turn": growing(2048), "new prompt": new}


def measure() -> dict[str, dict[str, list[float]]]:
    """Per shape, milliseconds of loop work per prompt (``total``) and its longest call (``longest``)."""
    from router.footprint import LiveFootprint

    perf = time.perf_counter
    out: dict[str, dict[str, list[float]]] = {}
    for shape, make in _shapes().items():
        fp = LiveFootprint(horizon_s=10.0)
        rng = random.Random(1)
        now = 0.0
        sessions = [_shapes()["agentic turn"](rng) for _ in range(BACKGROUND)]
        for s in sessions:  # the rank's other live work
            fp.touch(RANK, next(s), now)
            while fp.settle():
                pass
        prompts = make(rng)
        next(prompts)  # the conversation's or the document's first prompt: every block new
        totals, longest = [], []
        for i in range(PROMPTS):
            now += STEP_S
            bg = sessions[i % BACKGROUND]
            fp.touch(RANK, next(bg), now)
            while fp.settle():
                pass
            seq = next(prompts)
            calls = []
            t = perf()
            fp.touch(RANK, seq, now)
            calls.append(perf() - t)
            while True:
                t = perf()
                more = fp.settle()
                calls.append(perf() - t)
                if not more:
                    break
            t = perf()
            live = fp.live_prefix(RANK, seq, now)
            fp.overflow_blocks(RANK, seq, 100_000, now, live)
            fp.pressure_blocks(RANK, 100_000, now, seq, live)
            calls.append(perf() - t)
            totals.append(sum(calls) * 1e3)
            longest.append(max(calls) * 1e3)
        out[shape] = {"total": totals, "longest": longest}
    return out


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--measure"]:  # one round, importing the measured checkout
        print(json.dumps(measure()))
        return 0
    from bench.report import checkout_main

    return checkout_main(__file__, "python -m bench footprint_touch", __doc__, "per_prompt", argv)


if __name__ == "__main__":
    sys.exit(main())
