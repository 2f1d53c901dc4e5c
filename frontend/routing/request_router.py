"""The routing decision for one request: candidates, eligibility, cost, choice, booking.

No I/O: it reads the embedded indexer (or the approximate index) and the embedded slot tracker of
the request's model and books the chosen (worker, DP rank) into the tracker before the request is
sent, so the next decision already sees it. Cost and choice are ``router.selection``'s.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from frontend.request.errors import OpenAIError, all_busy, no_worker
from frontend.routing.decision import Decision
from frontend.routing.eligibility import candidates as eligible_candidates
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from router.footprint import LiveFootprint
from router.latency import LatencyModels, LatencyPrior, score_latency, scoring_models
from router.latency import formula as latency_formula
from router.selection import CandidateLoad, WorkerCost, choose, formula, score_candidates

if TYPE_CHECKING:
    from frontend.observability.metrics import FrontendMetrics
    from frontend.routing.decision_log import DecisionLog
    from frontend.routing.models import ModelEntry
    from indexer.approx import ApproxIndex
    from router.config import RouterConfig

log = logging.getLogger("frontend.routing.request_router")
_perf = time.perf_counter


class RequestRouter:
    """Chooses a (worker, rank) per request according to ``--router-mode``."""

    def __init__(
        self, config: RouterConfig, metrics: FrontendMetrics | None = None, rng: random.Random | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._rr = 0
        self.label = config.router_mode  # the dashboard's name for this router's decisions
        self.decisions: DecisionLog | None = None  # set by the frontend: every booked decision is logged there
        # latency mode: learned per-rank TTFT models, one set per model name (block sizes may differ)
        self._latency: dict[str, LatencyModels] = {}
        self._latency_prior = LatencyPrior(
            tokens_per_s=getattr(config, "router_latency_prefill_tokens_per_s", 20000.0),
            window=getattr(config, "router_latency_window", 100.0),
        )
        self._footprints: dict[str, LiveFootprint] = {}  # latency mode: live blocks per rank, per model
        self._live_horizon = float(getattr(config, "router_latency_live_horizon", 10.0))  # 0: no cache terms

    def latency_models(self, entry: ModelEntry) -> LatencyModels:
        """The learned per-rank TTFT models of ``entry``'s workers (latency mode)."""
        models = self._latency.get(entry.name)
        if models is None:
            models = self._latency[entry.name] = LatencyModels(self._latency_prior, entry.block_size)
        return models

    def footprint(self, entry: ModelEntry) -> LiveFootprint:
        """The blocks recently routed to each rank of ``entry`` (latency mode's eviction charge)."""
        fp = self._footprints.get(entry.name)
        if fp is None:
            fp = self._footprints[entry.name] = LiveFootprint(self._live_horizon or 1.0)
        return fp

    def observe_first_token(self, entry: ModelEntry, decision: Decision, now: float) -> None:
        """Latency mode: learn from the TTFT the chosen rank gave (dispatch to first streamed token)."""
        c = decision.cost
        if c is None or self.config.router_mode != "latency" or not decision.t_routed:
            return
        self.latency_models(entry).observe(
            (c.worker_id, c.dp_rank), c.prefill_tokens, c.decode_blocks, now - decision.t_routed
        )

    def forget_worker(self, worker_id: int) -> None:
        """A removed worker's learned speeds go with it."""
        for models in self._latency.values():
            models.forget_worker(worker_id)
        for fp in self._footprints.values():
            fp.forget_worker(worker_id)

    # ------------------------------------------------------------------------------------------
    def route(
        self,
        entry: ModelEntry,
        tokens: Sequence[int],
        pinned_worker: int | None = None,
        pinned_rank: int | None = None,
        cache_salt: str | None = None,
        explain: bool = False,
        record: bool = False,
        exclude: set[int] | None = None,
        use_overlap: bool = True,
        hashes: tuple[list[int], list[int]] | None = None,
        overlaps: dict[tuple[int, int], int] | None = None,
    ) -> Decision:
        """Pick the target; raise OpenAIError 503 (nobody) / 529 (everybody busy) / 400 (bad pin).

        ``explain``: a dry run (no overhead metrics); ``explain`` or ``record`` keep every
        candidate's cost terms on the decision (the routing record).
        ``exclude``: worker ids this request must not go to (a migrated request's failed workers).
        ``use_overlap=False`` (embeddings): the kv cost without cache overlaps, i.e. by load alone.
        ``hashes``: the prompt's (local, sequence) block hashes, computed with the tokens
        (``frontend/routing/prompt.py``, off the loop for long prompts) for this model and ``cache_salt``.
        ``overlaps``: matched blocks per (worker, rank) from remote indexers (``frontend/routing/remote_index.py``),
        used instead of the embedded index."""
        cfg = self.config
        t0 = _perf()
        bs = entry.block_size
        isl = len(tokens)
        kv = cfg.kv_aware
        metrics = None if explain else self.metrics
        index = entry.index if (kv and use_overlap) else None

        if hashes is not None:
            local, seq = hashes
            t1 = t2 = _perf()
        else:
            local = (
                local_block_hashes(tokens, bs, entry.lora_name, cache_salt)
                if (index is not None or cfg.router_track_active_blocks)
                else []
            )
            t1 = _perf()
            seq = sequence_hashes(local)
            t2 = _perf()
        if not cfg.router_track_active_blocks:
            tracked: list[int] = []
        elif cfg.router_assume_kv_reuse:
            tracked = seq
        else:
            getrandbits = self.rng.getrandbits
            tracked = [getrandbits(64) for _ in seq]
        if overlaps is None:
            overlaps = index.find_matches(local) if (index is not None and local) else {}
        elif not use_overlap:
            overlaps = {}
        t3 = _perf()

        candidates, busy_excluded = eligible_candidates(entry, pinned_worker, pinned_rank, isl)
        if exclude:
            candidates = [c for c in candidates if c[0].id not in exclude]
        if not candidates:
            if pinned_worker is not None and busy_excluded:
                raise OpenAIError(529, f"Pinned worker {pinned_worker} is busy")
            if busy_excluded:
                raise all_busy(entry.name)
            raise no_worker(entry.name)

        tracker = entry.tracker
        cost: WorkerCost | None = None
        booked: int | None = None
        if kv:
            potential = {(p[0], p[1]): p for p in tracker.potential_loads(tracked, 0)}
            loads: list[CandidateLoad] = []
            for worker, rank in candidates:
                p = potential.get((worker.id, rank))
                if p is None:  # not (yet) in the tracker: nothing in flight there
                    loads.append(CandidateLoad(worker.id, rank, 0, len(tracked), 0))
                else:
                    loads.append(CandidateLoad(worker.id, rank, p[2], p[3], p[4]))
            if cfg.router_mode == "latency":
                lmodels = self.latency_models(entry)
                fp, now = self.footprint(entry), time.monotonic()
                overflow: dict[tuple[int, int], int] = {}
                pressure: dict[tuple[int, int], float] = {}
                live_blocks: dict[tuple[int, int], int] = {}
                scored = overlaps
                predict = self._live_horizon and use_overlap and cfg.router_latency_predict_routed
                for cand, r in candidates:
                    key = (cand.id, r)
                    capacity = cand.num_gpu_blocks if self._live_horizon else None  # unknown: no cache terms
                    live = fp.live_prefix(key, seq, now) if capacity or predict else 0  # one search a rank
                    if capacity:
                        overflow[key] = fp.overflow_blocks(key, seq, capacity, now, live)
                        pressure[key] = fp.pressure_blocks(key, capacity, now, seq, live)
                        live_blocks[key] = fp.live_blocks(key, now)
                    if predict:  # blocks just routed there are cached there before their KV events arrive
                        if live > scored.get(key, 0):
                            if scored is overlaps:
                                scored = dict(overlaps)
                            scored[key] = live
                costs = score_latency(
                    loads,
                    scored,
                    isl,
                    bs,
                    lmodels,
                    cfg.router_track_prefill_tokens,
                    recompute_weight=cfg.router_latency_recompute_weight,
                    overflow=overflow,
                    pressure=pressure,
                    live=live_blocks,
                )
            else:
                lmodels = None
                costs = score_candidates(
                    loads, overlaps, isl, bs, cfg.router_kv_overlap_score_weight, cfg.router_track_prefill_tokens
                )
            cost = choose(costs, cfg.router_temperature, self.rng)
            if log.isEnabledFor(logging.DEBUG):
                w = cfg.router_kv_overlap_score_weight
                # the latency terms at the model each candidate was scored with (see scoring_models)
                scored_by = None if lmodels is None else scoring_models(lmodels, [c.key for c in costs], max(isl, bs))
                for i, c in enumerate(costs):
                    log.debug(formula(c, w) if scored_by is None else latency_formula(c, scored_by[i]))
                log.debug(
                    "Selected worker_%s dp_rank %s (cost %.1f) for %d tokens of model %s",
                    cost.worker_id,
                    cost.dp_rank,
                    cost.cost,
                    isl,
                    entry.name,
                )
            chosen_id, rank = cost.worker_id, cost.dp_rank
            worker = next(w for w, r in candidates if w.id == chosen_id and r == rank)
            # what the index holds: the booked prefill and the parity alarm compare it with the engine's
            overlap = overlaps.get((chosen_id, rank), 0) if lmodels is not None else cost.overlap_blocks
            if lmodels is not None and cfg.router_latency_book_predicted and cost.overlap_blocks > overlap:
                # the blocks just routed there are not queued work for this request (its estimate did not count
                # them): booked as they are, the rank looks loaded by the prefix it holds and the prefix's next
                # requests go elsewhere, computing it again
                booked = max(0, isl - cost.overlap_blocks * bs)
        else:
            if cfg.router_mode == "random":
                worker, rank = candidates[self.rng.randrange(len(candidates))]
            else:
                self._rr += 1
                worker, rank = candidates[self._rr % len(candidates)]
            overlap = 0
        available = 0
        if overlaps:
            for worker_c, rank_c in candidates:
                o = overlaps.get((worker_c.id, rank_c), 0)
                if o > available:
                    available = o
        new_tokens = isl - overlap * bs
        if new_tokens < 0:
            new_tokens = 0
        t4 = _perf()
        if metrics is not None:
            metrics.oh_block_hashing.observe((t1 - t0) * 1e3)
            metrics.oh_seq_hashing.observe((t2 - t1) * 1e3)
            if index is not None:
                metrics.oh_find_matches.observe((t3 - t2) * 1e3)
            metrics.oh_scheduling.observe((t4 - t3) * 1e3)
            metrics.oh_total.observe((t4 - t0) * 1e3)
        decision = Decision(
            worker, rank, isl, overlap, new_tokens, tracked, local, seq, cost, costs if kv else None, available, t4
        )
        decision.booked_new_tokens = booked
        return decision

    def best_cached_tokens(self, entry: ModelEntry, local_hashes: list[int]) -> int:
        """Most prompt tokens any worker of the model holds now (the queue's pending-cached gauge)."""
        index = entry.index if self.config.router_mode == "kv" else None
        if index is None or not local_hashes:
            return 0
        overlaps = index.find_matches(local_hashes)
        return max(overlaps.values(), default=0) * entry.block_size

    # ------------------------------------------------------------------------------------------
    def book(self, entry: ModelEntry, request_id: str, decision: Decision) -> None:
        """``reserve`` and ``note_routed`` at once, for a caller that books before it sends."""
        self.reserve(entry, request_id, decision)
        self.note_routed(entry, request_id, decision)

    def reserve(self, entry: ModelEntry, request_id: str, decision: Decision) -> None:
        """Record the request on its (worker, rank) in the tracker: the load the next decision sees.
        Raises the tracker's error when it cannot (the rank is gone)."""
        booked = decision.new_isl_tokens if decision.booked_new_tokens is None else decision.booked_new_tokens
        new_isl = booked if self.config.router_track_prefill_tokens else 0
        entry.tracker.add(request_id, decision.worker.id, decision.dp_rank, decision.tracked_hashes, new_isl)

    def note_routed(self, entry: ModelEntry, request_id: str, decision: Decision) -> None:
        """What the router learns from a decision it booked: the decision log, latency mode's footprint of
        blocks just routed, the approximate index's predicted blocks. Needed by the next decision, not
        by this request's engine: the proxy runs it once the request is written to its worker."""
        if self.decisions is not None:
            self.decisions.record(self.label, self.config, entry, request_id, decision)
        if self.config.router_mode == "latency" and self._live_horizon and decision.seq_hashes:
            fp = self.footprint(entry)
            fp.touch((decision.worker.id, decision.dp_rank), decision.seq_hashes, time.monotonic())
            if fp.unsettled:  # a long prompt: the rest of its blocks a slice per loop iteration
                _settle_soon(fp)
        approx = entry.approx
        if approx is not None and decision.local_hashes:
            approx.record(decision.worker.id, decision.dp_rank, decision.local_hashes, decision.seq_hashes)
            if approx.unsettled:  # a long prompt, or many expired or pruned blocks: the rest a slice at a time
                _settle_soon(approx)


_settling: set[int] = set()  # the id of each footprint or predicted cache a step is scheduled for


def _settle_soon(work: LiveFootprint | ApproxIndex) -> None:
    """``work.settle()`` a slice per event-loop iteration until nothing is left (at once without a loop);
    one chain of steps per object however many decisions ask for it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # a caller outside the event loop (tests, offline tools)
        while work.settle():  # each call settles a slice: it ends when nothing is left
            pass
        return
    key = id(work)
    if key in _settling:
        return
    _settling.add(key)

    def step() -> None:
        more = False
        try:
            more = work.settle()
        finally:  # a failing step ends the chain; the next decision that needs one starts another
            if more:
                loop.call_soon(step)
            else:
                _settling.discard(key)

    loop.call_soon(step)
