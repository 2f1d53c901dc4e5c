"""Frontend benchmarks: routing decision latency, CPU per routed request, added streaming latency.

    python -m bench.frontend_bench decision   # in-process: tokenize + hash + overlap + loads + cost + book
    python -m bench.frontend_bench cpu        # real processes: frontend CPU ms per routed request
    python -m bench.frontend_bench latency    # real processes: streamed request via frontend vs mocker directly
    python -m bench.frontend_bench all

Figures and how to read them: docs/bench/frontend.md. Nothing here asserts: benchmarks measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

MODEL = "kvroute-demo"


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _summary(values_ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(_pct(values_ms, 50), 3),
        "p90": round(_pct(values_ms, 90), 3),
        "p99": round(_pct(values_ms, 99), 3),
        "mean": round(statistics.fmean(values_ms), 3),
    }


def _corpus() -> str:
    import pydoc_data.topics as topics

    return " ".join(topics.topics[k] for k in sorted(topics.topics))


# ---------------------------------------------------------------------------------------------
# 1. routing decision, in process


class _Events:
    """Stand-in for the IndexerRegistry: hands out one pre-filled KvIndex."""

    def __init__(self, index: Any) -> None:
        self._index = index

    def index(self, model: str, tenant: str) -> Any:
        return self._index


def bench_decision(
    iterations: int = 300, workers: int = 4, dp_size: int = 2, cold: bool = False, seed: int = 0
) -> dict[str, Any]:
    """p50 of the whole routing decision for an ~8k-token chat prompt over workers*dp_size ranks."""
    from frontend.pool.workers import Worker, WorkerSpec
    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import body_tokens
    from frontend.routing.request_router import RequestRouter
    from indexer.core import KvIndex
    from kvroute_common.hashing import block_hashes
    from kvroute_common.tokenizer import load_tokenizer
    from router.config import RouterConfig
    from slot_tracker.core import SlotRegistry

    rng = random.Random(seed)
    text = _corpus()
    tok = load_tokenizer(None)
    bs = 16
    slots = SlotRegistry()
    index = KvIndex(bs)
    events = _Events(index)  # a stand-in registry: the decision only asks it for the index
    entry = ModelEntry(MODEL, bs, tok, slots, events, None, BusyThresholds())  # type: ignore[arg-type]
    for wid in range(1, workers + 1):
        worker = Worker(
            spec=WorkerSpec(id=wid, url=f"http://127.0.0.1:{9000 + wid}", dp_size=dp_size),
            source="cli",
            client=None,  # type: ignore[arg-type]  # the decision never reaches the network
            upstream=None,  # type: ignore[arg-type]
        )
        worker.healthy = True
        worker.discovered = True
        worker.num_gpu_blocks = 4096
        worker.max_num_batched_tokens = 8192
        entry.workers[wid] = worker
        slots.register(wid, MODEL, "default", bs, 0, dp_size)
    ranks = [(w, r) for w in range(1, workers + 1) for r in range(dp_size)]
    system = text[:24000]  # ~6k tokens shared by every request
    # background cache state: every rank holds a few unrelated 4k-token documents; two hold the system prompt
    for n, (w, r) in enumerate(ranks):
        for _ in range(4):
            off = rng.randrange(0, len(text) - 20000)
            ids = tok(text[off : off + 16000], add_special_tokens=False)["input_ids"]
            local, seq = block_hashes(ids, bs)
            index.apply_stored(w, r, None, list(zip(seq, local, strict=True)))
        if n < 2:
            from kvroute_common.tokenizer import chat_prompt_token_ids

            ids = chat_prompt_token_ids(
                tok, [{"role": "system", "content": system}, {"role": "user", "content": "warm"}]
            )
            local, seq = block_hashes(ids, bs)
            index.apply_stored(w, r, None, list(zip(seq, local, strict=True)))
    tracker = entry.tracker
    for i in range(32):  # requests in flight
        w, r = ranks[i % len(ranks)]
        off = rng.randrange(0, len(text) - 8000)
        ids = tok(text[off : off + 4000], add_special_tokens=False)["input_ids"]
        tracker.add(f"bg-{i}", w, r, block_hashes(ids, bs)[1], len(ids) if i % 3 == 0 else 0)
    router = RequestRouter(RouterConfig(router_mode="kv"), None, random.Random(seed))

    def body(i: int) -> dict:
        if cold:  # never-seen text for both messages
            off = rng.randrange(0, len(text) - 33000)
            return {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": text[off : off + 24000]},
                    {"role": "user", "content": text[off + 24000 : off + 32000] + str(i)},
                ],
            }
        off = rng.randrange(30000, len(text) - 9000)
        return {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": text[off : off + 8000] + str(i)},
            ],
        }

    total, tok_ms, route_ms, isls = [], [], [], []
    for i in range(iterations + 20):
        b = body(i)
        t0 = time.perf_counter()
        tokens = body_tokens(entry, b, True)
        t1 = time.perf_counter()
        d = router.route(entry, tokens)
        router.book(entry, f"r{i}", d)
        t2 = time.perf_counter()
        tracker.free(f"r{i}")
        if i >= 20:  # warm-up excluded
            total.append((t2 - t0) * 1e3)
            tok_ms.append((t1 - t0) * 1e3)
            route_ms.append((t2 - t1) * 1e3)
            isls.append(len(tokens))
    return {
        "bench": "decision",
        "cold_text": cold,
        "ranks": len(ranks),
        "isl_median": int(statistics.median(isls)),
        "index_blocks": index.size,
        "total_ms": _summary(total),
        "tokenize_ms": _summary(tok_ms),
        "route_and_book_ms": _summary(route_ms),
    }


# ---------------------------------------------------------------------------------------------
# helpers for process benchmarks


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _hammer(url: str, body: bytes, n: int, concurrency: int, path: str = "/v1/chat/completions") -> float:
    """Send n requests with the given concurrency over keep-alive connections; returns elapsed seconds."""
    from frontend.dispatch.upstream import UpstreamPool

    pool = UpstreamPool(url)
    headers = [("content-type", "application/json")]
    remaining = n

    stream = b'"stream": true' in body

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            r = await pool.request("POST", path, body, headers, stream=stream)
            data = await r.aread() if stream else r.content
            if r.status != 200:
                raise RuntimeError(f"status {r.status}: {data[:200]!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await pool.aclose()
    return elapsed


def bench_cpu(
    requests: int = 3000, concurrency: int = 16, n_workers: int = 2, router_mode: str = "kv", stream_tokens: int = 0
) -> dict[str, Any]:
    """Frontend CPU per routed request: short chat, non-streaming, max_tokens=1, instant mockers
    (``stream_tokens`` > 0: streamed, that many tokens each)."""
    from kvroute_common.local_cluster import MockerOptions, start_cluster

    opts = MockerOptions(speedup_ratio=0.0)
    req: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Write a haiku about routers."}],
    }
    if stream_tokens:
        req.update(stream=True, max_tokens=stream_tokens, ignore_eos=True)
    body = json.dumps(req).encode()
    with start_cluster(n_workers, opts, router_mode=router_mode, frontend_args=["--log-level", "warning"]) as cluster:
        assert cluster.frontend is not None and cluster.frontend_url is not None  # start_cluster waited for it
        fe_pid = cluster.frontend.proc.pid
        asyncio.run(_hammer(cluster.frontend_url, body, 300, concurrency))  # warm-up
        c0 = _cpu_seconds(fe_pid)
        elapsed = asyncio.run(_hammer(cluster.frontend_url, body, requests, concurrency))
        cpu = _cpu_seconds(fe_pid) - c0
        w = cluster.workers[0]
        c1 = _cpu_seconds(w.child.proc.pid)
        direct = asyncio.run(_hammer(w.url, body, 1000, concurrency))
        mocker_cpu = (_cpu_seconds(w.child.proc.pid) - c1) / 1000
    return {
        "bench": "cpu",
        "router_mode": router_mode,
        "stream_tokens": stream_tokens,
        "requests": requests,
        "concurrency": concurrency,
        "frontend_cpu_ms_per_request": round(cpu * 1e3 / requests, 3),
        "throughput_rps_via_frontend": round(requests / elapsed, 1),
        "mocker_direct_rps": round(1000 / direct, 1),
        "mocker_cpu_ms_per_request": round(mocker_cpu * 1e3, 3),
    }


def _stream_once(client: Any, url: str, body: dict) -> tuple[float, float, list[float]]:
    """(ttft s, total s, inter-chunk gaps s) of one streamed request, measured at the client."""
    t0 = time.perf_counter()
    ttft = None
    last = None
    gaps = []
    with client.stream("POST", url, json=body) as r:
        for _chunk in r.iter_raw():
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            elif last is not None:
                gaps.append(now - last)
            last = now
    return ttft or 0.0, time.perf_counter() - t0, gaps


def bench_latency(requests: int = 60, max_tokens: int = 64) -> dict[str, Any]:
    """Added latency of the proxy per streamed request (sequential, keep-alive) vs the mocker directly."""
    import httpx

    from kvroute_common.local_cluster import MockerOptions, start_cluster

    opts = MockerOptions(speedup_ratio=1.0)
    out: dict[str, Any] = {"bench": "latency", "requests": requests, "max_tokens": max_tokens}
    with start_cluster(1, opts, router_mode="kv", frontend_args=["--log-level", "warning"]) as cluster:
        direct_url = cluster.workers[0].url + "/v1/chat/completions"
        fe_url = f"{cluster.frontend_url}/v1/chat/completions"
        results: dict[str, dict[str, list[float]]] = {
            "direct": {"ttft": [], "total": [], "gaps": []},
            "frontend": {"ttft": [], "total": [], "gaps": []},
        }
        with httpx.Client(timeout=60.0) as client:  # one keep-alive connection per target
            for i in range(requests + 5):
                body = {
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"request {i}: tell me about caches"}],
                }
                for name, url in (("direct", direct_url), ("frontend", fe_url)):
                    ttft, total, gaps = _stream_once(client, url, body)
                    if i >= 5:
                        results[name]["ttft"].append(ttft * 1e3)
                        results[name]["total"].append(total * 1e3)
                        results[name]["gaps"].extend(g * 1e3 for g in gaps)
    for name, r in results.items():
        out[name] = {
            "ttft_ms": _summary(r["ttft"]),
            "total_ms": _summary(r["total"]),
            "chunk_gap_ms": _summary(r["gaps"]),
            "gaps_over_30ms": sum(1 for g in r["gaps"] if g > 30),
        }
    out["added_ttft_ms_p50"] = round(out["frontend"]["ttft_ms"]["p50"] - out["direct"]["ttft_ms"]["p50"], 3)
    out["added_total_ms_p50"] = round(out["frontend"]["total_ms"]["p50"] - out["direct"]["total_ms"]["p50"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_bench", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["decision", "cpu", "latency", "all"])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--router-mode", default="kv")
    p.add_argument(
        "--stream-tokens",
        type=int,
        default=0,
        help="cpu: streamed requests of this many tokens (0 = unary max_tokens=1)",
    )
    ns = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    if ns.what in ("decision", "all"):
        print(json.dumps(bench_decision(ns.iterations)))
        print(json.dumps(bench_decision(ns.iterations // 3, cold=True)))
    if ns.what in ("cpu", "all"):
        print(
            json.dumps(
                bench_cpu(ns.requests, ns.concurrency, router_mode=ns.router_mode, stream_tokens=ns.stream_tokens)
            )
        )
    if ns.what in ("latency", "all"):
        print(json.dumps(bench_latency()))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
