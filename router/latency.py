"""Latency-aware cost (``--router-mode latency``): the time to first token a request would see on a rank.

For each candidate (worker, DP rank):

    work_tokens = queued prefill tokens on the rank (booked, first token not seen yet)
                  + this request's uncached tokens there (isl - overlap_blocks * block_size)
    est_ttft_s  = base_s + s_per_token * (work_tokens + DECODE_TOKENS_PER_BLOCK * decode_blocks)

plus, where the rank's cache would evict blocks other requests used recently to make room for this
prompt (``router.footprint``: its live blocks would no longer fit), the time to compute those again,
plus ``ROOM_WEIGHT`` (1/4) of a block's prefill per block live on the rank (used within the last 10 s
by the requests routed there) times how full they make its cache (live / capacity, at most 1; not on a rank
whose live set fills under 3/4 of its cache for a prompt extending one routed there, a conversation's next turn), and,
on ranks holding less of the prompt than the best rank,
``RECOMPUTE_WEIGHT`` (1) x the time to compute again the blocks another rank already holds. That work
is paid twice: by this request (it is in ``work_tokens``) and by the cluster, which spends prefill
capacity and cache space on a second copy of a prefix (later requests of that prefix then find it
split or evicted). Without it
the choice is greedy per request and gave away reuse under load (offline simulation,
``python -m bench routing_sim``: 91-94 % instead of 98 % of the oracle on the Mooncake synthetic trace).

The two cache terms are what the estimate of this request's TTFT cannot see: where its blocks will still
be when the session's next turn (or the document's next reader) comes. Marginal overflow alone is
myopic: a new session's first request adds a few blocks to a full rank, but its later turns follow
it there and keep pushing the others' history out. The room term spreads the live footprint before
the caches overflow; a rank with no live blocks is free, so a cold engine is filled as soon as the
others hold anything; scaled by fullness it fades where caches are far larger than what is live (the
Mooncake trace's 40k blocks per engine: 98 % of the oracle, 96 % unscaled, 99 % without the cache
terms). Its weight comes from the offline simulation (``python -m bench routing_sim`` on
bench/sessions.py's five workloads at two loads, 6 seeds): 1/4 of a block gave 93.5-99 % of the
oracle in every cell against 89-94 % with neither cache term (kv mode: 90-99 %); of the weights tried
(1/32 ... 2) 0.2-0.3 were alike, 1/8 lost on agentic, 1/2 on agentic and rag, 1 on long-context.

Faded by fullness, the room term cannot place a new prefix where caches are far from full: a prompt
that no rank holds more than ``NEW_PREFIX_SHARE`` (0.3) of starts footprint that its later requests
(the next turns, the other sessions of a system prompt) will follow, and the momentary queue it is
otherwise placed by is gone by then. Fast engines made that visible: two system prompts' sessions on
one engine while another stayed all but idle, since a queue drains before the next new prefix comes.
So such a prompt is also charged ``NEW_PREFIX_WEIGHT`` (2) blocks' prefill per block live on the rank:
new prefixes spread by live footprint, as SGLang's ``cache_aware`` places a prompt it matches poorly
on the worker with the smallest tree. Offline (``python -m bench routing_sim --sweep``: the six session
workloads at speed 1 and 0.5 with caches of 0.5-1.5x the distinct blocks and 4,096 blocks, and the
fast-engine testbed, 6 seeds): 97.9 % of the oracle against 96.3 % on the mean of the cells, TTFT p90 11 %
lower (geometric mean); on ``agentic-dense`` with fast engines p90 12 % lower and the SGLang-like
placement. Where it costs: private long contexts on slow engines with caches holding 3/4 of the blocks (p90
1.2x); weights 1.2-1.5 missed the fast-engine placement, 4 matched 2. Those figures were taken while ranks
with one to three observations were scored against the prior (see ``scoring_models``), which is what put two
prompts on one engine; with that fixed, the charge changes placements only where caches are small (the same
sweep: 97.99 % against 97.80 % without it, the same TTFT except in the long-context cells with caches of half
the distinct blocks: 82.4 % against 75.2 % of the oracle and p90 383 against 526 ms at speed 0.5, 79.9 %
against 75.1 % and p90 158 against 136 ms at speed 1).

``decode_blocks`` is the decode pressure: the KV blocks the rank would hold with this request
(in-flight prompt blocks + this request's blocks not already in flight there, as in ``kv`` mode);
each costs as much as prefilling ``DECODE_TOKENS_PER_BLOCK`` (1) token, i.e. 1/16 of prefilling the
block (the ``kv`` formula's weight 1 charges a decode block like a whole prefill block, which is
what moves requests off their cached prefix). The lowest estimate wins (``router.selection.choose``:
random among ties, optional temperature).

``base_s`` and ``s_per_token`` are learned online **per rank** from the TTFTs the frontend observes:
each routed, streamed request is one observation ``(work_tokens, decode_blocks) -> ttft``, fitted
by ridge regression towards a prior with exponential forgetting (recent observations count most, so
a rank that slows down is seen within about ``window`` requests), with outliers down-weighted
(Huber) and both coefficients bounded. A rank observed fewer than ``MIN_OBSERVATIONS`` times is scored
with its observed peers' model (every rank with the prior until one is observed that often): scored with the prior,
an engine that never got a request looked 9x slower than its learned peers on the mockers and never
got its first one. A rank is re-observed only when it is chosen (a rank learned slow is tried
again once the others have queued more work than its estimate). The decode weight is fixed, not
fitted: work and decode blocks rise together (both grow with in-flight requests), so a free fit
cannot tell them apart. Assumptions: the engine prefills in arrival order (work queued ahead of the
request delays it one for one), prefill time is close to linear in tokens over the range seen
(batched steps), a cached block costs nothing. No I/O here: the frontend feeds observations and
reads estimates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from router.selection import CandidateLoad, WorkerCost, WorkerRank

# Internal feature scales: coefficients are fitted per 1k tokens / per 100 blocks so that the
# prior's strength (``prior_weight`` pseudo-observations) means the same for every coefficient.
_W_SCALE = 1000.0
DECODE_TOKENS_PER_BLOCK = 1.0
RECOMPUTE_WEIGHT = 1.0
ROOM_WEIGHT = 0.25  # of a block's prefill, per block live on the rank (see the module docstring)
# a prompt no rank holds more than this share of starts a new prefix: each block live on a rank costs it
# NEW_PREFIX_WEIGHT blocks' prefill there (see the module docstring)
NEW_PREFIX_SHARE = 0.3
NEW_PREFIX_WEIGHT = 2.0
SAME_SPEED_RATIO = 1.5  # learned speeds closer than this are treated as equal (see scoring_models)
MIN_TOKENS_PER_S = 100.0
MAX_TOKENS_PER_S = 1e8
MAX_BASE_S = 10.0
HUBER_K = 3.0
MIN_OBSERVATIONS = 4  # a rank observed less than this is judged by its observed peers' model


@dataclass(frozen=True, slots=True)
class LatencyPrior:
    """What a rank is assumed to be before it has been observed (and the pull of the fit towards it)."""

    tokens_per_s: float = 20000.0  # prefill speed: a mid-size model on one modern GPU
    base_s: float = 0.02  # fixed cost of a first token (one engine step + transport)
    decode_tokens_per_block: float = DECODE_TOKENS_PER_BLOCK  # prefill tokens one active KV block weighs
    prior_weight: float = 4.0  # pseudo-observations holding the fit near the prior
    window: float = 100.0  # forgetting: observations older than ~window count e^-1 as much

    def __post_init__(self) -> None:
        if not MIN_TOKENS_PER_S <= self.tokens_per_s <= MAX_TOKENS_PER_S:
            raise ValueError(
                f"prior prefill speed must be between {MIN_TOKENS_PER_S:g} and {MAX_TOKENS_PER_S:g} tokens/s"
            )
        if not 0 <= self.base_s <= MAX_BASE_S or self.decode_tokens_per_block < 0:
            raise ValueError("prior base latency must be in [0, 10] s and the decode weight >= 0")
        if self.prior_weight <= 0 or self.window < 1:
            raise ValueError("prior weight must be > 0 and window >= 1")


class RankLatency:
    """Online TTFT model of one rank: ``est = base + s_per_token * (work + k * decode_blocks)``."""

    __slots__ = ("prior", "_theta0", "_s", "_r", "_decay", "observations", "_abs_resid", "base_s", "s_per_token", "_k")

    def __init__(self, prior: LatencyPrior, block_size: int = 16) -> None:
        self.prior = prior
        self._k = prior.decode_tokens_per_block
        # theta in scaled units: [base s, s per 1k tokens]
        self._theta0 = (prior.base_s, _W_SCALE / prior.tokens_per_s)
        self._s = [0.0, 0.0, 0.0]  # forgotten sums of w, w x, w x^2
        self._r = [0.0, 0.0]  # forgotten sums of w y, w x y
        self._decay = math.exp(-1.0 / prior.window)
        self.observations = 0
        self._abs_resid = 0.0  # EWMA of |residual| (Huber scale)
        self.base_s = prior.base_s
        self.s_per_token = 1.0 / prior.tokens_per_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.s_per_token

    @property
    def s_per_block(self) -> float:
        """What one decode block adds to the estimate (s)."""
        return self.s_per_token * self._k

    def predict(self, work_tokens: float, decode_blocks: float) -> float:
        """Estimated TTFT in seconds."""
        return self.base_s + self.s_per_token * (work_tokens + self._k * decode_blocks)

    def observe(self, work_tokens: float, decode_blocks: float, ttft_s: float) -> bool:
        """Add one observed TTFT; returns False (and learns nothing) for unusable values."""
        if not (ttft_s > 0 and math.isfinite(ttft_s)) or work_tokens < 0 or decode_blocks < 0:
            return False
        resid = ttft_s - self.predict(work_tokens, decode_blocks)
        weight = 1.0
        if self.observations >= 8:  # Huber: a stall or a burst moves the fit only so far
            scale = max(self._abs_resid, 1e-4)
            if abs(resid) > HUBER_K * scale:
                weight = HUBER_K * scale / abs(resid)
            self._abs_resid = 0.9 * self._abs_resid + 0.1 * min(abs(resid), HUBER_K * scale)
        else:
            self._abs_resid = max(self._abs_resid, 0.5 * abs(resid))
        x = (work_tokens + self._k * decode_blocks) / _W_SCALE
        d = self._decay
        s, r = self._s, self._r
        s[0] = d * s[0] + weight
        s[1] = d * s[1] + weight * x
        s[2] = d * s[2] + weight * x * x
        r[0] = d * r[0] + weight * ttft_s
        r[1] = d * r[1] + weight * x * ttft_s
        self.observations += 1
        self._solve()
        return True

    def _solve(self) -> None:
        """theta = (S + λI)^-1 (r + λ theta0) for the 2x2 system, then bounded."""
        lam = self.prior.prior_weight
        t0 = self._theta0
        a11, a12, a22 = self._s[0] + lam, self._s[1], self._s[2] + lam
        b1, b2 = self._r[0] + lam * t0[0], self._r[1] + lam * t0[1]
        det = a11 * a22 - a12 * a12
        if det <= 1e-18:
            return
        base = (b1 * a22 - a12 * b2) / det
        per_k = (a11 * b2 - a12 * b1) / det
        self.s_per_token = min(max(per_k / _W_SCALE, 1.0 / MAX_TOKENS_PER_S), 1.0 / MIN_TOKENS_PER_S)
        self.base_s = min(max(base, 0.0), MAX_BASE_S)

    def as_dict(self) -> dict:
        return {
            "observations": self.observations,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "base_ms": round(self.base_s * 1e3, 3),
            "us_per_decode_block": round(self.s_per_block * 1e6, 3),
        }


class LatencyModels:
    """The per-rank models of one frontend, created from the prior on first use."""

    __slots__ = ("prior", "block_size", "_ranks", "unobserved")

    def __init__(self, prior: LatencyPrior | None = None, block_size: int = 16) -> None:
        self.prior = prior or LatencyPrior()
        self.block_size = block_size
        self._ranks: dict[WorkerRank, RankLatency] = {}
        # the prior as a model, never fed: what every rank is scored with until one is observed enough
        self.unobserved = RankLatency(self.prior, block_size)

    def get(self, key: WorkerRank) -> RankLatency:
        m = self._ranks.get(key)
        if m is None:
            m = self._ranks[key] = RankLatency(self.prior, self.block_size)
        return m

    def peek(self, key: WorkerRank) -> RankLatency | None:
        return self._ranks.get(key)

    def observe(self, key: WorkerRank, work_tokens: float, decode_blocks: float, ttft_s: float) -> bool:
        return self.get(key).observe(work_tokens, decode_blocks, ttft_s)

    def forget_worker(self, worker_id: int) -> None:
        """A removed worker's ranks start from the prior if the id comes back (it may be another machine)."""
        for key in [k for k in self._ranks if k[0] == worker_id]:
            del self._ranks[key]

    def snapshot(self) -> dict[str, dict]:
        return {f"{w}:{r}": m.as_dict() for (w, r), m in sorted(self._ranks.items())}


