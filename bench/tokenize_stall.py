"""Tiny-request latency through a real frontend while huge prompts are being tokenized.

    python -m bench tokenize_stall                     # inline (before) vs offloaded (after), 3 MB prompts
    python -m bench tokenize_stall --prompt-mb 3 --big 4 --modes offload

Starts two mockers and a kv-mode frontend per mode (``inline`` = ``--tokenizer-offload-chars 0``,
every prompt tokenized on the event loop; ``offload`` = the default threshold), then sends huge chat
prompts (fresh random words, so the tokenizer caches do not help) one after another while a client
sends tiny chat requests open loop (a fixed rate, whatever the answers do, so a stall delays every
request sent during it). Reports the tiny requests' latency while a huge prompt is in
flight (goal: p99 < 50 ms) and, for reference, with nothing else running. The mocker rejects the
huge prompts (longer than its context, as vLLM would) after tokenizing them: the frontend's whole
path (read, tokenize, hash, route, book, dispatch) runs for each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from bench.report import emit

MODEL = "kvroute-demo"


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _summary(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(_pct(ms, 50), 1),
        "p90": round(_pct(ms, 90), 1),
        "p99": round(_pct(ms, 99), 1),
        "max": round(max(ms), 1),
        "mean": round(statistics.fmean(ms), 1),
    }


def big_text(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(20000)]
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


async def _one_tiny(client, i: int, out: list[tuple[float, float]]) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {i}"}]}
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"tiny request failed: {r.status_code} {r.text[:200]}")
    out.append((t0, (time.perf_counter() - t0) * 1e3))


async def _tiny_open_loop(client, interval: float, out: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """One tiny request every ``interval`` seconds whatever the answers do (open loop: a stalled
    frontend delays every request sent during the stall, so the percentiles see it)."""
    tasks = []
    i = 0
    loop = asyncio.get_running_loop()
    next_t = loop.time()
    while not stop.is_set():
        i += 1
        tasks.append(asyncio.create_task(_one_tiny(client, i, out)))
        next_t += interval
        await asyncio.sleep(max(0.0, next_t - loop.time()))
    await asyncio.gather(*tasks)


async def _run_mode(url: str, prompt_chars: int, n_big: int, rate: float, idle_secs: float) -> dict:
    import httpx

    bodies = [
        json.dumps(
            {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": big_text(prompt_chars, k)}]}
        ).encode()
        for k in range(n_big)
    ]
    samples: list[tuple[float, float]] = []  # (sent at, latency ms)
    windows: list[tuple[float, float]] = []  # huge prompt in flight: [start, end)
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with (
        httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as tiny,
        httpx.AsyncClient(base_url=url, timeout=300.0) as big,
    ):
        for i in range(20):  # warm the connections and caches
            await _one_tiny(tiny, -i, [])
        sender = asyncio.create_task(_tiny_open_loop(tiny, 1.0 / rate, samples, stop))
        await asyncio.sleep(idle_secs)  # a baseline with nothing else running (benchmark pacing, not synchronisation)
        big_ms = []
        statuses = []
        for body in bodies:
            t0 = time.perf_counter()
            r = await big.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            t1 = time.perf_counter()
            windows.append((t0, t1))
            big_ms.append((t1 - t0) * 1e3)
            statuses.append(r.status_code)
        stop.set()
        await sender
    busy = [ms for t, ms in samples if any(a <= t < b for a, b in windows)]
    idle = [ms for t, ms in samples if t < windows[0][0]] if windows else [ms for _, ms in samples]
    return {
        "tiny_while_big_in_flight_ms": _summary(busy),
        "tiny_idle_ms": _summary(idle),
        "big_request_ms": _summary(big_ms),
        "big_statuses": sorted(set(statuses)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench tokenize_stall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-mb", type=float, default=3.0, help="size of each huge prompt in MB of text [3]")
    ap.add_argument("--big", type=int, default=4, help="huge prompts per mode, sent one after another [4]")
    ap.add_argument("--rate", type=float, default=50.0, help="tiny requests per second, sent open loop [50]")
    ap.add_argument("--idle-secs", type=float, default=2.0, help="baseline window before the first huge prompt [2]")
    ap.add_argument("--modes", default="inline,offload", help="comma-separated: inline, offload [both]")
    ap.add_argument("--offload-chars", type=int, default=None, help="threshold for the offload mode [frontend default]")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)

    from kvroute_common.local_cluster import MockerOptions, start_cluster

    chars = int(args.prompt_mb * 1_000_000)
    result: dict = {"prompt_chars": chars, "big_prompts": args.big, "tiny_rate_per_s": args.rate, "modes": {}}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode == "inline":
            fe_args = ["--tokenizer-offload-chars", "0"]
        elif mode == "offload":
            fe_args = [] if args.offload_chars is None else ["--tokenizer-offload-chars", str(args.offload_chars)]
        else:
            print(f"unknown mode {mode!r}", file=sys.stderr)
            return 2
        opts = MockerOptions(speedup_ratio=0.0, num_gpu_blocks=8192)
        cluster = start_cluster(2, opts, "kv", frontend_args=fe_args + ["--log-level", "warning"])
        try:
            assert cluster.frontend_url is not None  # start_cluster waits for the frontend
            r = asyncio.run(_run_mode(cluster.frontend_url, chars, args.big, args.rate, args.idle_secs))
        finally:
            cluster.stop()
        result["modes"][mode] = r
        print(f"{mode}: {json.dumps(r)}", flush=True)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
