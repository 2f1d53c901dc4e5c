"""Real-engine rows: the built-in multi-turn workload through kvroute to vLLM CPU engines, per router mode.

The mocker benchmark (``python -m bench replay``) measures routing against simulated engines; this one
checks the same claims against real ones: vLLM's CPU build (``KVROUTE_VLLM_PYTHON``) serving the tiny
random-weight Llama (kvroute_common/real_engines), with its own prefix cache, scheduler and KV events.

The engines start once (about two minutes for four on two cores). Before every mode each engine's
prefix cache is emptied with vLLM's ``POST /reset_prefix_cache`` (served with ``VLLM_SERVER_DEV_MODE=1``;
vLLM documents it for benchmarking: every block loses its hash, and the engine publishes
AllBlocksCleared) and a fresh frontend starts, so no mode inherits another's cache or index, and every
mode replays the identical schedule. A warm-up on the engines directly (prompts unrelated to the
schedule, then a reset) keeps the first mode from paying vLLM's first-request costs. The schedule,
the replay, the counters (``vllm:prefix_cache_hits / queries`` deltas summed over the engines), the
oracle and the report are bench/replay.py's and bench/synthetic.py's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import FrameType

import httpx
import numpy as np

from bench.replay import (
    ModeSpec,
    RunOptions,
    add_synthetic_args,
    build_trace,
    failed_row,
    gpu_blocks_for,
    load_avg,
    markdown_report,
    measure,
    mode_rows,
    read_counter,
    verdict,
    write_outputs,
)
from bench.synthetic import SyntheticConfig
from bench.traces import VOCAB_HIGH, VOCAB_LOW, Trace, distinct_blocks, oracle, pooled_lru_hits
from kvroute_common.local_cluster import Child, Cluster, Worker
from kvroute_common.real_engines import vllm_cpu
from kvroute_common.real_engines.tiny_model import CONFIG as TINY_CONFIG
from kvroute_common.real_engines.vllm_cpu import SERVED_NAME, VllmEngine

DEFAULT_MODES = ("kv", "latency", "round_robin")
# Sized so that one command (4 engines on 2 cores, three modes) takes about 10-15 minutes: the same
# shape as the mocker workload (4 shared system prompts, every turn repeats the whole conversation),
# shorter messages and fewer sessions, and enough think time that round_robin's extra prefill does not
# pile up into an ever-growing queue (which would measure the backlog, not the routing).
WORKLOAD = SyntheticConfig(
    sessions=32,
    turns=8,
    system_prompts=4,
    system_tokens=1024,
    user_tokens=256,
    reply_tokens=256,
    output_tokens=8,
    start_window_s=90.0,
    think_s=4.0,
    think_min_s=2.0,
)
MODEL_POSITIONS = int(TINY_CONFIG["max_position_embeddings"])  # vLLM refuses a longer max_model_len
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # serves POST /reset_prefix_cache
RESET_TIMEOUT = 120.0
FRONTEND_COUNTERS = (
    "kvroute_kv_events_received",
    "kvroute_router_prompt_tokens",
    "kvroute_router_captured_cached_tokens",
    "kvroute_router_delivered_cached_tokens",
    "kvroute_hash_parity_mismatch",
)


# -- engines ----------------------------------------------------------------------------------------
def engine_workers(engines: Sequence[VllmEngine]) -> list[Worker]:
    """The engines as the local cluster's workers, so its frontend start and readiness check (every
    worker healthy in the frontend's view) apply unchanged; the cluster never stops them."""
    workers = []
    for i, e in enumerate(engines, 1):
        assert e.proc is not None, "start the engines first"
        workers.append(
            Worker(i, e.url, e.dp_size, e.kv_endpoint(), e.replay_endpoint(), Child(f"vllm-{i}", e.proc, e.log_path))
        )
    return workers


