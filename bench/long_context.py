"""Long agentic contexts through a real frontend: does any request wait behind another's prompt?

    python -m bench long_context                          # both parts, built-in tokenizer
    python -m bench long_context --tokenizers builtin,hf  # also with --model-path (an HF directory)

Two mockers (instant engines, context and KV cache large enough for 400 k-token prompts, vLLM's
chunked prefill of 8192 tokens per step, so KV events arrive per step as vLLM publishes them) behind
a frontend in ``--router-mode`` (latency, the recommended mode, by default; kv too). ``--index remote``
puts the KV-event ingestion in a standalone indexer (``--use-remote-indexer``): the frontend's loop
then does the request path alone.

* **Tiny-request latency while long prompts arrive.** Tiny completions (``max_tokens`` 1) are sent
  open loop every 10 ms (a stall delays every request sent during it, so the percentiles see it)
  while long prompts arrive at fixed rates: 32 k tokens at 2/s, 128 k at 2/s, 400 k at 1 every 2 s,
  and three 3 MB chat prompts at once (over every engine's context: refused). Each long prompt is
  fresh random text (the tokenizer's caches do not help). Reported: the tiny requests' p50 / p99 /
  worst over the window, the long requests' statuses, and per second of the window how long the
  frontend's loop thread ran and how long it was runnable but waited for a CPU (schedstat).
  ``--split``: the tiny completions also ask for the frontend's timing (``nvext``), and their time is
  split into before the frontend's handler had the request, in it, and after it. The tiny requests come
  from a process of their own on raw kept-alive connections (``bench.tiny_sender``): the client is part
  of what a percentile measures, and beside the long prompts' sender it would be measured too.
* **The engine floor** (each latency scenario again, unless ``--no-floor``): the same long prompts through
  the frontend, pinned to one engine, while the tiny requests go straight to the other engine. What the
  tiny requests see there is the testbed's share (the engines, the client, the cores the frontend's work
  on the long prompts takes); ``router_added_ms`` is the difference, percentile by percentile: what passing
  through the frontend adds.
* **The chat shape** (``--shapes chat``): the same with chat requests on both sides, as an agent sends
  them: a ~128 k-token user message in ``/v1/chat/completions`` at 2/s, and three 3 MB chat prompts at
  once, while tiny chat requests are sent every 10 ms (each rendered through the chat template).
* **A short next turn after a long new one** (up to 128 k tokens): the loop's time for a ~100-token turn
  that repeats the long text before it, which the tokenizer thread encoded; and for a second short question
  on a long document (which repeats the document, not the first question's prompt).
* **Loop and CPU time per request against prompt length.** Long prompts of 1 k to 400 k tokens are
  sent one at a time; the frontend's event-loop thread's run time (``/proc/PID/task/PID/schedstat``,
  nanoseconds) and the whole process's CPU time are read before and after: what one request of that
  length costs the loop (everything else waits for it) and in all (the tokenizer threads included), and the
  request's own median time (one output token: the engine's tokenizing and prefill included);
  with the chat shape, also chat requests whose user message has each length up to 128 k tokens.

``--before DIR`` measures another checkout first, in the same run (``git worktree add /tmp/before
<commit>``): its ``python -m frontend`` and ``python -m mocker`` are started from that directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.report import emit
from bench.tiny_sender import tiny_body
from bench.tokenize_stall import _summary, big_text

MODEL = "kvroute-demo"
CHARS_PER_TOKEN = 1.63  # the built-in tokenizer on big_text's random words (calibrated at start)
SCENARIOS = [  # (name, prompt tokens, long prompts per second, seconds)
    ("32k tokens, 2/s", 32_000, 2.0, 8.0),
    ("128k tokens, 2/s", 128_000, 2.0, 8.0),
    ("400k tokens, 1 every 2 s", 400_000, 0.5, 10.0),
]
CHAT_SCENARIOS = [("chat: 128k-token user message, 2/s", 128_000, 2.0, 8.0)]  # tiny requests are chat too
SHAPES = ("completions", "chat")
LENGTHS = [1_000, 8_000, 32_000, 128_000, 400_000]


def _calibrate(model_path: str | None) -> float:
    from kvroute_common.tokenizer import encode_text, load_tokenizer

    sample = big_text(200_000, 99)
    return len(sample) / len(encode_text(load_tokenizer(model_path), sample))


def _completion(tokens: int, seed: int, chars_per_token: float) -> bytes:
    text = big_text(int(tokens * chars_per_token * 0.97), seed)
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()


def _chat_tokens(tokens: int, seed: int, chars_per_token: float) -> bytes:
    return _chat(int(tokens * chars_per_token * 0.97), seed)


def _chat(chars: int, seed: int) -> bytes:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": big_text(chars, seed)}]}
    return json.dumps(body).encode()


def _loop_sched(pid: int) -> tuple[int, int]:
    """(run time, time runnable but waiting for a CPU), ns, of the process's main thread, where the
    frontend's event loop runs."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run), int(wait)


