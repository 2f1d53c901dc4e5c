"""Leak test: many requests through the frontend with client cancellations and worker faults; then
nothing may be left booked, queued or in flight, and the index must equal the engines' caches.

    python -m bench leak                       # 10,000 requests, 4 mockers (docs/benchmarks.md)
    python -m bench leak --requests 300        # the CI version (tests/test_leak.py)

``--cancel`` (10 %) of the requests are abandoned by the client at a random point: before the
response's first byte (the request task is cancelled after a random delay) or mid-stream (after a
random number of chunks). ``--faults`` (5 %) of the requests are fault requests: when its first byte
arrives, a random mocker that is up is killed (SIGKILL, its cache is lost) and restarted on the same
HTTP and ZMQ ports; at most ``--max-down`` mockers are down at once, so a fault request that finds
them all restarting injects nothing (the report counts faults injected and skipped). The frontend
runs with ``--migration-limit 3`` so streams on a killed worker continue elsewhere.

Afterwards (every mocker back and healthy in the frontend): every row of ``/loads`` is 0, the
frontend's queued / in-flight / active gauges are 0, and the embedded index (``/admin/kv_dump``)
equals the union of the mockers' caches (``/mocker/kv_blocks``) per worker and rank, exactly.
Writes ``leak.json`` under ``--out``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx

MODEL = "kvroute-demo"
GAUGES = ("dynamo_frontend_queued_requests", "dynamo_frontend_inflight_requests", "dynamo_frontend_active_requests")


def _prompt_pool(seed: int) -> tuple[list[str], list[str]]:
    import pydoc_data.topics as topics

    rng = random.Random(seed)
    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    systems = [text[o : o + 1500] for o in (rng.randrange(0, len(text) - 1500) for _ in range(24))]
    return systems, text.split()


class Faults:
    """Kills and restarts mockers on request, never more than ``max_down`` at once."""

    def __init__(self, cluster: Any, rng: random.Random, max_down: int) -> None:
        self.cluster = cluster
        self.rng = rng
        self.max_down = max_down
        self.down: set[int] = set()
        self.injected = 0
        self.skipped = 0
        self.port_retries = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def inject(self) -> None:
        up = [w for w in self.cluster.workers if w.worker_id not in self.down]
        if len(self.down) >= self.max_down or not up:
            self.skipped += 1
            return
        w = self.rng.choice(up)
        self.down.add(w.worker_id)
        self.injected += 1
        task = asyncio.get_running_loop().create_task(self._restart(w))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _restart(self, w: Any) -> None:
        try:
            # on this (the main) thread: the child's parent-death signal fires when the thread that
            # spawned it ends, and the executor's threads end with asyncio.run
            for attempt in range(5):
                self.cluster.restart_mocker(w)
                try:
                    await asyncio.to_thread(_wait_http, f"{w.url}/health", 90.0, w)
                    break
                except RuntimeError:  # a port still held (another process, or a TCP self-connect of a
                    if attempt == 4:  # client retrying the dead port): start it again a little later
                        raise
                    self.port_retries += 1
                    await asyncio.sleep(1.0)
        finally:
            self.down.discard(w.worker_id)


def _wait_http(url: str, timeout: float, worker: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if worker is not None and not worker.child.alive():
            raise RuntimeError(f"mocker {worker.worker_id} exited:\n{worker.child.log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} not ready after {timeout:g} s")
        time.sleep(0.1)


async def _drive(url: str, n: int, concurrency: int, cancel: float, fault: float, seed: int, faults: Faults) -> Counter:
    """N requests over ``concurrency`` clients; returns outcome counts."""
    systems, words = _prompt_pool(seed)
    rng = random.Random(seed)
    out: Counter = Counter()
    todo = iter(range(n))

    async def one(c: httpx.AsyncClient) -> None:
        stream = rng.random() < 0.8
        body = {
            "model": MODEL,
            "stream": stream,
            "max_tokens": rng.randint(2, 24),
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))},
            ],
        }
        r = rng.random()
        kind = "cancel" if r < cancel else "fault" if r < cancel + fault else "normal"
        cut_chunks = rng.randint(1, 6) if kind == "cancel" and rng.random() < 0.5 else None  # mid-stream
        before_first_byte = kind == "cancel" and cut_chunks is None
        req = c.build_request("POST", f"{url}/v1/chat/completions", json=body)

        async def run() -> str:
            resp = await c.send(req, stream=True)
            try:
                if kind == "fault":
                    faults.inject()
                chunks = 0
                done = False
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        done = done or line == "data: [DONE]"
                        if cut_chunks is not None and chunks >= cut_chunks:
                            return "cancelled_mid_stream"
                    elif not stream and line:
                        done = True
                if cut_chunks is not None:
                    return "cancelled_mid_stream"  # the answer was shorter than the cut: closed at its end
                if resp.status_code != 200:
                    return f"status_{resp.status_code}"
                return "ok" if done else "incomplete"
            finally:
                await resp.aclose()

        if before_first_byte:
            try:
                out[await asyncio.wait_for(run(), timeout=rng.uniform(0.0, 0.05))] += 1
            except TimeoutError:
                out["cancelled_before_first_byte"] += 1
            return
        try:
            out[await run()] += 1
        except httpx.HTTPError as exc:
            out[f"client_error_{type(exc).__name__}"] += 1

    async def client(c: httpx.AsyncClient) -> None:
        for _ in todo:
            await one(c)

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
        if faults.tasks:
            await asyncio.gather(*list(faults.tasks))
    return out


def _gauges(metrics_text: str) -> dict[str, float]:
    """Sum of each of GAUGES over its labels."""
    out = {g: 0.0 for g in GAUGES}
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def index_blocks(dump: dict[str, Any]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """The device-tier blocks of a ``/dump`` per (worker_id, dp_rank): {(block_hash, tokens_hash)}."""
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for part in dump.values():
        for ev in part["events"]:
            if ev.get("storage_tier", "device") != "device":
                continue
            stored = ev["event"]["data"].get("stored")
            if not stored:
                continue
            key = (int(ev["worker_id"]), int(ev["event"]["dp_rank"]))
            out.setdefault(key, set()).update((b["block_hash"], b["tokens_hash"]) for b in stored["blocks"])
    return out


def mocker_blocks(workers: list[Any]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """Every mocker rank's cached blocks, keyed like ``index_blocks``; ranks without blocks omitted."""
    out = {}
    for w in workers:
        for rank in range(w.dp_size):
            snap = httpx.get(f"{w.url}/mocker/kv_blocks", params={"dp_rank": rank}, timeout=30).json()
            blocks = {(b["block_hash"], b["tokens_hash"]) for b in snap["blocks"]}
            if blocks:
                out[(w.worker_id, rank)] = blocks
    return out


