"""Frontend past one core: req/s and CPU per request of ``python -m frontend --workers N``.

    python -m bench.frontend_scale                       # N = 1 then 2, nginx upstream, wrk, ~1 min
    python -m bench.frontend_scale --upstream mocker     # the simulated engines instead (they use a core)
    python -m bench.frontend_scale --processes 1,2,1,2 --duration 20

For each N: a kv-mode frontend with ``--workers N`` (N = 1 is the plain single process) loaded by
``wrk`` (C, keep-alive, one connection per slot: the kernel's SO_REUSEPORT spreads connections over
the processes) with short non-streaming chat requests (``max_tokens: 1``).

The upstream is what decides whether a second frontend process can show anything on a 2-core
machine: the Python mockers cost about as much CPU per request as the frontend, so with them one
frontend process already leaves no core free. ``--upstream nginx`` (default; Debian's nginx) answers
the engine routes with a canned vLLM-shaped stream (role, one token, finish, usage) at a few
microseconds of CPU per request, so the frontend's own cost decides the throughput; it publishes no
KV events, so the frontend runs with ``--no-router-kv-events`` (the approximate index). Routing
quality at 1 vs 2 processes is measured separately with real KV events (``python -m bench replay
--frontend-arg=--workers=2``, docs/benchmarks.md).

Measured: req/s at the client, frontend CPU (utime + stime of every frontend process and the
supervisor, from ``/proc``) per request, and the upstream's and wrk's CPU per request separately.
``frontend_cores`` = frontend CPU seconds / wall seconds: how many cores the frontend actually got.
Figures: docs/benchmarks.md. Nothing here asserts: benchmarks measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

MODEL = "kvroute-demo"


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _serving_pids(url: str, want: int, timeout: float = 90.0) -> set[int]:
    """The pids of the frontend processes answering on ``url`` (new connections until ``want`` were seen)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {want} frontend processes answered at {url}")
        try:
            with httpx.Client(timeout=5.0) as c:
                r = c.get(f"{url}/health")
                if r.status_code == 200:
                    seen.add(c.get(f"{url}/live").json()["pid"])
        except httpx.TransportError:
            pass
    return seen


def run_wrk(
    url: str, body: bytes, duration: float, connections: int, threads: int
) -> tuple[float, dict[str, Any], int]:
    """Run wrk POSTing ``body`` to the chat route; (req/s, latency summary, non-2xx responses)."""
    script = (
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body.decode())}\n"
    )
    return run_wrk_script(f"{url}/v1/chat/completions", script, duration, connections, threads)


