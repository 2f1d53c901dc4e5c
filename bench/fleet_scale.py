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
  every shard counts the delay from publishing each batch to applying it in its apply-lag histogram
  (``kvroute_kv_index_apply_lag_seconds``), read before and after: the index lag p50 / p99 / p99.9
  over every batch, the most batches found waiting on one worker's socket, and each shard's CPU
  share. Publishers are separate processes hosting many sockets each (cheap workers).
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
from indexer.lag import BUCKETS, quantile
from indexer.lag import NAME as LAG
from kvroute_common.ports import free_port, free_port_block, free_ports
from kvroute_common.processes import service, wait_until

BS = 16
MODEL = "fleet"
BOUNDS = [*BUCKETS, float("inf")]


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


class _StoredTemplate:
    """The payload of a batch storing ``batch`` blocks below a parent, encoded once with placeholder
    values, then stamped per send (publish time, block hashes, parent) at their byte offsets.

    Why: encoding a batch of a few hundred token ids per send made the publisher process cost about
    as much CPU as a shard, on a 2-core machine where the shards are what is measured. msgpack
    writes a float as 0xcb + 8 bytes and an integer >= 2**32 as 0xcf + 8 bytes, so the stamped
    payload is byte for byte what encoding those values gives (checked in ``__init__``).
    """

    TS = 1234567.0078125
    MARK = 0x7E5A_0000_0000_0000

    def __init__(self, batch: int, tokens: list[int]) -> None:
        import struct

        from indexer.wire import BlockStored, encode_batch

        self.batch = batch
        hashes = [self.MARK + k for k in range(batch)]
        parent = self.MARK + batch
        stored = BlockStored(hashes, parent, tokens, BS, None, None, None)
        self.template = encode_batch([stored], None, ts=self.TS)
        self.ts_at = self.template.index(b"\xcb" + struct.pack(">d", self.TS)) + 1
        self.hashes_at = self.template.index(b"\xcf" + struct.pack(">Q", hashes[0])) + 1
        self.parent_at = self.template.index(b"\xcf" + struct.pack(">Q", parent)) + 1
        self.hashes_fmt = struct.Struct(">" + "QB" * (batch - 1) + "Q")  # 9 bytes apart: 0xcf, value
        self.q = struct.Struct(">Q")
        self.d = struct.Struct(">d")
        probe_hashes = [(1 << 62) + k for k in range(batch)]
        expect = encode_batch([BlockStored(probe_hashes, 1 << 62, tokens, BS, None, None, None)], None, ts=2.5)
        assert self.payload(probe_hashes, 1 << 62, 2.5) == expect, "the stamped payload differs from encoding"

    def payload(self, hashes: list[int], parent: int, ts: float) -> bytes:
        buf = bytearray(self.template)
        self.d.pack_into(buf, self.ts_at, ts)
        self.q.pack_into(buf, self.parent_at, parent)
        args: list[int] = []
        for h in hashes[:-1]:
            args += (h, 0xCF)
        args.append(hashes[-1])
        self.hashes_fmt.pack_into(buf, self.hashes_at, *args)
        return bytes(buf)


def _publisher_main(ports: list[int], first_id: int, rate: float, batch: int, duration: float, go: Any) -> None:
    """Simulated workers on ``ports`` (ids first_id..): each publishes ``rate`` blocks/s in batches of
    ``batch`` new blocks below its previous ones, and removes its chain every 64 batches. The removals
    are staggered (worker i's first chain is i % 64 batches shorter): removals that all workers make
    at once would be a burst no engine fleet sends. Block hashes are unique per worker (>= 2**62)."""
    import heapq
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
    next_hash = [(1 << 62) + ((first_id + i) << 36) for i in range(n)]
    tokens = [rng.randrange(1, 30000) for _ in range(batch * BS)]
    template = _StoredTemplate(batch, tokens)
    interval = batch / rate  # seconds between one worker's batches
    go.wait()  # every worker is registered on its shard
    start_at = time.time() + 0.5
    # each worker sends on its own phase, so the fleet's batches spread over the interval
    due = [(start_at + interval * i / n, i) for i in range(n)]
    heapq.heapify(due)
    end = start_at + duration
    while True:
        now = time.time()
        if now >= end:
            break
        at, i = due[0]
        if at > now:
            time.sleep(min(at - now, 0.005))
            continue
        chain = chains[i]
        first = next_hash[i]
        new = list(range(first, first + batch))
        next_hash[i] = first + batch
        if chain and (seqs[i] + i) % 64 != 0:
            payload = template.payload(new, chain[-1], now)  # the common case: stamped, not encoded
        else:
            events: list[Any] = [BlockRemoved(chain, None)] if chain else []
            chain = chains[i] = []
            events.append(BlockStored(new, None, tokens, BS, None, None, None))
            payload = encode_batch(events, None, ts=now)
        chain.extend(new)
        socks[i].send_multipart([b"", seq_frame(seqs[i]), payload])
        seqs[i] += 1
        heapq.heapreplace(due, (at + interval, i))
    time.sleep(1.0)
    for s in socks:
        s.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------------------------------------