def check(cluster: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until the invariants hold or ``timeout`` passes; the last observation either way."""
    url = cluster.frontend_url
    deadline = time.monotonic() + timeout
    while True:
        loads = httpx.get(f"{url}/loads", timeout=10).json()
        busy = [row for row in loads if row["active_prefill_tokens"] or row["active_decode_blocks"]]
        gauges = _gauges(httpx.get(f"{url}/metrics", timeout=10).text)
        health = httpx.get(f"{url}/health", timeout=10).json()
        unhealthy = [i.get("worker_id") for i in health.get("instances", []) if not i.get("healthy")]
        want = mocker_blocks(cluster.workers)
        have = index_blocks(httpx.get(f"{url}/admin/kv_dump", timeout=30).json())
        diff = {
            f"{k[0]}:{k[1]}": {
                "missing": len(want.get(k, set()) - have.get(k, set())),
                "extra": len(have.get(k, set()) - want.get(k, set())),
            }
            for k in set(want) | set(have)
            if want.get(k, set()) != have.get(k, set())
        }
        result = {
            "loads_rows": len(loads),
            "loads_nonzero": busy,
            "gauges": gauges,
            "unhealthy_workers": unhealthy,
            "index_blocks": sum(len(v) for v in have.values()),
            "mocker_blocks": sum(len(v) for v in want.values()),
            "index_diff": diff,
        }
        ok = not busy and not any(gauges.values()) and not unhealthy and not diff and len(loads) == len(cluster.workers)
        result["ok"] = ok
        if ok or time.monotonic() >= deadline:
            return result
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench leak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--cancel", type=float, default=0.10, help="share of requests the client abandons (default %(default)s)"
    )
    p.add_argument(
        "--faults",
        type=float,
        default=0.05,
        help="share of requests that kill and restart a mocker (default %(default)s)",
    )
    p.add_argument("--max-down", type=int, default=1, help="mockers down at once at most (default %(default)s)")
    p.add_argument("--speedup-ratio", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="leak-out")
    args = p.parse_args(argv)
    if (
        args.requests <= 0
        or args.concurrency <= 0
        or not 0 <= args.cancel + args.faults <= 1
        or not 0 < args.max_down < args.workers
    ):
        p.error("need requests > 0, concurrency > 0, 0 <= cancel + faults <= 1, 0 < max-down < workers")

    from kvroute_common.local_cluster import MockerOptions, start_cluster

    os.makedirs(args.out, exist_ok=True)
    opts = MockerOptions(speedup_ratio=args.speedup_ratio, num_gpu_blocks=1024)
    fe_args = ["--log-level", "warning", "--migration-limit", "3"]
    t0 = time.monotonic()
    with start_cluster(args.workers, opts, frontend_args=fe_args, log_dir=os.path.join(args.out, "logs")) as cluster:
        faults = Faults(cluster, random.Random(args.seed + 1), args.max_down)
        outcomes = asyncio.run(
            _drive(
                cluster.frontend_url or "", args.requests, args.concurrency, args.cancel, args.faults, args.seed, faults
            )
        )
        load_s = time.monotonic() - t0
        cluster.wait_workers_ready(90)
        cluster.wait_frontend_ready(MODEL, 90)
        result = check(cluster)
        result["migrations"] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{cluster.frontend_url}/metrics", timeout=10).text.splitlines()
            if line.startswith("dynamo_frontend_model_migration_total{")
        )
        cluster.check_alive()
    report = {
        "args": vars(args),
        "outcomes": dict(sorted(outcomes.items())),
        "faults_injected": faults.injected,
        "faults_skipped_all_restarting": faults.skipped,
        "restart_port_retries": faults.port_retries,
        "load_seconds": round(load_s, 1),
        **result,
        "loadavg": os.getloadavg(),
    }
    with open(os.path.join(args.out, "leak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1), flush=True)
    return 0 if result["ok"] and sum(outcomes.values()) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
