"""What an engine saves when it is given a prompt's token ids instead of its text (``--send-token-ids``).

    python -m bench token_ids                       # two mockers, 240 agentic-dense prompts
    python -m bench token_ids --engines vllm        # two vLLM CPU engines (KVROUTE_VLLM_PYTHON), tiny model

Two fresh engines of the same kind; every prompt of the ``agentic-dense`` sessions goes, one request at a
time, as text to one engine and as the same prompt's ids to the other (which engine goes first alternates
per prompt, so both see the same sequence and hold the same cache), with ``--gap-ms`` idle before each
request. Reported: each side's TTFT p50 / p90 as the client sees it. No router is involved: this is the
engine's own tokenization, the part of a request ``--send-token-ids`` takes off the engine.
Nothing here asserts: benchmarks measure. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace

import httpx

from bench.replay import RequestResult, send_one
from bench.sessions import WORKLOADS, Workload, session_trace
from bench.traces import TraceRequest
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions

MAX_PROMPT_TOKENS = 4000  # the vLLM engines' context is 4,096 tokens


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def alternate(
    text_url: str, ids_url: str, model: str, requests: Sequence[TraceRequest], gap_s: float, output_tokens: int
) -> dict[str, list[float]]:
    """Every prompt to both engines, text to one and ids to the other; TTFT in ms per side."""
    out: dict[str, list[float]] = {"text": [], "ids": []}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for i, req in enumerate(requests):
            sides = [("text", text_url), ("ids", ids_url)]
            for side, url in sides if i % 2 else sides[::-1]:
                await asyncio.sleep(gap_s)
                res = RequestResult(i, 0.0)
                if side == "text":
                    await send_one(client, url, model, [], output_tokens, res, text=req.text)
                else:
                    await send_one(client, url, model, list(req.tokens), output_tokens, res)
                if not res.ok or res.ttft_s is None:
                    raise RuntimeError(f"request {i} ({side}) failed: {res.error}")
                out[side].append(res.ttft_s * 1e3)
    return out


def report(ttft: dict[str, list[float]], engines: str, n: int) -> str:
    lines = [
        f"{n} prompts, one at a time, on two fresh {engines} engines",
        "",
        "| prompt sent as | TTFT p50 ms | p90 ms |",
    ]
    lines.append("| --- | --- | --- |")
    for side in ("text", "ids"):
        v = ttft[side]
        lines.append(f"| {side} | {percentile(v, 0.5):.2f} | {percentile(v, 0.9):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench token_ids", description=__doc__.split("\n")[0])
    p.add_argument("--engines", choices=("mocker", "vllm"), default="mocker")
    p.add_argument("--requests", type=int, default=240, help="prompts (each sent twice: text and ids)")
    p.add_argument("--gap-ms", type=float, default=3.0, help="idle before each request")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    base = WORKLOADS["agentic-dense"]
    groups = tuple(replace(g, api="completions", output_tokens=args.output_tokens) for g in base.groups)
    trace = session_trace(Workload(base.name, groups), seed=args.seed)
    requests = [r for r in trace.requests if r.text is not None and len(r.tokens) < MAX_PROMPT_TOKENS]
    requests = requests[: args.requests]
    gap = args.gap_ms / 1000
    if args.engines == "mocker":
        with Cluster(log_dir=tempfile.mkdtemp(prefix="token-ids-")) as cluster:
            opts = MockerOptions(speedup_ratio=4, num_gpu_blocks=4096, block_size=32)
            text, ids = cluster.start_mocker(opts), cluster.start_mocker(opts)
            cluster.wait_workers_ready(60)
            ttft = asyncio.run(alternate(text.url, ids.url, DEFAULT_MODEL, requests, gap, args.output_tokens))
    else:
        from kvroute_common.real_engines.vllm_cpu import SERVED_NAME, VllmEngine, start_engines, write_tiny_model

        python = os.environ.get("KVROUTE_VLLM_PYTHON")
        if not python:
            print("set KVROUTE_VLLM_PYTHON (bash .ci/vllm-venv creates the environment and prints it)", file=sys.stderr)
            return 2
        model = write_tiny_model(python, tempfile.mkdtemp(prefix="token-ids-model-"))
        engines = [VllmEngine(python, model), VllmEngine(python, model)]
        start_engines(engines)
        try:
            urls = (engines[0].url, engines[1].url)
            ttft = asyncio.run(alternate(*urls, SERVED_NAME, requests, gap, args.output_tokens))
        finally:
            for e in engines:
                e.stop()
    print(report(ttft, args.engines, len(requests)))
    return 0