# fleet


def _scrape(url: str) -> dict[str, Any]:
    """What the fleet part reads from one shard's /metrics: batches applied, the most batches waiting
    on any worker's socket, and the apply-lag histogram's per-bucket counts."""
    applied, waiting, cumulative = 0.0, 0.0, []
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("kvroute_kv_event_batches_applied_total{"):
            applied += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvroute_kv_event_batches_waiting{"):
            waiting = max(waiting, float(line.rsplit(" ", 1)[1]))
        elif line.startswith(LAG + "_bucket{"):
            cumulative.append(float(line.rsplit(" ", 1)[1]))
    counts = [c - p for p, c in zip([0.0, *cumulative], cumulative[:], strict=False)]
    return {"applied": applied, "waiting": waiting, "lag_counts": counts}


def _lag_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[float]:
    """Per-bucket counts of the batches applied between two scrapes of every shard."""
    return [
        sum(b["lag_counts"][k] - a["lag_counts"][k] for a, b in zip(before, after, strict=True))
        for k in range(len(BOUNDS))
    ]


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
        pub0 = [_cpu_s(pr.pid) for pr in procs if pr.pid is not None]
        scraped0 = [_scrape(url) for url, _ in shards]
        t0 = time.time()
        if t0 > start_at + duration - 1.0:
            raise RuntimeError("the shards answered /metrics too late to measure anything (overloaded)")
        waiting: list[float] = []
        windows: list[float] = []  # the lag p99 of each 2 s window: a transient shows here
        prev = scraped0
        while time.time() < start_at + duration - 0.5:  # a light look at the backlog every 2 s
            time.sleep(2.0)
            now = [_scrape(url) for url, _ in shards]
            waiting += [x["waiting"] for x in now]
            windows.append(round(quantile(0.99, BOUNDS, _lag_delta(prev, now)) * 1e3, 1))
            prev = now
        t1 = time.time()
        cpu1 = [_cpu_s(proc.pid) for _, proc in shards]
        pub1 = [_cpu_s(pr.pid) for pr in procs if pr.pid is not None]
        last = [_scrape(url) for url, _ in shards]
        for pr in procs:
            pr.join(timeout=duration + 30)
    secs = t1 - t0
    lag_counts = _lag_delta(scraped0, last)  # every batch applied between the two scrapes, over all shards
    return {
        "workers": n_workers,
        "shards": n_shards,
        "blocks_per_s_per_worker": rate,
        "batch_blocks": batch,
        "offered_blocks_per_s": n_workers * rate,
        # every batch stores ``batch`` new blocks
        "applied_blocks_per_s": round(
            sum(b["applied"] - a["applied"] for a, b in zip(scraped0, last, strict=True)) * batch / secs
        ),
        "shard_cpu_share": [round((c1 - c0) / secs, 2) for c0, c1 in zip(cpu0, cpu1, strict=True)],
        "publisher_cpu_share": [round((c1 - c0) / secs, 2) for c0, c1 in zip(pub0, pub1, strict=True)],
        # from the shards' apply-lag histograms: every batch, interpolated inside its bucket
        "lag_ms": {
            "batches": int(sum(lag_counts)),
            "p50": round(quantile(0.50, BOUNDS, lag_counts) * 1e3, 1),
            "p99": round(quantile(0.99, BOUNDS, lag_counts) * 1e3, 1),
            "p999": round(quantile(0.999, BOUNDS, lag_counts) * 1e3, 1),
            "over_100ms_share": round(sum(lag_counts[BOUNDS.index(0.1) + 1 :]) / max(1.0, sum(lag_counts)), 5),
        },
        "lag_p99_ms_per_2s_window": windows,
        "max_batches_waiting": max(waiting, default=None),
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
