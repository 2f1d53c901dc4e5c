"""CPU cost of the mocker under load: ``python -m mocker.bench`` (writes nothing; prints JSON).

Starts ``--mockers`` mocker processes (``--dp`` ranks each) on free loopback ports, measures
their idle CPU, then drives ``--concurrency`` streaming completions per mocker (shared-prefix
prompts, fixed output length with ``ignore_eos``) and reports the mockers' CPU use (process CPU
seconds per wall second, from /proc) next to the token throughput and TTFTs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

from kvroute_common.ports import free_port, free_port_block


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, rank: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    ttft = None
    n = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream(
        "POST", url + "/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)}
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                n += 1
    return ttft or 0.0, n


async def _load(urls: list[str], dp: int, concurrency: int, requests: int, prompt_words: int, max_tokens: int) -> dict:
    # no keep-alive reuse: uvicorn closes idle connections after 5 s (vLLM's default too), which
    # races with a pooled connection being picked up again
    limits = httpx.Limits(max_connections=concurrency * len(urls) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency * len(urls))
        prefix = " ".join(f"shared{i}" for i in range(prompt_words // 2))

        async def one(i: int):
            async with sem:
                prompt = prefix + " " + " ".join(f"u{i}w{j}" for j in range(prompt_words // 2))
                return await _stream(client, urls[i % len(urls)], prompt, max_tokens, (i // len(urls)) % dp)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    chunks = sum(r[1] for r in results)
    return {
        "wall_s": round(wall, 2),
        "stream_chunks": chunks,
        "chunks_per_s": round(chunks / wall, 1),
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1),
        "ttft_p90_ms": round(ttfts[int(len(ttfts) * 0.9)] * 1000, 1),
    }


def bench_tokenizer(rounds: int = 20) -> dict:
    """Cost of tokenising an ~8k-token chat prompt (32 KB of English docs text) with the built-in
    tokenizer: HF encode vs the cached fast encoder (cold, warm pieces, repeated segment)."""
    import sysconfig
    from statistics import median

    from kvroute_common.tokenizer import chat_prompt_token_ids, load_tokenizer, prompt_encoder, render_chat_prompt

    tok = load_tokenizer(None)
    enc = prompt_encoder(tok)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py"), encoding="utf-8") as fh:
        corpus = fh.read()
    texts = [corpus[o : o + 32768] for o in range(100_000, 100_000 + 33_000 * rounds, 33_000)]

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1000

    msgs = [[{"role": "system", "content": "You are helpful."}, {"role": "user", "content": t}] for t in texts]
    rendered = [render_chat_prompt(tok, m) for m in msgs]
    hf = [timed(lambda r=r: tok(r, add_special_tokens=False)) for r in rendered]
    render = [timed(lambda m=m: render_chat_prompt(tok, m)) for m in msgs]
    cold = [timed(lambda m=m: chat_prompt_token_ids(tok, m)) for m in msgs]  # unseen texts, piece cache growing
    warm = []
    for m in msgs:
        enc._segments.clear()
        warm.append(timed(lambda m=m: chat_prompt_token_ids(tok, m)))
    repeat = []
    for m in msgs:
        chat_prompt_token_ids(tok, m)
        repeat.append(timed(lambda m=m: chat_prompt_token_ids(tok, m)))
    n_tokens = len(chat_prompt_token_ids(tok, msgs[0]))
    return {
        "prompt_tokens": n_tokens,
        "prompt_bytes": len(rendered[0].encode()),
        "hf_encode_ms_p50": round(median(hf), 2),
        "render_ms_p50": round(median(render), 3),
        "fast_cold_ms_p50": round(median(cold), 2),
        "fast_warm_pieces_ms_p50": round(median(warm), 2),
        "fast_repeated_segment_ms_p50": round(median(repeat), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", action="store_true", help="only measure the built-in tokenizer's prompt cost")
    p.add_argument("--mockers", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32, help="concurrent streams per mocker")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--speedup-ratio", type=float, default=1.0)
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument("--log-dir", default=None, help="keep the mockers' logs here")
    args = p.parse_args(argv)
    if args.tokenizer:
        print(json.dumps(bench_tokenizer()))
        return 0

    procs, urls = [], []
    try:
        for _ in range(args.mockers):
            port, pub, rep = free_port(), free_port_block(args.dp), free_port_block(args.dp)
            cmd = [
                sys.executable,
                "-m",
                "mocker",
                "--port",
                str(port),
                "--data-parallel-size",
                str(args.dp),
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{pub}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{rep}",
                "--speedup-ratio",
                str(args.speedup_ratio),
            ]
            log = open(os.path.join(args.log_dir, f"mocker-{port}.log"), "wb") if args.log_dir else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        for url in urls:
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} did not start")
                time.sleep(0.1)
        c0 = sum(_cpu_seconds(pr.pid) for pr in procs)
        time.sleep(args.idle_seconds)
        idle = (sum(_cpu_seconds(pr.pid) for pr in procs) - c0) / args.idle_seconds
        c0 = sum(_cpu_seconds(pr.pid) for pr in procs)
        t0 = time.perf_counter()
        load = asyncio.run(_load(urls, args.dp, args.concurrency, args.requests, args.prompt_words, args.max_tokens))
        busy = (sum(_cpu_seconds(pr.pid) for pr in procs) - c0) / (time.perf_counter() - t0)
        out = {
            "mockers": args.mockers,
            "dp": args.dp,
            "concurrency_per_mocker": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "speedup_ratio": args.speedup_ratio,
            "idle_cpu_cores": round(idle, 3),
            "load_cpu_cores": round(busy, 3),
            **load,
        }
        print(json.dumps(out))
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
