"""Offline routing simulation: the replay's schedule through the real router cores and simulated engines
in virtual time (no processes, no sockets, no wall clock), for iterating on cost models quickly.

Each worker is the mocker's own ``RankScheduler`` (same prefix cache, scheduler and time model as
``python -m mocker``) driven by an event loop in virtual time; routing uses the real slot tracker
core (``slot_tracker.core``) and the real cost functions (``router.selection``, ``router.latency``).
Overlaps are read from the engines' caches directly (what KV events report, without their delay),
and there is no frontend or network overhead, so absolute TTFTs are lower than a live replay's; the
comparison between router modes is what this is for. Deterministic for a given seed.

    python -m bench routing_sim --trace mooncake_synthetic --speedup-ratio 0.5,0.35
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import deque
from collections.abc import Sequence as Seq

from bench.replay import build_trace, gpu_blocks_for, parse_loads, percentile
from bench.replay import parser as replay_parser
from bench.sessions import WORKLOADS, session_trace
from bench.traces import Trace, distinct_blocks, oracle
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from mocker.engine import RankScheduler, Sequence, Step
from mocker.kv_cache import KvCache
from mocker.perf_model import PerfModel
from router.footprint import DEFAULT_HORIZON_S, LiveFootprint
from router.latency import NEW_PREFIX_WEIGHT, ROOM_WEIGHT, LatencyModels, LatencyPrior, score_latency
from router.selection import CandidateLoad, choose, score_candidates
from slot_tracker.core import SlotTracker

POLICIES = ("latency", "kv", "kv-w4", "round_robin")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    trace: Trace,
    policy: str,
    workers: int,
    blocks: int,
    speedup: float,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_batched: int = 4096,
    seed: int = 0,
    max_concurrency: int = 0,
) -> dict:
    """Route and run every request of ``trace``; returns TTFT percentiles (ms) and the hit rate.

    ``max_concurrency`` (0: none) holds arrivals while that many requests are in flight and sends them in
    arrival order as requests finish, as the replay's client does; a TTFT counts from the send."""
    clock = _Clock()
    rng = random.Random(seed)
    perf = PerfModel(speedup)
    ttfts: dict[str, float] = {}
    sent_at: dict[str, float] = {}
    tracker = SlotTracker("sim", "default", block_size, clock=clock)
    for w in range(workers):
        tracker._add_worker(w, 0, 1)
    name, _, opt = policy.partition(":")  # e.g. latency:k=4 (decode tokens per block), for experiments
    kw = {k: float(v) for k, v in (o.split("=") for o in opt.split(",") if o)}
    prior = LatencyPrior(**({"decode_tokens_per_block": kw["k"]} if "k" in kw else {}))
    models = LatencyModels(prior, block_size)
    # latency:f=0 turns the cache terms off, f=H sets the live horizon (s), l=W the room weight, n=W the
    # new-prefix weight (0: off)
    footprint = LiveFootprint(kw.get("f", DEFAULT_HORIZON_S)) if kw.get("f", 1.0) > 0 else None
    policy = name
    decisions: dict[str, tuple[int, int, float]] = {}

    def on_first(seq: Sequence, _elapsed: float) -> None:
        rid = seq.request_id
        ttfts[rid] = clock.now - sent_at[rid]
        tracker.prefill_complete(rid, notify=False)
        w, work, dec = decisions[rid]
        if policy == "latency":
            models.observe((w, 0), work, dec, clock.now - sent_at[rid])

    in_flight = most_in_flight = 0
    held: deque[int] = deque()  # arrivals waiting for a client slot (max_concurrency)
    order = len(trace.requests)  # tie-breaker of events at the same time

    def on_finished(seq: Sequence, _reason: str) -> None:
        nonlocal in_flight, order
        tracker.free(seq.request_id, notify=False)
        in_flight -= 1
        if held:  # the slot goes to the oldest held arrival, sent now
            in_flight += 1
            order += 1
            heapq.heappush(events, (clock.now, 2, order, held.popleft()))

    ranks = [
        RankScheduler(
            KvCache(blocks, block_size, ext_seed=w, emit_events=False),
            perf,
            max_num_seqs,
            max_batched,
            None,
            on_first_token=on_first,
            on_finished=on_finished,
            clock=clock,
        )
        for w in range(workers)
    ]
    busy_until: list[Step | None] = [None] * workers  # the step in flight per rank
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0=step end 1=arrival 2=send, order, index)
    for r in trace.requests:
        heapq.heappush(events, (r.arrival_s, 1, r.index, r.index))
    rr = 0
    routed: list[set[int]] = [set() for _ in range(workers)]  # "tree": the blocks routed to each rank

    def kick(w: int) -> None:
        nonlocal order
        if busy_until[w] is None and ranks[w].has_work():
            step = ranks[w].schedule()
            busy_until[w] = step
            order += 1
            heapq.heappush(events, (clock.now + max(step.seconds, 1e-6), 0, order, w))

    n_events = 0
    limit = 50_000_000
    while events and n_events < limit:
        n_events += 1
        t, kind, _, idx = heapq.heappop(events)
        clock.now = t
        if kind == 0:
            done = busy_until[idx]
            assert done is not None  # a step-end event exists only for a step in flight
            busy_until[idx] = None
            ranks[idx].commit(done)
            kick(idx)
            continue
        if kind == 1:
            if max_concurrency and in_flight >= max_concurrency:
                held.append(idx)
                continue
            in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        req = trace.requests[idx]
        rid = f"r{idx}"
        local = local_block_hashes(req.tokens, block_size)
        seq_h = sequence_hashes(local)
        isl = len(req.tokens)
        if policy == "prefix":  # longest cached prefix, ties to the least queued prefill (offline reference)
            ov = [len(ranks[k].kv.longest_prefix(seq_h, len(seq_h))) for k in range(workers)]
            best = max(ov)
            cands = [k for k in range(workers) if ov[k] == best]
            w = min(cands, key=lambda k: (tracker.active_prefill_tokens(k, 0), rng.random()))
            overlap = ov[w]
            work, dec = isl - overlap * block_size, 0
        elif policy == "tree":  # SGLang's cache_aware at its defaults while balanced: the best match when it
            # covers more than 30 % of the prompt, else the rank the fewest blocks were routed to
            ov = [len(ranks[k].kv.longest_prefix(seq_h, len(seq_h))) for k in range(workers)]
            best = max(ov)
            if best * block_size > 0.3 * isl:
                w = ov.index(best)
            else:
                w = min(range(workers), key=lambda k: (len(routed[k]), rng.random()))
            routed[w].update(seq_h)
            overlap = ov[w]
            work, dec = isl - overlap * block_size, 0
        elif policy == "round_robin":
            w = rr % workers
            rr += 1
            overlap = len(ranks[w].kv.longest_prefix(seq_h, (isl - 1) // block_size))
            work, dec = isl - overlap * block_size, 0
        else:
            overlaps = {(k, 0): len(ranks[k].kv.longest_prefix(seq_h, len(seq_h))) for k in range(workers)}
            loads = [CandidateLoad(p[0], p[1], p[2], p[3], p[4]) for p in tracker.potential_loads(seq_h, 0)]
            if policy == "latency":
                overflow = {k: footprint.overflow_blocks(k, seq_h, blocks, t) for k in overlaps} if footprint else None
                pressure = {k: footprint.pressure_blocks(k, blocks, t, seq_h) for k in overlaps} if footprint else None
                costs = score_latency(
                    loads,
                    overlaps,
                    isl,
                    block_size,
                    models,
                    recompute_weight=kw.get("r", 1.0),
                    overflow=overflow,
                    pressure=pressure,
                    room_weight=kw.get("l", ROOM_WEIGHT),
                    live={k: footprint.live_blocks(k, t) for k in overlaps} if footprint else None,
                    new_prefix_weight=kw.get("n", NEW_PREFIX_WEIGHT),
                )
            else:
                costs = score_candidates(loads, overlaps, isl, block_size, 4.0 if policy == "kv-w4" else 1.0)
            c = choose(costs, 0.0, rng)
            w, overlap, work, dec = c.worker_id, c.overlap_blocks, c.prefill_tokens, int(c.decode_blocks)
        new = max(0, isl - overlap * block_size)
        tracker.add(rid, w, 0, seq_h, new)
        if policy == "latency" and footprint is not None:
            footprint.touch((w, 0), seq_h, t)
        decisions[rid] = (w, work, dec)
        sent_at[rid] = t
        ranks[w].add(
            Sequence(
                rid,
                list(req.tokens),
                req.max_tokens,
                lambda tok, reason: None,
                random.Random(idx),
                ignore_eos=True,
                arrival_time=t,
            )
        )
        kick(w)
    queries = sum(r.stats.prefix_cache_queries for r in ranks)
    hits = sum(r.stats.prefix_cache_hits for r in ranks)
    vals = list(ttfts.values())
    return {
        "policy": policy,
        "speedup": speedup,
        "completed": len(vals),
        "requests": len(trace.requests),
        "hit_rate": hits / queries if queries else None,
        "ttft_ms": {f"p{p}": round(1e3 * (percentile(vals, p) or 0.0), 1) for p in (50, 90, 99)} if vals else None,
        "latency_models": models.snapshot() if policy == "latency" else None,
        "most_in_flight": most_in_flight,
        "requests_per_worker": [sum(1 for w, _, _ in decisions.values() if w == k) for k in range(workers)],
    }


def ttft_floor_ms(trace: Trace, block_size: int, speedup: float, p: float = 50) -> float:
    """A lower bound on any router's TTFT percentile: every request alone on an idle engine with the
    oracle's cache (all of its prefix seen before is cached): one prefill step of its uncached tokens."""
    from kvroute_common.hashing import block_hashes

    seen: set[int] = set()
    perf = PerfModel(speedup)
    out = []
    for r in trace.requests:
        _, seq = block_hashes(list(r.tokens), block_size)
        cap = (len(r.tokens) - 1) // block_size
        hit = 0
        while hit < min(cap, len(seq)) and seq[hit] in seen:
            hit += 1
        seen.update(seq)
        out.append(perf.step_seconds(len(r.tokens) - hit * block_size, 0, 0.0) * 1e3)
    return round(percentile(out, p) or 0.0, 1)


SWEEP_SPEEDS = (1.0, 0.5)
SWEEP_CACHES = (0.5, 0.75, 1.0, 1.5, 4096)  # shares of the distinct blocks per rank, or blocks (an int)
SWEEP_FAST = (4.0, 4096, (12, 32))  # agentic-dense on fast engines with the peers testbed's client caps


def sweep_cells(seeds: Seq[int]) -> list[tuple[str, float, float | int, int, int]]:
    """(workload, speedup, cache, max in flight, seed) of ``--sweep``: every bench.sessions workload at
    ``SWEEP_SPEEDS`` with caches of ``SWEEP_CACHES``, and agentic-dense on the peers testbed's fast engines."""
    cells = [
        (w, speed, cache, 0, seed)
        for w in WORKLOADS
        for speed in SWEEP_SPEEDS
        for cache in SWEEP_CACHES
        for seed in seeds
    ]
    speed, blocks, caps = SWEEP_FAST
    return cells + [("agentic-dense", speed, blocks, cap, seed) for cap in caps for seed in seeds]


def sweep_cell(cell: tuple[str, float, float | int, int, int], policies: Seq[str], workers: int) -> dict:
    """One ``--sweep`` cell under every policy: oracle share of the hit rate, TTFT p50 / p90 / p99 ms."""
    name, speed, cache, cap, seed = cell
    trace = session_trace(WORKLOADS[name], seed)
    prompts = [r.tokens for r in trace.requests]
    orc = oracle(prompts, 16).token_share
    blocks = cache if isinstance(cache, int) else max(256, int(cache * -(-distinct_blocks(prompts, 16) // workers)))
    out = {}
    for pol in policies:
        r = simulate(trace, pol, workers, blocks, speed, seed=seed, max_concurrency=cap)
        out[pol] = [r["hit_rate"] / orc, r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"]]
    return out


def sweep(
    policies: Seq[str],
    seeds: Seq[int],
    workers: int = 4,
    jobs: int = 2,
    cells: Seq[tuple[str, float, float | int, int, int]] | None = None,
) -> str:
    """Every ``sweep_cells`` cell under each policy (the first is the reference): per cell the means over
    the seeds, then per policy the mean oracle share and the geometric means of the TTFT percentiles over
    the cells, and the cells where a policy's mean p90 is more than 3 % above the reference's."""
    import math
    import statistics
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    cells = sweep_cells(seeds) if cells is None else cells
    with ProcessPoolExecutor(jobs) as ex:
        results = list(ex.map(partial(sweep_cell, policies=policies, workers=workers), cells, chunksize=4))
    by_cell: dict[tuple, list[dict]] = {}
    for cell, res in zip(cells, results, strict=True):
        by_cell.setdefault(cell[:4], []).append(res)
    lines = [
        "| workload | speed | cache | in flight | "
        + " | ".join(f"{p}: % of oracle, TTFT p50 / p90 / p99 ms" for p in policies)
        + " |",
        "|" + " --- |" * (4 + len(policies)),
    ]
    means: dict[str, list[list[float]]] = {p: [] for p in policies}
    for (name, speed, cache, cap), runs in by_cell.items():
        cells_out = []
        for p in policies:
            m = [statistics.mean(r[p][i] for r in runs) for i in range(4)]
            means[p].append(m)
            cells_out.append(f"{100 * m[0]:.1f} %, {m[1]:.1f} / {m[2]:.1f} / {m[3]:.1f}")
        lines.append(f"| {name} | {speed:g} | {cache:g} | {cap or '-'} | " + " | ".join(cells_out) + " |")
    lines += [
        "",
        "| policy | mean % of oracle | TTFT p50 / p90 / p99 ms (geometric means) | cells with p90 > 1.03x the first |",
        "| --- | --- | --- | --- |",
    ]
    ref = means[policies[0]]
    for p in policies:
        ms = means[p]
        geo = [math.exp(statistics.mean(math.log(max(m[i], 1e-9)) for m in ms)) for i in (1, 2, 3)]
        worse = sum(1 for m, r in zip(ms, ref, strict=True) if m[2] > 1.03 * r[2])
        share = 100 * statistics.mean(m[0] for m in ms)
        lines.append(f"| {p} | {share:.2f} % | {geo[0]:.1f} / {geo[1]:.1f} / {geo[2]:.1f} | {worse} of {len(ms)} |")
    return "\n".join(lines)


def main(argv: Seq[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench routing_sim",
        description=__doc__.split("\n\n")[0],
        parents=[replay_parser()],
        add_help=False,
        conflict_handler="resolve",
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)}, prefix, tree (SGLang's cache_aware while balanced); "
        "latency:r=R,l=W,f=H,n=W sets its weights",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=0, help="requests in flight at most, as the replay's client (0: none)"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="instead of --trace: every session workload at two speeds and five cache sizes, and agentic-dense on "
        "fast engines at 12 and 32 in flight, seeds 1-6, the --policies side by side (the first is the reference)",
    )
    args = p.parse_args(argv)
    if args.sweep:
        print(sweep([x.strip() for x in args.policies.split(",") if x.strip()], range(1, 7), args.workers))
        return 0
    for name in [t.strip() for t in args.trace.split(",") if t.strip()]:
        # a bench.sessions workload by name (e.g. agentic-dense, the peers testbed's), else a trace
        trace = session_trace(WORKLOADS[name], args.seed) if name in WORKLOADS else build_trace(name, args)
        orc = oracle([r.tokens for r in trace.requests], args.block_size).token_share
        blocks = gpu_blocks_for(trace, args)
        print(f"== {trace.name}: {len(trace.requests)} requests, oracle {orc:.1%}, {blocks} blocks per worker")
        for speed in parse_loads(args.speedup_ratio):
            rows = []
            for pol in [x.strip() for x in args.policies.split(",") if x.strip()]:
                t0 = time.process_time()
                r = simulate(
                    trace,
                    pol,
                    args.workers,
                    blocks,
                    speed,
                    args.block_size,
                    args.max_num_seqs,
                    args.max_num_batched_tokens,
                    args.seed,
                    args.max_concurrency,
                )
                r["policy"] = pol
                r["cpu_s"] = round(time.process_time() - t0, 1)
                rows.append(r)
            rr = next((r for r in rows if r["policy"] == "round_robin"), None)
            floor = ttft_floor_ms(trace, args.block_size, speed)
            print(
                f"  speedup {speed:g} floor (oracle cache, no queueing, no decode): TTFT p50 {floor} ms"
                + (f" = {floor / rr['ttft_ms']['p50']:.2f}x rr" if rr else "")
            )
            for r in rows:
                ratio = f"{r['ttft_ms']['p50'] / rr['ttft_ms']['p50']:.2f}x rr" if rr else ""
                print(
                    f"  speedup {speed:g} {r['policy']:>12}: hit {r['hit_rate']:.1%} ({r['hit_rate'] / orc:.0%} of "
                    "oracle), "
                    f"TTFT p50/p90/p99 {r['ttft_ms']['p50']}/{r['ttft_ms']['p90']}/{r['ttft_ms']['p99']} ms {ratio} "
                    f"per worker {r['requests_per_worker']} [{r['cpu_s']} s]"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
