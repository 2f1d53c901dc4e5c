"""Which (worker, DP rank) may take a request now: one home for every eligibility rule.

- **Busy thresholds** (per model, changeable at runtime through ``/busy_threshold``): a rank is
  overloaded when any configured check fires (the reference router's busy checks): prefill tokens in
  flight > ``active_prefill_tokens_threshold``; prefill tokens in flight >
  ``floor(frac * max_num_batched_tokens)``; decode blocks in flight > ``threshold * total KV blocks``.
  A worker is excluded from routing while all its ranks are overloaded.
- **Candidates** (:func:`candidates`): healthy workers of the model, restricted by pins, minus busy ones.
- **Router queue capacity** (:func:`queue_has_capacity`, ``--router-queue-threshold``): a request is
  held while every eligible rank has more in-flight prefill tokens than threshold x its
  max_num_batched_tokens (:func:`rank_is_busy`).
- **Speculative warm-ups** (:func:`warmup_target_busy`): skipped on an unhealthy, busy or backlogged rank.

The loads are the frontend's own accounting (the embedded slot tracker).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from frontend.routing.models import BusyThresholds, ModelEntry
from kvroute_common.openai_api import OpenAIError

if TYPE_CHECKING:
    from frontend.pool.workers import Worker
    from frontend.request.hints import RequestHints

# the reference's stand-in when a worker does not say how many tokens it batches: effectively never busy
UNKNOWN_MAX_BATCHED_TOKENS = 10_000_000
DEFAULT_MAX_NUM_BATCHED_TOKENS = UNKNOWN_MAX_BATCHED_TOKENS  # the router queue's name for it


def rank_overloaded(
    thresholds: BusyThresholds,
    prefill_tokens: int,
    decode_blocks: int,
    total_kv_blocks: int | None,
    max_num_batched_tokens: int | None,
) -> bool:
    """Whether any configured busy check fires for a rank with these loads."""
    t = thresholds.active_prefill_tokens_threshold
    if t is not None and prefill_tokens > t:
        return True
    f = thresholds.active_prefill_tokens_threshold_frac
    if f is not None and prefill_tokens > math.floor(f * (max_num_batched_tokens or UNKNOWN_MAX_BATCHED_TOKENS)):
        return True
    d = thresholds.active_decode_blocks_threshold
    if d is not None and total_kv_blocks and decode_blocks > d * total_kv_blocks:
        return True
    return False


def _takes(worker: Worker, isl: int) -> bool:
    limit = worker.prompt_limit.tokens
    return limit is None or isl < limit


def candidates(
    entry: ModelEntry, pinned_worker: int | None, pinned_rank: int | None, isl: int = 0
) -> tuple[list[tuple[Worker, int]], bool]:
    """Healthy (worker, rank) pairs not excluded as busy; the flag says whether busy excluded any.
    Unpinned, a worker that cannot take an ``isl``-token prompt (its context length or KV capacity)
    is no candidate.

    OpenAIError 400 for a pin the model cannot satisfy, 503 for a pinned worker that is down."""
    out: list[tuple[Worker, int]] = []
    busy = False
    thresholds = entry.thresholds
    check = thresholds.enabled
    tracker = entry.tracker
    if pinned_worker is not None:
        w = entry.workers.get(pinned_worker)
        if w is None:
            raise OpenAIError(
                400 if pinned_worker not in entry.known_worker_ids() else 503,
                f"Pinned worker {pinned_worker} is not serving model {entry.name}",
            )
        if not w.healthy:
            raise OpenAIError(503, f"Pinned worker {pinned_worker} is unavailable")
        pool = [w]
    else:
        pool = [w for w in entry.workers.values() if w.healthy and _takes(w, isl)]
    rank_fits = False
    for w in pool:
        ranks = w.spec.ranks
        if pinned_rank is not None:
            if pinned_rank not in ranks:
                if pinned_worker is not None:
                    raise OpenAIError(400, f"dp_rank {pinned_rank} is out of range for worker {w.id}")
                continue  # a rank-only pin: workers without that rank are not candidates
            ranks = range(pinned_rank, pinned_rank + 1)
        rank_fits = True
        if check:
            total = w.num_gpu_blocks
            mbt = w.max_num_batched_tokens
            # a worker is busy only when ALL its ranks are overloaded
            if all(
                rank_overloaded(
                    thresholds,
                    tracker.active_prefill_tokens(w.id, r),
                    tracker.active_decode_blocks(w.id, r),
                    total,
                    mbt,
                )
                for r in w.spec.ranks
            ):
                busy = True
                continue
        for r in ranks:
            out.append((w, r))
    if pinned_rank is not None and pool and not rank_fits:
        raise OpenAIError(400, f"dp_rank {pinned_rank} is out of range for every worker of model {entry.name}")
    return out, busy


def rank_is_busy(active_prefill_tokens: float, max_num_batched_tokens: int | None, threshold: float) -> bool:
    """Busy for the router queue: in-flight prefill tokens above threshold x max_num_batched_tokens."""
    cap = max_num_batched_tokens if max_num_batched_tokens else DEFAULT_MAX_NUM_BATCHED_TOKENS
    return active_prefill_tokens > threshold * cap


def any_rank_free(ranks: list[tuple[float, int | None]], threshold: float) -> bool:
    """Capacity for a request whose eligible ranks are ``[(active_prefill_tokens, max_num_batched_tokens)]``.

    No eligible rank at all counts as capacity (do not hold; let routing report no worker)."""
    if not ranks:
        return True
    for tokens, cap in ranks:
        if not rank_is_busy(tokens, cap, threshold):
            return True
    return False


def queue_has_capacity(entry: ModelEntry | None, hints: RequestHints | None, threshold: float) -> bool:
    """The router queue's capacity check for one request: a free eligible rank (pins respected)."""
    if entry is None:
        return True
    tracker = entry.tracker
    pinned = hints.pinned_worker_id if hints is not None else None
    prank = hints.pinned_dp_rank if hints is not None else None
    ranks = [
        (tracker.active_prefill_tokens(w.id, r), w.max_num_batched_tokens)
        for w in entry.workers.values()
        if w.healthy and (pinned is None or w.id == pinned)
        for r in w.spec.ranks
        if pinned is None or prank is None or r == prank
    ]
    return any_rank_free(ranks, threshold)


def warmup_target_busy(models: Mapping[str, ModelEntry], worker_id: int, dp_rank: int | None) -> bool:
    """For speculative prefill: skip warm-ups to a worker that is down, busy or has a backlog of prefill."""
    for entry in models.values():
        w = entry.workers.get(worker_id)
        if w is None:
            continue
        if not w.healthy:
            return True
        t = entry.tracker
        ranks = [dp_rank] if dp_rank is not None else list(w.spec.ranks)
        th = entry.thresholds
        for r in ranks:
            prefill = t.active_prefill_tokens(worker_id, r)
            if th.enabled and rank_overloaded(
                th, prefill, t.active_decode_blocks(worker_id, r), w.num_gpu_blocks, w.max_num_batched_tokens
            ):
                return True
            if w.max_num_batched_tokens and prefill > w.max_num_batched_tokens:
                return True
    return False
