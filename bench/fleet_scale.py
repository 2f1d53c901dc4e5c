"""Fleet scale on one machine: what remote and sharded indexing cost and what a shard holds.

    python -m bench fleet_scale                                   # all parts
    python -m bench fleet_scale --parts fleet --workers 1000 --shards 4 --rate 40

Parts (docs/scale.md turns them into a capacity model):

* ``decision``: the latency a routing decision adds with the index embedded in the frontend, in one
  remote indexer, and in two shards: ``POST /admin/route`` (tokenize, look up overlaps, score;
  nothing booked) for a 1024-token prompt on a kv frontend over two mockers, client-side p50/p99,
  the three frontends measured in alternating rounds over the same event streams.
* ``fleet``: ``--workers`` simulated workers, each publishing ``--rate`` blocks/s in batches of
  ``--batch`` (a new block chain per worker, old chains removed so the index stays bounded), spread
  over ``--shards`` standalone indexers partitioned by worker id. Each batch carries its publish time;
  every shard exports per worker the delay from publishing its newest batch to applying it
  (``kvroute_kv_index_lag_seconds``), sampled every 0.5 s: the index lag p50 / p99 / max, and each
  shard's CPU share. Publishers are separate processes hosting many sockets each (cheap workers).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

import httpx

from bench.report import emit
from kvroute_common.ports import free_port, free_port_block, free_ports
from kvroute_common.processes import service, wait_until

BS = 16
MODEL = "fleet"


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _indexer(port: int, workers: str = "") -> list[str]:
    args = ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BS)]
    args += ["--model-name", MODEL, "--log-level", "warning"]
    return args + (["--workers", workers] if workers else [])


# ---------------------------------------------------------------------------------------------
# simulated workers


def _publisher_main(ports: list[int], first_id: int, rate: float, batch: int, duration: float, go: Any) -> None:
    """Simulated workers on ``ports`` (ids first_id..): each publishes ``rate`` blocks/s in batches of
    ``batch`` new blocks below its previous ones, and removes its chain every 64 batches."""
    import random

    import zmq

    from indexer.wire import BlockRemoved, BlockStored, encode_batch, seq_frame

    ctx = zmq.Context()
    socks = []
    n = len(ports)
    for port in ports:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    rng = random.Random(first_id)
    seqs = [0] * n
    chains: list[list[int]] = [[] for _ in range(n)]
    tokens = [rng.randrange(1, 30000) for _ in range(batch * BS)]
    interval = batch / rate  # seconds between one worker's batches
    go.wait()  # every worker is registered on its shard
    start_at = time.time() + 0.5
    # each worker sends on its own phase, so the fleet's batches spread over the interval
    next_at = [start_at + interval * i / n for i in range(n)]
    end = start_at + duration
    while True:
        now = time.time()
        if now >= end:
            break
        i = next_at.index(min(next_at))
        wait = next_at[i] - now
        if wait > 0:
            time.sleep(min(wait, 0.005))
            continue
        chain = chains[i]
        events: list[Any] = []
        if len(chain) >= 64 * batch:
            events.append(BlockRemoved(chain, None))
            chain = chains[i] = []
        new = [rng.getrandbits(63) for _ in range(batch)]
        events.append(BlockStored(new, chain[-1] if chain else None, tokens, BS, None, None, None))
        chain.extend(new)
        payload = encode_batch(events, None)  # stamped with the publish time
        socks[i].send_multipart([b"", seq_frame(seqs[i]), payload])
        seqs[i] += 1
        next_at[i] += interval
    time.sleep(1.0)
    for s in socks:
        s.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------------------------------------
# fleet


def _lag_samples(url: str) -> list[float]:
    out = []
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("kvroute_kv_index_lag_seconds{"):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def _batches_applied(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("kvroute_kv_event_batches_applied_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def fleet(n_workers: int, n_shards: int, rate: float, batch: int, duration: float, publishers: int) -> dict[str, Any]:
    """``n_workers`` simulated workers over ``n_shards`` indexers; index lag and CPU per shard."""
    import contextlib

    ports = free_ports(n_workers)
    per_pub = -(-n_workers // publishers)
    shards = []
    with contextlib.ExitStack() as stack:
        for _ in range(n_shards):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = stack.enter_context(service(_indexer(port), ready_url=f"{url}/health", timeout=60))
            shards.append((url, proc))
        mp = multiprocessing.get_context("spawn")
        go = mp.Event()
        procs = []
        for p in range(publishers):
            first = p * per_pub
            n = min(per_pub, n_workers - first)
            if n <= 0:
                break
            args = (ports[first : first + n], first + 1, rate, batch, duration, go)
            pr = mp.Process(target=_publisher_main, args=args, daemon=True)
            pr.start()
            procs.append(pr)
        # partition by worker id: worker w goes to shard w % n_shards
        for w in range(n_workers):
            url = shards[w % n_shards][0]
            body = {
                "instance_id": w + 1,
                "endpoint": f"tcp://127.0.0.1:{ports[w]}",
                "model_name": MODEL,
                "block_size": BS,
            }
            r = httpx.post(f"{url}/register", json=body, timeout=30)
            assert r.status_code == 201, r.text
        go.set()
        start_at = time.time() + 0.5
        while time.time() < start_at + 2.0:  # the first seconds: subscriptions settling, not measured
            time.sleep(0.1)
        cpu0 = [_cpu_s(proc.pid) for _, proc in shards]
        batches0 = [_batches_applied(url) for url, _ in shards]
        t0 = time.time()
        lags: list[float] = []
        if t0 > start_at + duration - 1.0:
            raise RuntimeError("the shards answered /metrics too late to measure anything (overloaded)")
        while time.time() < start_at + duration - 0.5:
            for url, _ in shards:
                lags += _lag_samples(url)
            time.sleep(0.5)
        t1 = time.time()
        cpu1 = [_cpu_s(proc.pid) for _, proc in shards]
        batches1 = [_batches_applied(url) for url, _ in shards]
        for pr in procs:
            pr.join(timeout=duration + 30)
    secs = t1 - t0
    return {
        "workers": n_workers,
        "shards": n_shards,
        "blocks_per_s_per_worker": rate,
        "batch_blocks": batch,
        "offered_blocks_per_s": n_workers * rate,
        # every batch stores ``batch`` new blocks
        "applied_blocks_per_s": round(sum(b1 - b0 for b0, b1 in zip(batches0, batches1, strict=True)) * batch / secs),
        "shard_cpu_share": [round((c1 - c0) / secs, 2) for c0, c1 in zip(cpu0, cpu1, strict=True)],
        "lag_ms": {
            "samples": len(lags),
            "p50": round(_pct(lags, 50) * 1e3, 1),
            "p99": round(_pct(lags, 99) * 1e3, 1),
            "max": round(max(lags) * 1e3, 1) if lags else None,
        },
        "load_average": os.getloadavg(),
    }


# ---------------------------------------------------------------------------------------------
# decision latency


def decision(requests: int, rounds: int) -> dict[str, Any]:
    """``/admin/route`` latency with the index embedded, remote (one indexer) and sharded (two)."""
    import contextlib

    from kvroute_common.tokenizer import encode_text, load_tokenizer

    tok = load_tokenizer(None)
    words = "route the request to the worker that holds its prefix and keep the load even ".split()
    text = " ".join(words[i % len(words)] + str(i % 89) for i in range(700))
    n = len(encode_text(tok, text))
    prompt = text if n <= 1024 else tok.decode(encode_text(tok, text)[:1024])
    with contextlib.ExitStack() as stack:
        mockers, events = [], []
        for _ in range(2):
            port, kv = free_port(), free_port_block(1)
            args = ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
            args += ["--block-size", str(BS), "--kv-events-endpoint", f"tcp://*:{kv}", "--replay-endpoint", ""]
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(service(args, ready_url=f"{url}/v1/models", timeout=60))
            mockers.append(url)
            events.append(f"tcp://127.0.0.1:{kv}")
        shard_urls = []
        for s in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(service(_indexer(port, f"{s + 1}={events[s]}"), ready_url=f"{url}/health", timeout=60))
            shard_urls.append(url)

        def frontend(specs: list[str], *flags: str) -> str:
            port = free_port()
            args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv"]
            for spec in specs:
                args += ["--worker", spec]
            args += ["--log-level", "warning", *flags]
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(service(args, ready_url=f"{url}/health", timeout=60))
            return url

        with_events = [
            f"id={i + 1},url={u},kv_events_endpoint={e}" for i, (u, e) in enumerate(zip(mockers, events, strict=True))
        ]
        by_url = [f"id={i + 1},url={u}" for i, u in enumerate(mockers)]
        modes = {
            "embedded": frontend(with_events),
            "remote (1 indexer)": frontend(by_url, "--use-remote-indexer", shard_urls[0]),
            "sharded (2 indexers)": frontend(by_url, "--use-remote-indexer", ",".join(shard_urls)),
        }
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        with httpx.Client(timeout=30) as c:
            c.post(f"{mockers[0]}/v1/completions", json=body)

            def overlap_seen(u: str) -> bool:
                return max(x["overlap_blocks"] for x in c.post(f"{u}/admin/route", json=body).json()["candidates"]) > 0

            for url in modes.values():  # the prompt is cached on worker 1: every mode finds the overlap
                wait_until(functools.partial(overlap_seen, url), 30, what="overlap visible")
            samples: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(rounds):
                for mode, url in modes.items():
                    for _ in range(requests):
                        t = time.perf_counter()
                        r = c.post(f"{url}/admin/route", json=body)
                        samples[mode].append((time.perf_counter() - t) * 1e3)
                        assert r.status_code == 200
    return {
        "prompt_tokens": min(n, 1024),
        "requests_per_mode": requests * rounds,
        "modes": {
            m: {"p50_ms": round(statistics.median(v), 3), "p99_ms": round(_pct(v, 99), 3)} for m, v in samples.items()
        },
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench fleet_scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default="decision,fleet", help="comma-separated: decision, fleet")
    ap.add_argument("--workers", type=int, default=1000, help="simulated workers in the fleet part [1000]")
    ap.add_argument("--shards", type=int, default=4, help="indexer shards in the fleet part [4]")
    ap.add_argument("--rate", type=float, default=40.0, help="blocks/s each simulated worker stores [40]")
    ap.add_argument("--batch", type=int, default=8, help="blocks per published batch [8]")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of publishing [20]")
    ap.add_argument("--publishers", type=int, default=2, help="publisher processes hosting the workers [2]")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    result: dict[str, Any] = {"load_average_before": os.getloadavg()}
    if "decision" in parts:
        result["decision"] = r = decision(200, 3)
        print(f"decision: {json.dumps(r)}", flush=True)
    if "fleet" in parts:
        result["fleet"] = r = fleet(args.workers, args.shards, args.rate, args.batch, args.duration, args.publishers)
        print(f"fleet: {json.dumps(r)}", flush=True)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