def _loop_ns(pid: int) -> int:
    return _loop_sched(pid)[0]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _long_sender(
    client: Any, path: str, bodies: list[bytes], rate: float, statuses: list[int], tokens: list[int]
) -> None:
    async def one(body: bytes) -> None:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        if r.status_code == 200:
            tokens.append(r.json()["usage"]["prompt_tokens"])

    loop = asyncio.get_running_loop()
    tasks = []
    next_t = loop.time()
    for body in bodies:
        tasks.append(asyncio.create_task(one(body)))
        next_t += 1.0 / rate
        await asyncio.sleep(max(0.0, next_t - loop.time()))
    await asyncio.gather(*tasks)


class _TinyProcess:
    """``bench.tiny_sender`` against ``url``, in a process of its own (the client is part of what a percentile
    measures): started and warmed by ``start``, stopped by ``finish``, which returns its samples."""

    def __init__(self, url: str, chat: bool, timing: bool) -> None:
        argv = [sys.executable, "-m", "bench.tiny_sender", url, "--model", MODEL]
        argv += ["--chat"] if chat else []
        argv += ["--timing"] if timing else []
        self.proc = subprocess.Popen(
            argv, cwd=_REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env()
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"the tiny sender did not start: {line!r}")

    def finish(self) -> list[list[float]]:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        result = json.loads(out.strip().splitlines()[-1])
        if "error" in result:
            raise RuntimeError(result["error"])
        return result["samples"]


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _pinned(body: bytes, worker_id: int) -> bytes:
    """``body`` (a JSON object) sent to ``worker_id`` whatever the router would pick (``nvext.backend_instance_id``)."""
    return body[: body.rindex(b"}")] + b', "nvext": {"backend_instance_id": %d}}' % worker_id


async def _scenario(
    url: str,
    pid: int,
    bodies: list[bytes],
    rate: float,
    at_once: bool,
    chat: bool = False,
    split: bool = False,
    tiny_url: str | None = None,
) -> dict[str, Any]:
    """Tiny requests open loop while ``bodies`` arrive at ``rate`` (or all ``at_once``, as chat
    requests); ``chat``: the tiny and the long requests are chat requests. Also reported, per second
    of the window: how long the frontend's loop thread ran, and how long it was runnable but waited
    for a CPU (other threads and processes on the cores: every request waits as long); ``split``: where the
    tiny requests' time went (``_split``). ``tiny_url``: the tiny requests go there (an engine: the floor)
    instead of to the frontend at ``url``."""
    import httpx

    tiny = _TinyProcess(tiny_url or url, chat, split)
    try:
        tiny.wait_ready()
    except BaseException:
        tiny.proc.kill()
        raise
    statuses: list[int] = []
    tokens: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as big:
        t0 = time.perf_counter()
        sched0 = _loop_sched(pid)
        try:
            if not bodies:  # the idle baseline: tiny requests alone
                await asyncio.sleep(3.0)
            elif at_once:
                headers = {"content-type": "application/json"}
                answers = await asyncio.gather(
                    *(big.post("/v1/chat/completions", content=b, headers=headers) for b in bodies)
                )
                statuses += [a.status_code for a in answers]
            else:
                path = "/v1/chat/completions" if chat else "/v1/completions"
                await _long_sender(big, path, bodies, rate, statuses, tokens)
        finally:
            t1 = time.perf_counter()
            sched1 = _loop_sched(pid)
            samples = tiny.finish()
    secs = t1 - t0
    window = [s for s in samples if t0 <= s[0] < t1]
    out: dict[str, Any] = {
        "tiny_ms": _summary([s[1] for s in window]),
        "loop_run_ms_per_s": round((sched1[0] - sched0[0]) / 1e6 / secs, 1),
        "loop_cpu_wait_ms_per_s": round((sched1[1] - sched0[1]) / 1e6 / secs, 1),
        "long_statuses": sorted(set(statuses)),
        "long_prompt_tokens": round(sum(tokens) / len(tokens)) if tokens else None,
        "seconds": round(t1 - t0, 1),
    }
    if split:
        out["tiny_split_ms"] = _split([(s[2], s[3], s[4]) for s in window])
    return out


