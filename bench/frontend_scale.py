"""Frontend past one core: req/s and CPU per request of ``python -m frontend --workers N``.

    python -m bench.frontend_scale                      # N = 1 then 2, wrk, 2 instant mockers, ~1 min
    python -m bench.frontend_scale --processes 1,2,1,2 --duration 20

For each N: a kv-mode frontend with ``--workers N`` (N = 1 is the plain single process) in front of
mockers with ``--speedup-ratio 0`` (no simulated time), loaded by ``wrk`` (C, keep-alive, one
connection per slot: the kernel's SO_REUSEPORT spreads connections over the processes) with short
non-streaming chat requests (``max_tokens: 1``). Measured: req/s at the client, frontend CPU (utime +
stime of every frontend process and the supervisor, from ``/proc``) per request, and the mockers' and
wrk's CPU per request separately, so the frontend's own cost is not mixed with its upstream's.
``frontend_cores`` = frontend CPU seconds / wall seconds: how many cores the frontend actually got.
Figures: docs/benchmarks.md. Nothing here asserts: benchmarks measure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

MODEL = "kvroute-demo"


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
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


def _wrk(url: str, body: bytes, duration: float, connections: int, threads: int) -> tuple[float, dict[str, Any], int]:
    """Run wrk against url; (req/s, latency summary, wrk pid's CPU is measured by the caller via /proc)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(body.decode())}\n")
        script = f.name
    try:
        proc = subprocess.Popen(["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", script,
                                 f"{url}/v1/chat/completions"], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=duration + 60)
    finally:
        os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {m.group(1): m.group(2) for m in re.finditer(r"^\s+(50|90|99)%\s+(\S+)", out, re.M)}
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, {"latency": lat, "raw_tail": out.strip().splitlines()[-1]}, int(errors.group(1)) if errors else 0


def bench_scale(processes: int, duration: float = 15.0, connections: int = 32, threads: int = 1, n_workers: int = 2,
                router_mode: str = "kv") -> dict[str, Any]:
    from kvroute_common.local_cluster import MockerOptions, start_cluster

    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Write a haiku about routers."}]}).encode()
    args = ["--log-level", "warning", "--workers", str(processes)]
    with start_cluster(n_workers, MockerOptions(speedup_ratio=0.0), router_mode=router_mode, frontend_args=args) as cluster:
        top = cluster.frontend.proc.pid
        _serving_pids(cluster.frontend_url, processes)
        fe_pids = [top, *_children(top)] if processes > 1 else [top]
        mock_pids = [w.child.proc.pid for w in cluster.workers]
        _wrk(cluster.frontend_url, body, 3.0, connections, threads)  # warm-up: connections, tokenizer, caches
        r0 = os.times()
        fe0, mk0 = sum(map(_cpu_seconds, fe_pids)), sum(map(_cpu_seconds, mock_pids))
        t0 = time.perf_counter()
        rps, lat, errors = _wrk(cluster.frontend_url, body, duration, connections, threads)
        wall = time.perf_counter() - t0
        fe = sum(map(_cpu_seconds, fe_pids)) - fe0
        mk = sum(map(_cpu_seconds, mock_pids)) - mk0
        r1 = os.times()
        gen = (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)
        n = rps * duration
        per_proc = {pid: round(_cpu_seconds(pid), 2) for pid in fe_pids}
    return {"bench": "scale", "processes": processes, "router_mode": router_mode, "connections": connections,
            "duration_s": duration, "rps": round(rps, 1), "non_2xx": errors, "latency": lat["latency"],
            "frontend_cpu_ms_per_request": round(fe * 1e3 / n, 3), "frontend_cores": round(fe / wall, 2),
            "mocker_cpu_ms_per_request": round(mk * 1e3 / n, 3), "wrk_cpu_ms_per_request": round(gen * 1e3 / n, 3),
            "frontend_cpu_s_per_process_total": per_proc, "loadavg_1m": round(os.getloadavg()[0], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_scale", description=__doc__.splitlines()[0])
    p.add_argument("--processes", default="1,2", help="comma-separated --workers values, run in this order [1,2]")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load per run [15]")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="wrk threads [1]")
    p.add_argument("--mockers", type=int, default=2)
    p.add_argument("--router-mode", default="kv")
    ns = p.parse_args(argv)
    rows = []
    for n in [int(x) for x in ns.processes.split(",") if x.strip()]:
        row = bench_scale(n, ns.duration, ns.connections, ns.threads, ns.mockers, ns.router_mode)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r["rps"] for r in rows if r["processes"] == 1), None)
    if base:
        for r in rows:
            if r["processes"] > 1:
                print(json.dumps({"processes": r["processes"], "rps_vs_1_process": round(r["rps"] / base, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
