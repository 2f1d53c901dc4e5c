"""Worker choice: the cost of each (worker, DP rank) candidate and the pick among them.

    new_tokens     = max(0, isl - overlap_blocks * block_size)
    prefill_blocks = (in-flight prefill tokens + new_tokens) / block_size      (a float)
    decode_blocks  = in-flight prompt blocks + this request's blocks not already in flight
    cost           = overlap_score_weight * prefill_blocks + decode_blocks

At temperature 0 the lowest cost wins and ties are broken uniformly at random (so equal workers
share load instead of the first one taking everything). Above 0 the pick is a softmax over
min-max normalised costs: T is relative to the cost range, so T=1 makes the worst candidate
e^-1 times as likely as the best whatever the scale of the costs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

WorkerRank = tuple[int, int]


@dataclass(slots=True)
class CandidateLoad:
    """What the slot tracker knows about one (worker, rank) for the request being routed."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int = 0
    # in-flight blocks plus the request's blocks not yet in flight there; None = not tracked
    potential_decode_blocks: int | None = 0
    active_requests: int = 0


@dataclass(slots=True)
class WorkerCost:
    """One candidate's cost and the terms it was made of (for logs, metrics and tests)."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prefill_tokens: int
    prefill_blocks: float
    decode_blocks: float
    active_requests: int
    cost: float

    @property
    def key(self) -> WorkerRank:
        return (self.worker_id, self.dp_rank)


def score_candidates(
    loads: Iterable[CandidateLoad],
    overlaps: Mapping[WorkerRank, int],
    isl_tokens: int,
    block_size: int,
    overlap_score_weight: float = 1.0,
    track_prefill_tokens: bool = True,
) -> list[WorkerCost]:
    """Cost of every candidate. ``overlaps`` maps (worker, rank) to cached leading blocks."""
    out: list[WorkerCost] = []
    for load in loads:
        overlap = overlaps.get((load.worker_id, load.dp_rank), 0)
        new_tokens = isl_tokens - overlap * block_size
        if new_tokens < 0:
            new_tokens = 0
        prefill_tokens = (load.active_prefill_tokens + new_tokens) if track_prefill_tokens else new_tokens
        prefill_blocks = prefill_tokens / block_size
        decode = load.potential_decode_blocks
        decode_blocks = float(math.floor(prefill_blocks) if decode is None else decode)
        cost = overlap_score_weight * prefill_blocks + decode_blocks
        out.append(
            WorkerCost(
                load.worker_id,
                load.dp_rank,
                overlap,
                prefill_tokens,
                prefill_blocks,
                decode_blocks,
                load.active_requests,
                cost,
            )
        )
    return out


def choose(costs: Sequence[WorkerCost], temperature: float = 0.0, rng: random.Random | None = None) -> WorkerCost:
    """Pick a candidate: lowest cost (random among ties) at T=0, softmax sampling above."""
    if not costs:
        raise ValueError("no candidates to choose from")
    r = rng or random
    if len(costs) == 1:
        return costs[0]
    lo = min(c.cost for c in costs)
    if temperature <= 0:
        best = [c for c in costs if c.cost == lo]
        return best[0] if len(best) == 1 else best[r.randrange(len(best))]
    hi = max(c.cost for c in costs)
    if hi == lo:
        return costs[r.randrange(len(costs))]
    weights = softmax_weights([c.cost for c in costs], temperature, lo, hi)
    u = r.random()
    acc = 0.0
    for c, w in zip(costs, weights, strict=True):
        acc += w
        if u <= acc:
            return c
    return costs[-1]


def softmax_weights(
    costs: Sequence[float], temperature: float, lo: float | None = None, hi: float | None = None
) -> list[float]:
    """Selection probabilities: p ∝ exp(-(cost - lo) / ((hi - lo) * T)), normalised."""
    lo = min(costs) if lo is None else lo
    hi = max(costs) if hi is None else hi
    if hi == lo:
        return [1.0 / len(costs)] * len(costs)
    scale = (hi - lo) * temperature
    raw = [math.exp(-(c - lo) / scale) for c in costs]
    total = sum(raw)
    return [x / total for x in raw]


def formula(c: WorkerCost, overlap_score_weight: float) -> str:
    """The guide's per-candidate log line: ``Formula for worker_1: 125.3 = 1.0 * 100.5 + 25.0 (cached_blocks: 15)``."""
    name = f"worker_{c.worker_id}" + (f"_dp{c.dp_rank}" if c.dp_rank else "")
    return (
        f"Formula for {name}: {c.cost:.1f} = {overlap_score_weight:.1f} * {c.prefill_blocks:.1f} "
        f"+ {c.decode_blocks:.1f} (cached_blocks: {c.overlap_blocks})"
    )