def run_wrk_script(
    url: str, script: str, duration: float, connections: int, threads: int
) -> tuple[float, dict[str, Any], int]:
    """Run wrk with a Lua ``script`` against ``url``; (req/s, latency summary, non-2xx responses)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
        path = f.name
    try:
        proc = subprocess.Popen(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", path, url],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = proc.communicate(timeout=duration + 60)
    finally:
        os.unlink(path)
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if found is None:
        raise RuntimeError(f"wrk reported no Requests/sec:\n{out}")
    rps = float(found.group(1))
    lat = {m.group(1): m.group(2) for m in re.finditer(r"^\s+(50|90|99)%\s+(\S+)", out, re.M)}
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, {"latency": lat, "raw_tail": out.strip().splitlines()[-1]}, int(errors.group(1)) if errors else 0


def _sse(chunks: list[dict[str, Any]]) -> str:
    return "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks) + "data: [DONE]\n\n"


_USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 1,
    "total_tokens": 13,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _chunk(obj: str, choice: dict[str, Any] | None, usage: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "cmpl-canned", "object": obj, "created": 0, "model": MODEL}
    out["choices"] = [] if choice is None else [{"index": 0, **choice}]
    if usage:
        out["usage"] = _USAGE
    return out


# vLLM-shaped streams: role (chat), one token, finish, usage
_CHAT = "chat.completion.chunk"
_CANNED_STREAM = _sse(
    [
        _chunk(_CHAT, {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
        _chunk(_CHAT, {"delta": {"content": "ok"}, "finish_reason": None}),
        _chunk(_CHAT, {"delta": {}, "finish_reason": "length"}),
        _chunk(_CHAT, None, usage=True),
    ]
)
_CANNED_COMPLETION_STREAM = _sse(
    [
        _chunk("text_completion", {"text": "ok", "logprobs": None, "finish_reason": None}),
        _chunk("text_completion", {"text": "", "logprobs": None, "finish_reason": "length"}),
        _chunk("text_completion", None, usage=True),
    ]
)


def _render_routes(tokens: int, root: str) -> str:
    """vLLM's render routes and the mocker's /tokenize, answering ``tokens`` canned ids (where the vLLM
    router's ``kv_aware`` has an engine tokenize each request). The bodies are too long for ``return``:
    they are files under ``root``, served to POSTs through nginx's 405 -> GET internal redirect."""
    ids = list(range(1000, 1000 + tokens))
    bodies = {
        "/tokenize": {"count": tokens, "max_model_len": 8192, "tokens": ids},
        "/v1/completions/render": [{"request_id": "canned", "token_ids": ids}],
        "/v1/chat/completions/render": {"request_id": "canned", "token_ids": ids},
    }
    routes = ""
    for route, body in bodies.items():
        path = os.path.join(root, route.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, separators=(",", ":"))
        routes += f"""
        location = {route} {{ root {root}; default_type application/json; error_page 405 =200 $uri; }}"""
    return routes


def _nginx_conf(ports: list[int], tmp: str, render_tokens: int = 0) -> str:
    """One nginx worker process answering the engine routes on each port with canned bodies (and, with
    ``render_tokens``, the tokenize and render routes)."""
    models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "nginx", "max_model_len": 8192}]}
    )
    render = _render_routes(render_tokens, os.path.join(tmp, "canned")) if render_tokens else ""
    servers = "".join(
        f"""
    server {{
        listen 127.0.0.1:{port};
        location = /v1/chat/completions {{ default_type text/event-stream; return 200 '{_CANNED_STREAM}'; }}
        location = /v1/completions {{ default_type text/event-stream; return 200 '{_CANNED_COMPLETION_STREAM}'; }}
        location = /v1/models {{ default_type application/json; return 200 '{models}'; }}
        location = /health {{ return 200; }}{render}
        location / {{ return 404; }}
    }}"""
        for port in ports
    )
    return f"""daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    client_body_buffer_size 64k;{servers}
}}
"""