def _split(parts: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Where the tiny requests' time went, from (before, in, after the frontend's handler, ms) per request:
    before the frontend's handler had the request (the client, the connection, the frontend's loop reaching
    it, the body read and parsed; the frontend stamps its arrival to the millisecond), in the handler
    (routing, the engine, the response out), and after it (the client reading the response)."""
    return {
        "before_handler": _summary([p[0] for p in parts]),
        "in_handler": _summary([p[1] for p in parts]),
        "after_handler": _summary([p[2] for p in parts]),
    }


def _per_request(url: str, pid: int, length: int, n: int, cpt: float, chat: bool = False) -> dict[str, Any]:
    import httpx

    if chat:
        path, bodies = "/v1/chat/completions", [_chat_tokens(length, 3000 + k, cpt) for k in range(n)]
    else:
        path, bodies = "/v1/completions", [_completion(length, 1000 + k, cpt) for k in range(n)]
    with httpx.Client(base_url=url, timeout=600.0) as c:
        warm_path, warm = tiny_body(MODEL, "warm", chat, False)
        c.post(warm_path, content=warm, headers={"content-type": "application/json"})
        loop0, cpu0 = _loop_ns(pid), _cpu_s(pid)
        tokens = []
        walls = []
        for body in bodies:
            t = time.perf_counter()
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            walls.append((time.perf_counter() - t) * 1e3)
            if r.status_code != 200:
                raise RuntimeError(f"{length}-token request failed: {r.status_code} {r.text[:300]}")
            tokens.append(r.json()["usage"]["prompt_tokens"])
        loop1, cpu1 = _loop_ns(pid), _cpu_s(pid)
    return {
        "prompt_tokens": round(sum(tokens) / n),
        "requests": n,
        "loop_ms_per_request": round((loop1 - loop0) / 1e6 / n, 2),
        "cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / n, 1),
        "request_ms_p50": round(sorted(walls)[n // 2], 1),  # the whole request (one output token): engine included
    }


def _next_turn(url: str, pid: int, length: int, n: int, cpt: float, question: bool = False) -> dict[str, Any]:
    """A conversation's short next turn (~100 tokens) after a long new one of ``length`` tokens (on the
    tokenizer thread): the loop's time for the short turn alone, which repeats the whole long text.
    ``question``: a long document asked one short question and then another (the second repeats the
    document, not the first question's prompt)."""
    import httpx

    loops = []
    with httpx.Client(base_url=url, timeout=600.0) as c:
        for k in range(n):
            text = big_text(int(length * cpt * 0.97), (6000 if question else 5000) + k)
            follow = text + " " + big_text(160, 7000 + k)
            first = text + " " + big_text(160, 9000 + k) if question else text
            for prompt, measured in ((first, False), (follow, True)):
                body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
                loop0 = _loop_ns(pid)
                r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                if r.status_code != 200:
                    raise RuntimeError(f"{length}-token turn failed: {r.status_code} {r.text[:300]}")
                if measured:
                    loops.append((_loop_ns(pid) - loop0) / 1e6)
                else:
                    _wait_quiet(pid)  # the long turn's KV events applied: not counted to the next turn
    loops.sort()
    return {"requests": n, "loop_ms_p50": round(loops[n // 2], 2), "loop_ms_max": round(loops[-1], 2)}


def _wait_quiet(pid: int, deadline_s: float = 5.0) -> None:
    """Until the frontend's loop ran under 0.2 ms in 50 ms (what a finished request left it is done), or the
    deadline."""
    end = time.monotonic() + deadline_s
    before = _loop_ns(pid)
    while time.monotonic() < end:
        time.sleep(0.05)
        now = _loop_ns(pid)
        if now - before < 200_000:
            return
        before = now


def _chosen(name: str, scenarios: str | None) -> bool:
    """Whether the latency scenario ``name`` is among ``--scenarios`` (comma-separated prefixes; None: all)."""
    return scenarios is None or any(name.startswith(p.strip()) for p in scenarios.split(",") if p.strip())


def _run(tokenizer: str, args: argparse.Namespace, lengths: list[int]) -> dict[str, Any]:
    from kvroute_common.local_cluster import MockerOptions, start_cluster
    from kvroute_common.ports import free_port
    from kvroute_common.processes import service
    from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR

    model_path = None
    tmp = None
    if tokenizer == "hf":  # the same files as an HF model directory given with --model-path
        tmp = tempfile.mkdtemp(prefix="kvroute-hf-tokenizer-")
        model_path = shutil.copytree(BUILTIN_TOKENIZER_DIR, os.path.join(tmp, "model"))
    cpt = _calibrate(model_path)
    opts = MockerOptions(
        speedup_ratio=0.0,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=8192,
        model_path=model_path,
        extra_args=["--max-model-len", "450000"],
    )
    out: dict[str, Any] = {
        "tokenizer": tokenizer,
        "num_gpu_blocks": args.num_gpu_blocks,
        "index": args.index,
        "router_mode": args.router_mode,
        "chars_per_token": round(cpt, 3),
        "scenarios": {},
        "lengths": {},
    }
    cluster = start_cluster(2, opts, args.router_mode, frontend_args=["--log-level", "warning"])
    indexer = None
    try:
        if args.index == "remote":  # ingestion in a standalone indexer; a new frontend routes on it
            port = free_port()
            iurl = f"http://127.0.0.1:{port}"
            workers = ",".join(f"{w.worker_id}={w.kv_events_endpoint}" for w in cluster.workers)
            argv = ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), "--block-size", "16"]
            argv += ["--model-name", MODEL, "--workers", workers, "--log-level", "warning"]
            indexer = service(argv, ready_url=f"{iurl}/health", timeout=60)
            indexer.__enter__()
            assert cluster.frontend is not None
            cluster.frontend.proc.terminate()
            cluster.frontend.proc.wait(timeout=30)
            cluster.start_frontend(
                args.router_mode,
                extra_args=["--log-level", "warning", "--use-remote-indexer", iurl],
                model_path=model_path,
                kv_events=False,
            )
            cluster.wait_frontend_ready(MODEL)
        url = cluster.frontend_url
        assert url is not None and cluster.frontend is not None
        pid = cluster.frontend.proc.pid
        shapes = [x.strip() for x in args.shapes.split(",")]
        if "latency" in args.parts:
            engine, other = cluster.workers[1], cluster.workers[0]

            def measure(name: str, bodies: list[bytes], rate: float, at_once: bool, chat: bool = False) -> None:
                r = asyncio.run(_scenario(url, pid, bodies, rate, at_once, chat, split=args.split))
                if args.floor:  # the same long flow pinned to one engine, the tiny requests straight to the other
                    pinned = [_pinned(b, other.worker_id) for b in bodies]
                    floor = asyncio.run(_scenario(url, pid, pinned, rate, at_once, chat, tiny_url=engine.url))
                    r["engine_floor"] = floor
                    r["router_added_ms"] = {
                        k: round(r["tiny_ms"][k] - floor["tiny_ms"][k], 1) for k in ("p50", "p90", "p99", "max")
                    }
                out["scenarios"][name] = r
                print(f"[{tokenizer}] {name}: {json.dumps(r)}", flush=True)

            if "completions" in shapes:
                if args.idle:
                    measure("none (idle, 3 s)", [], 1.0, False)
                for name, tokens, rate, secs in SCENARIOS:
                    if _chosen(name, args.scenarios):
                        n = max(1, int(rate * secs))
                        measure(name, [_completion(tokens, k, cpt) for k in range(n)], rate, False)
                name = "three 3 MB chat prompts at once"
                if _chosen(name, args.scenarios):
                    measure(name, [_chat(3_000_000, 500 + k) for k in range(3)], 1.0, True)
            if "chat" in shapes:
                if args.idle:
                    measure("chat: none (idle, 3 s)", [], 1.0, False, chat=True)
                for name, tokens, rate, secs in CHAT_SCENARIOS:
                    n = max(1, int(rate * secs))
                    measure(name, [_chat_tokens(tokens, 2000 + k, cpt) for k in range(n)], rate, False, chat=True)
                measure(
                    "chat: three 3 MB chat prompts at once",
                    [_chat(3_000_000, 600 + k) for k in range(3)],
                    1.0,
                    True,
                    True,
                )
        if "loop" in args.parts:
            for length in lengths:
                n = 4 if length >= 400_000 else 10
                out["lengths"][str(length)] = r = _per_request(url, pid, length, n, cpt)
                print(f"[{tokenizer}] {length} tokens: {json.dumps(r)}", flush=True)
            for length in [n for n in lengths if n <= 128_000]:  # within the turn memo's reach
                out["lengths"][f"next turn after {length}"] = r = _next_turn(url, pid, length, 6, cpt)
                print(f"[{tokenizer}] next turn after {length} tokens: {json.dumps(r)}", flush=True)
                out["lengths"][f"second question on {length}"] = r = _next_turn(url, pid, length, 6, cpt, True)
                print(f"[{tokenizer}] second question on {length} tokens: {json.dumps(r)}", flush=True)
            if "chat" in shapes:  # a user message of each length up to 128k tokens: the loop's share of the chat path
                for length in [n for n in lengths if n <= 128_000]:
                    out["lengths"][f"chat {length}"] = r = _per_request(url, pid, length, 10, cpt, chat=True)
                    print(f"[{tokenizer}] chat {length} tokens: {json.dumps(r)}", flush=True)
    finally:
        cluster.stop()
        if indexer is not None:
            indexer.__exit__(None, None, None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench long_context", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizers", default="builtin", help="comma-separated: builtin, hf [builtin]")
    ap.add_argument("--parts", default="latency,loop", help="comma-separated: latency, loop [both]")
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated latency shapes: completions, chat [both]"
    )
    ap.add_argument("--no-idle", dest="idle", action="store_false", help="skip the idle baseline")
    ap.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated name prefixes of the completions latency scenarios to run (e.g. '128k,three') [all]",
    )
    ap.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=120_000,
        help="each engine's KV blocks: the default never evicts in these scenarios; ~20000 keeps caches full, "
        "as a fleet's are, so each long prompt evicts (a 400k-token prompt then no longer fits: refused) [%(default)s]",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="the tiny completions ask for the frontend's timing: report where their time went (before, in and "
        "after the frontend's handler)",
    )
    ap.add_argument(
        "--index", choices=["embedded", "remote"], default="embedded", help="where KV events are ingested [embedded]"
    )
    ap.add_argument(
        "--router-mode", choices=["latency", "kv"], default="latency", help="the frontend's mode [latency: recommended]"
    )
    ap.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the engine floor: each latency scenario again with the tiny requests sent straight to an "
        "engine while the same long prompts go through the frontend, pinned to the other engine",
    )
    ap.add_argument("--before", default=None, help="another checkout to measure first (the 'before' figures)")
    ap.add_argument(
        "--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths (tokens) of the loop part [%(default)s]"
    )
    ap.add_argument(
        "--before-lengths",
        default=None,
        help="prompt lengths of the loop part for --before (a slow checkout may not finish the longest) [--lengths]",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the before / after pair is measured, alternating (a shared machine's load drifts) [1]",
    )
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    random.seed(0)
    here = os.getcwd()
    checkouts = ([("before", os.path.abspath(args.before))] if args.before else []) + [("after", here)]
    result: dict[str, Any] = {"load_average": os.getloadavg(), "runs": []}
    try:
        for rnd in range(args.rounds):
            for label, directory in checkouts:
                os.chdir(directory)  # the children are `python -m frontend` / `mocker` from here
                spec = args.before_lengths if label == "before" and args.before_lengths else args.lengths
                lengths = [int(x) for x in spec.split(",")]
                for t in [t.strip() for t in args.tokenizers.split(",") if t.strip()]:
                    run = _run(t, args, lengths)
                    run["checkout"] = f"{label} ({directory})"
                    run["round"] = rnd + 1
                    run["load_average"] = os.getloadavg()
                    result["runs"].append(run)
    finally:
        os.chdir(here)
    result["load_average_after"] = os.getloadavg()
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