def reset_caches(engines: Sequence[VllmEngine], timeout: float = RESET_TIMEOUT) -> None:
    """Empty every engine's prefix cache; vLLM refuses while a request still holds blocks, so retry."""
    deadline = time.monotonic() + timeout
    for e in engines:
        while True:
            r = httpx.post(f"{e.url}/reset_prefix_cache", timeout=30.0)
            if r.status_code == 200 and r.json().get("success"):
                break
            if r.status_code == 404:
                raise RuntimeError(f"{e.url} has no /reset_prefix_cache (started without VLLM_SERVER_DEV_MODE=1?)")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{e.url}: prefix cache not reset after {timeout:g} s: {r.status_code} {r.text[:200]}"
                )
            time.sleep(0.5)


def wait_idle(engines: Sequence[VllmEngine], timeout: float = 60.0) -> None:
    """Until no engine runs or queues a request (cancelled requests end a little after the client gave up)."""
    deadline = time.monotonic() + timeout
    for e in engines:
        if e.proc is None or e.proc.poll() is not None:
            raise RuntimeError(f"vLLM on {e.url} exited:\n{e.log_tail()}")
        while e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM on {e.url} still busy {timeout:g} s after the replay")
            time.sleep(0.25)


def warm_up(engines: Sequence[VllmEngine], trace: Trace, seed: int) -> float:
    """Prompts over the schedule's range of lengths, each sent twice (a miss, then a hit), to every
    engine directly; unrelated to the schedule (own tokens) and wiped by the reset before each mode.
    Returns the seconds it took."""
    longest = max(len(r.tokens) for r in trace.requests)
    lengths = sorted({max(8, int(longest * f)) for f in (0.05, 0.25, 0.5, 0.75, 1.0)})
    max_tokens = max(r.max_tokens for r in trace.requests)
    rng = np.random.default_rng([seed, 99])
    prompts = [rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist() for n in lengths]

    def one(e: VllmEngine) -> None:
        for tokens in prompts:
            for _ in range(2):
                body = {"model": SERVED_NAME, "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
                httpx.post(f"{e.url}/v1/completions", json=body, timeout=300.0).raise_for_status()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(one, engines))
    return time.perf_counter() - t0


def frontend_counters(url: str) -> dict[str, float | None]:
    """What the router saw: KV events received, and the cached tokens it expected (captured) against
    those the engines reported (delivered): a stale or mismatched index shows as delivered < captured."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    return {name: read_counter(text, name) for name in FRONTEND_COUNTERS}


# -- one mode -----------------------------------------------------------------------------------------
def run_mode(
    trace: Trace,
    spec: ModeSpec,
    engines: Sequence[VllmEngine],
    model_dir: str,
    opts: RunOptions,
    progress: Callable[[str], None] = print,
) -> dict:
    """Reset the engines' caches, start a fresh frontend in ``spec``'s mode, replay, stop the frontend."""
    t_start = time.perf_counter()
    reset_caches(engines)
    log_dir = os.path.join(opts.log_dir, f"{trace.name}-{spec.label}") if opts.log_dir else None
    cluster = Cluster(log_dir=log_dir)
    cluster.workers = engine_workers(engines)
    frontend_args = (*opts.frontend_args, *spec.frontend_args)
    block_size = ("--kv-cache-block-size", str(engines[0].block_size))
    try:
        url = cluster.start_frontend(spec.router_mode, extra_args=(*block_size, *frontend_args), model_path=model_dir)
        cluster.wait_frontend_ready(SERVED_NAME, timeout=120.0)
        load_before = load_avg()
        progress(
            f"[{spec.label}] caches reset, fresh frontend ready in {time.perf_counter() - t_start:.1f} s, {load_before}"
        )

        def settle() -> None:
            cluster.check_alive()
            wait_idle(engines)

        summary = measure(trace, url, spec.label, [f"{e.url}/metrics" for e in engines], opts, progress, settle)
        summary["router"] = frontend_counters(url)
    finally:
        cluster.stop()
    summary["router_mode"] = spec.router_mode
    summary["frontend_args"] = list(frontend_args)
    summary["load_before"] = load_before
    summary["load_after"] = load_avg()
    return summary


def mode_notes(rows: Sequence[dict]) -> list[str]:
    """One line per mode beside the verdict: the prompt tokens the engines computed (queries - hits: the
    work that misses cost, whatever the hardware), the router's own view (KV events, the cached tokens it
    expected against those the engines reported) and the machine's load around the run."""
    lines = []
    for m in rows:
        parts = []
        cache = m.get("cache")
        if cache:
            per_engine = [w["queries"] for w in cache["per_worker"].values()]
            parts.append(
                f"engines computed {cache['queries'] - cache['hits']:.0f} of {cache['queries']:.0f} prompt tokens; "
                f"prompt tokens per engine {min(per_engine):.0f}-{max(per_engine):.0f}"
            )
        r = m.get("router") or {}
        if m.get("router_mode") in ("kv", "latency") and r:  # the modes that read the block index take events
            parts.append(f"{r.get('kvroute_kv_events_received') or 0:.0f} KV events received")
            if r.get("kvroute_router_captured_cached_tokens"):
                parts.append(
                    f"engines delivered {r.get('kvroute_router_delivered_cached_tokens') or 0:.0f} of the "
                    f"{r['kvroute_router_captured_cached_tokens']:.0f} cached tokens the router expected"
                )
        if r.get("kvroute_hash_parity_mismatch"):
            parts.append(f"{r['kvroute_hash_parity_mismatch']:.0f} hash parity mismatches")
        if m.get("load_before"):
            parts.append(f"{m['load_before']} before, {m.get('load_after', 'n/a')} after")
        if parts:
            lines.append(f"{m['mode']}: " + "; ".join(parts))
    return lines