class NginxUpstream:
    """nginx as the cheapest possible engine: ``workers`` ports, one nginx worker process."""

    def __init__(self, workers: int, render_tokens: int = 0) -> None:
        from kvroute_common.ports import free_ports

        self.ports = free_ports(workers)
        self.tmp = tempfile.mkdtemp(prefix="kvroute-nginx-")
        os.chmod(self.tmp, 0o755)  # nginx's worker process (user nobody when started as root) reads the canned files
        conf = os.path.join(self.tmp, "nginx.conf")
        with open(conf, "w") as f:
            f.write(_nginx_conf(self.ports, self.tmp, render_tokens))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen(
            [nginx, "-c", conf, "-p", self.tmp, "-e", os.path.join(self.tmp, "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.ports[0]}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"nginx did not start: {self.proc.stderr.read().decode() if self.proc.stderr else ''}"
                )
            time.sleep(0.05)  # polling a local server's start-up; bounded by the deadline above

    def pids(self) -> list[int]:
        return [self.proc.pid, *children(self.proc.pid)]

    def worker_args(self) -> list[str]:
        return [a for i, port in enumerate(self.ports, 1) for a in ("--worker", f"id={i},url=http://127.0.0.1:{port}")]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def bench_scale(
    processes: int,
    duration: float = 15.0,
    connections: int = 32,
    threads: int = 1,
    n_workers: int = 2,
    router_mode: str = "kv",
    upstream: str = "nginx",
) -> dict[str, Any]:
    from kvroute_common.local_cluster import Cluster, MockerOptions, start_cluster

    body = json.dumps(
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Write a haiku about routers."}]}
    ).encode()
    args = ["--log-level", "warning", "--workers", str(processes)]
    with contextlib.ExitStack() as stack:
        if upstream == "nginx":
            ng = NginxUpstream(n_workers)
            stack.callback(ng.close)
            cluster = stack.enter_context(Cluster())
            cluster.start_frontend(
                router_mode, extra_args=[*args, "--no-router-kv-events", *ng.worker_args()], kv_events=False
            )
            cluster.wait_frontend_ready(MODEL)
            upstream_pids = ng.pids
        else:
            cluster = stack.enter_context(
                start_cluster(n_workers, MockerOptions(speedup_ratio=0.0), router_mode=router_mode, frontend_args=args)
            )
            mock_pids = [w.child.proc.pid for w in cluster.workers]
            upstream_pids = lambda: mock_pids  # noqa: E731
        assert cluster.frontend is not None and cluster.frontend_url is not None  # started above
        top = cluster.frontend.proc.pid
        _serving_pids(cluster.frontend_url, processes)
        fe_pids = [top, *children(top)] if processes > 1 else [top]
        run_wrk(cluster.frontend_url, body, 3.0, connections, threads)  # warm-up: connections, tokenizer, caches
        r0 = os.times()
        up_pids = upstream_pids()
        fe0, mk0 = sum(map(cpu_seconds, fe_pids)), sum(map(cpu_seconds, up_pids))
        t0 = time.perf_counter()
        rps, lat, errors = run_wrk(cluster.frontend_url, body, duration, connections, threads)
        wall = time.perf_counter() - t0
        fe = sum(map(cpu_seconds, fe_pids)) - fe0
        mk = sum(map(cpu_seconds, up_pids)) - mk0
        r1 = os.times()
        gen = (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)
        n = rps * duration
        per_proc = {pid: round(cpu_seconds(pid), 2) for pid in fe_pids}
    return {
        "bench": "scale",
        "processes": processes,
        "upstream": upstream,
        "router_mode": router_mode,
        "connections": connections,
        "duration_s": duration,
        "rps": round(rps, 1),
        "non_2xx": errors,
        "latency": lat["latency"],
        "frontend_cpu_ms_per_request": round(fe * 1e3 / n, 3),
        "frontend_cores": round(fe / wall, 2),
        "upstream_cpu_ms_per_request": round(mk * 1e3 / n, 3),
        "wrk_cpu_ms_per_request": round(gen * 1e3 / n, 3),
        "frontend_cpu_s_per_process_total": per_proc,
        "loadavg_1m": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_scale", description=__doc__.splitlines()[0])
    p.add_argument("--processes", default="1,2", help="comma-separated --workers values, run in this order [1,2]")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load per run [15]")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="wrk threads [1]")
    p.add_argument("--mockers", type=int, default=2)
    p.add_argument("--router-mode", default="kv")
    p.add_argument(
        "--upstream",
        choices=("nginx", "mocker"),
        default="nginx",
        help="what answers the engine routes: nginx with canned streams (default) or simulated engines",
    )
    ns = p.parse_args(argv)
    rows = []
    for n in [int(x) for x in ns.processes.split(",") if x.strip()]:
        row = bench_scale(n, ns.duration, ns.connections, ns.threads, ns.mockers, ns.router_mode, ns.upstream)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # each multi-process run against the nearest single-process run before it (runs alternate so that a
    # drifting machine, e.g. a VM whose host gets busy, moves both sides of a pair together)
    ratios: dict[int, list[float]] = {}
    last_single = None
    for r in rows:
        if r["processes"] == 1:
            last_single = r["rps"]
        elif last_single:
            ratios.setdefault(r["processes"], []).append(round(r["rps"] / last_single, 2))
    for n, rs in sorted(ratios.items()):
        print(json.dumps({"processes": n, "rps_vs_1_process_pairs": rs, "median": statistics.median(rs)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