def scoring_models(models: LatencyModels, keys: list[WorkerRank], ref_tokens: float) -> list[RankLatency]:
    """The model each candidate is scored with: its own where its learned speed really differs from the
    candidates' median, else the median rank's.

    Per-rank fits are biased by load, and the bias feeds itself: the slot tracker counts a request's
    whole prompt as queued prefill until its first token, though chunked prefill has already computed
    part of it, so a busy rank's observations overstate the work ahead and its fit makes it look
    faster, which sends it more work (offline, one rank took half of all requests and the p90 TTFT
    rose 1.3x). Only a difference larger than ``SAME_SPEED_RATIO`` at this request's size (a slower
    GPU, a throttled or overloaded engine) is trusted; within the band every rank is scored alike,
    and ranks scored alike are ranked by their work and reuse alone. The median is the observed ranks'
    (at least ``MIN_OBSERVATIONS``), and a rank not yet observed is scored with it: a serving pool is
    alike until shown otherwise, and the prior is no measurement of these engines. Until some rank has
    been observed that often, every rank is scored with the prior: a fit from one to three observations
    beside the prior made a rank that had had no request look 2.7x slower than one that had, and a new
    system prompt went to the busy rank rather than the empty one (which then got no request at all).
    """
    own = [models.get(k) for k in keys]
    if len(own) < 2:
        return own
    observed = [i for i, m in enumerate(own) if m.observations >= MIN_OBSERVATIONS]
    if not observed:
        return [models.unobserved] * len(own)
    est = [m.predict(ref_tokens, 0.0) for m in own]
    median = sorted(observed, key=est.__getitem__)[(len(observed) - 1) // 2]
    mid, mid_est = own[median], est[median]
    return [
        m
        if m.observations >= MIN_OBSERVATIONS and (e > mid_est * SAME_SPEED_RATIO or e * SAME_SPEED_RATIO < mid_est)
        else mid
        for m, e in zip(own, est, strict=True)
    ]


def score_latency(
    loads: Iterable[CandidateLoad],
    overlaps: Mapping[WorkerRank, int],
    isl_tokens: int,
    block_size: int,
    models: LatencyModels,
    track_prefill_tokens: bool = True,
    recompute_weight: float = RECOMPUTE_WEIGHT,
    overflow: Mapping[WorkerRank, int] | None = None,
    pressure: Mapping[WorkerRank, float] | None = None,
    room_weight: float = ROOM_WEIGHT,
    live: Mapping[WorkerRank, int] | None = None,
    new_prefix_weight: float = NEW_PREFIX_WEIGHT,
) -> list[WorkerCost]:
    """Estimated TTFT of every candidate as its cost, in milliseconds (lower is better).

    ``WorkerCost.prefill_tokens`` is the work the estimate charges (queued + uncached tokens),
    ``decode_blocks`` the decode pressure, ``cost`` the estimate in ms. ``overflow``: live blocks each
    rank would evict to take this prompt (``router.footprint``); each is charged as computing it again.
    ``pressure``: each rank's live blocks weighted by how full they make its cache
    (``LiveFootprint.pressure_blocks``), each charged ``room_weight`` of a block's prefill.
    ``live``: each rank's live blocks (``LiveFootprint.live_blocks``); for a prompt that starts a new prefix
    (no rank holds more than ``NEW_PREFIX_SHARE`` of it) each is charged ``new_prefix_weight`` blocks' prefill.
    """
    out: list[WorkerCost] = []
    loads = list(loads)
    scoring = scoring_models(models, [(load.worker_id, load.dp_rank) for load in loads], max(isl_tokens, block_size))
    top = max(overlaps.values(), default=0)
    best = top if recompute_weight else 0
    spread = live if live and new_prefix_weight and top * block_size <= NEW_PREFIX_SHARE * isl_tokens else None
    for load, model in zip(loads, scoring, strict=True):
        key = (load.worker_id, load.dp_rank)
        overlap = overlaps.get(key, 0)
        new_tokens = isl_tokens - overlap * block_size
        if new_tokens < 0:
            new_tokens = 0
        work = (load.active_prefill_tokens + new_tokens) if track_prefill_tokens else new_tokens
        decode = load.potential_decode_blocks
        decode_blocks = float(0 if decode is None else decode)
        est_ms = model.predict(work, decode_blocks) * 1e3
        if best > overlap:  # blocks cached elsewhere that this rank would compute again
            est_ms += (
                recompute_weight * min(best - overlap, isl_tokens // block_size) * block_size * model.s_per_token * 1e3
            )
        if overflow:  # live blocks pushed out here, computed again by the requests that wanted them
            est_ms += overflow.get(key, 0) * block_size * model.s_per_token * 1e3
        if pressure:  # the fuller the rank's live set, the sooner what this request leaves there goes
            est_ms += room_weight * pressure.get(key, 0.0) * block_size * model.s_per_token * 1e3
        if spread:  # a new prefix: the requests that will follow it add to what the rank already serves
            est_ms += new_prefix_weight * spread.get(key, 0) * block_size * model.s_per_token * 1e3
        out.append(
            WorkerCost(
                load.worker_id,
                load.dp_rank,
                overlap,
                work,
                work / block_size,
                decode_blocks,
                load.active_requests,
                est_ms,
            )
        )
    return out


def formula(c: WorkerCost, model: RankLatency) -> str:
    """Debug line per candidate: the estimate and its terms."""
    name = f"worker_{c.worker_id}" + (f"_dp{c.dp_rank}" if c.dp_rank else "")
    return (
        f"Latency for {name}: {c.cost:.1f} ms = {model.base_s * 1e3:.1f} + {c.prefill_tokens} tok / "
        f"{model.tokens_per_s:.0f} tok/s "
        f"+ {c.decode_blocks:.0f} decode blocks x {model.s_per_block * 1e6:.2f} us (cached_blocks: {c.overlap_blocks})"
    )