# -- CLI ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench real_engines",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help="router modes, each on reset caches and a fresh frontend"
    )
    p.add_argument("--variant", action="append", default=None, metavar="LABEL=MODE[,FLAG...]",
                   help="an extra row: a router mode with extra frontend flags (repeat)")  # fmt: skip
    p.add_argument("--workers", type=int, default=4, help="vLLM engines")
    p.add_argument(
        "--num-gpu-blocks",
        default="auto",
        help="KV blocks per engine (--num-gpu-blocks-override); auto = bench replay's size for the built-in "
        "generator, which holds this schedule's every distinct block in each engine (nothing is evicted)",
    )
    p.add_argument("--frontend-arg", action="append", default=[], help="extra frontend flag (repeat)")
    p.add_argument("--model-dir", help="an existing tiny model directory (default: write one to a temporary directory)")
    p.add_argument("--out-dir", default="bench/out", help="where the JSON, markdown, PNG and logs go")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("client")
    g.add_argument("--max-concurrency", type=int, default=64)
    g.add_argument("--max-duration", type=float, default=300.0, help="seconds per mode before requests are cancelled")
    g.add_argument("--request-timeout", type=float, default=120.0)
    add_synthetic_args(p, WORKLOAD)
    p.set_defaults(block_size=vllm_cpu.BLOCK_SIZE, data_parallel_size=1)
    return p


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the engines


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    python = vllm_cpu.vllm_python()
    if python is None:
        raise SystemExit(vllm_cpu.missing_reason())
    modes = mode_rows(args.modes, args.variant, default_variants=())
    if any(m.prefill_workers for m in modes):
        raise SystemExit("prefill=N (disaggregated) rows need KV transfer between engines, not set up here")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t_total = time.perf_counter()
    trace = build_trace("synthetic", args)
    prompts = [r.tokens for r in trace.requests]
    orc = oracle(prompts, args.block_size)
    blocks = gpu_blocks_for(trace, args)
    capacity = args.workers * blocks
    pooled = {"capacity_blocks": capacity, **pooled_lru_hits(prompts, args.block_size, capacity).as_dict()}
    longest = max(len(p) for p in prompts) + max(r.max_tokens for r in trace.requests)
    if longest > MODEL_POSITIONS:
        raise SystemExit(f"the longest request needs {longest} positions; the tiny model has {MODEL_POSITIONS}")
    max_model_len = min(MODEL_POSITIONS, max(2048, -(-longest // 1024) * 1024))
    print(f"== trace {trace.name}: {trace.summary()}")
    print(f"   workload: {trace.scaling['description']}")
    print(
        f"   oracle at block size {args.block_size}: {orc.token_share:.1%} of prompt tokens; "
        f"{distinct_blocks(prompts, args.block_size)} distinct blocks, {blocks} per engine; "
        f"one shared cache of all {capacity}: {pooled['token_share']:.1%}"
    )
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    tmp = None if args.model_dir else tempfile.mkdtemp(prefix="kvroute-tiny-")
    engines: list[VllmEngine] = []
    try:
        model_dir = args.model_dir or vllm_cpu.write_tiny_model(
            python, os.path.join(tmp or "", "model"), seed=args.seed
        )
        engines = [
            VllmEngine(
                python, model_dir, num_gpu_blocks=blocks, max_model_len=max_model_len, env=dict(ENGINE_ENV),
                log_path=os.path.join(log_dir, f"vllm-{i}.log"),
            )
            for i in range(1, args.workers + 1)
        ]  # fmt: skip
        t0 = time.perf_counter()
        vllm_cpu.start_engines(engines)
        startup_s = time.perf_counter() - t0
        print(f"   {args.workers} vLLM engines ready in {startup_s:.0f} s ({load_avg()}); logs in {log_dir}")
        warm_s = warm_up(engines, trace, args.seed)
        print(f"   warm-up (every engine, outside the schedule) {warm_s:.0f} s")
        opts = RunOptions(
            workers=args.workers, max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
            request_timeout_s=args.request_timeout, frontend_args=tuple(args.frontend_arg), log_dir=log_dir,
            model=SERVED_NAME,
        )  # fmt: skip
        rows = []
        for spec in modes:
            t_mode = time.perf_counter()
            try:
                row = run_mode(trace, spec, engines, model_dir, opts)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
                print(f"[{spec.label}] run failed: {exc}")
                row = failed_row(trace, spec, exc)
            row["mode_s"] = round(time.perf_counter() - t_mode, 1)
            rows.append(row)
    finally:
        for e in engines:
            e.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    total_s = time.perf_counter() - t_total
    command = " ".join(["python -m bench real_engines", *(argv if argv is not None else sys.argv[1:])])
    report = {
        "trace": trace.summary(),
        "scaling": trace.scaling,
        "oracle": orc.as_dict(),
        "pooled_lru": pooled,
        "setup": (
            f"{args.workers} vLLM {vllm_cpu.VERSION} CPU-build engines (tiny random-weight 2-layer Llama, float32), "
            f"block size {args.block_size}, {blocks} KV blocks each (--num-gpu-blocks-override), max_model_len "
            f"{max_model_len}; frontend --kv-cache-block-size {args.block_size} --model-path <the tiny model>; "
            "prefix caches reset (POST /reset_prefix_cache) and a fresh frontend per mode; "
            f"client max concurrency {args.max_concurrency}"
        ),
        "command": command,
        "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "load_after": load_avg()},
        "timing_s": {"engine_startup": round(startup_s, 1), "warm_up": round(warm_s, 1), "total": round(total_s, 1)},
        "modes": rows,
    }
    report["verdict"] = verdict(report) + mode_notes(rows)
    report["verdict"].append(
        f"timing: engines ready in {startup_s:.0f} s, warm-up {warm_s:.0f} s, per mode "
        + ", ".join(f"{m['mode']} {m['mode_s']:.0f} s" for m in rows)
        + f"; whole command {total_s / 60:.1f} min"
    )
    paths = write_outputs(report, args.out_dir, "real-vllm")
    print()
    print(markdown_report(report))
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return 0 if all(m["completed"] == m["requests"] for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
