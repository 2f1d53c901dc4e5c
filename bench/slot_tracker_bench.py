"""Load POST /potential_loads on our slot tracker and on the 1.6.1 reference, side by side.

    python -m bench.slot_tracker_bench [--duration 10] [--connections 16] [--threads 1] [--rounds 2]

Both services run as separate processes on 127.0.0.1 with the same state: 3 workers x 3 DP ranks
(9 slots) holding 4 active requests each (chained hashes sharing prefixes with the query). The
load generator is Debian's ``wrk`` (a separate C process, not the bottleneck) with a Lua script
that POSTs one fixed body: 64 sequence hashes + new_isl_tokens. Rounds alternate ours/reference
so drift in machine load hits both. Prints req/s, p50, p99 and server CPU per request for each
(CPU/request is the steadier figure on a shared machine), and the ratio ours/ref.

Needs: ``apt-get update && apt-get install -y wrk``, and ``pip install ai-dynamo-runtime==1.6.1``
for the reference (``--no-reference`` benchmarks ours alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from kvroute_common.hashing import list_to_i64, sequence_hashes
from kvroute_common.ports import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "bench-model"
WORKERS, RANKS, REQUESTS_PER_RANK, QUERY_BLOCKS = 3, 3, 4, 64


@contextmanager
def process(args: list[str], health_url: str) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(args)} did not start")
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def workload(seed: int = 7) -> tuple[list[dict], dict]:
    """The /register + /add bodies (tenant field added per service) and the /potential_loads body."""
    rng = random.Random(seed)
    query_local = [rng.getrandbits(64) for _ in range(QUERY_BLOCKS)]
    setup: list[dict] = []
    for w in range(1, WORKERS + 1):
        setup.append(
            {
                "path": "/register",
                "body": {"worker_id": w, "model_name": MODEL, "block_size": 16, "dp_start": 0, "dp_size": RANKS},
            }
        )
    n = 0
    for w in range(1, WORKERS + 1):
        for r in range(RANKS):
            for _ in range(REQUESTS_PER_RANK):
                shared = rng.randrange(0, QUERY_BLOCKS)  # prefix shared with the query
                local = query_local[:shared] + [rng.getrandbits(64) for _ in range(rng.randrange(8, 64))]
                body = {
                    "model_name": MODEL,
                    "request_id": f"req-{n}",
                    "worker_id": w,
                    "dp_rank": r,
                    "sequence_hashes": list_to_i64(sequence_hashes(local)),
                    "new_isl_tokens": rng.randrange(16, 2048),
                }
                setup.append({"path": "/add", "body": body})
                n += 1
    query = {"model_name": MODEL, "sequence_hashes": list_to_i64(sequence_hashes(query_local)), "new_isl_tokens": 512}
    return setup, query


def prepare(url: str, setup: list[dict], query: dict, tenant_key: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        for step in setup:
            body = dict(step["body"], **{tenant_key: "default"})
            r = c.post(step["path"], json=body)
            assert r.status_code == 201, (url, step["path"], r.status_code, r.text)
        r = c.post("/potential_loads", json=query)
        assert r.status_code == 200 and len(r.json()) == WORKERS * RANKS, r.text


LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
"""


def cpu_seconds(pid: int) -> float:
    """user+system CPU time of a process (Linux /proc), to report CPU per request."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, lua_path: str, duration: int, connections: int, threads: int, pid: int | None = None) -> dict:
    cpu0 = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(
        [
            "wrk",
            "-t",
            str(threads),
            "-c",
            str(connections),
            "-d",
            f"{duration}s",
            "--latency",
            "-s",
            lua_path,
            f"{url}/potential_loads",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(_search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {m.group(1): _ms(m.group(2)) for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M)}
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors.group(1)} error responses from {url}:\n{out}")
    total = int(_search(r"(\d+) requests in", out).group(1))
    cpu_us = (cpu_seconds(pid) - cpu0) * 1e6 / max(total, 1) if pid else None
    return {"rps": rps, "p50_ms": lat.get("50"), "p99_ms": lat.get("99"), "cpu_us_per_req": cpu_us, "raw": out}


def _search(pattern: str, text: str) -> re.Match[str]:
    """``re.search`` that fails with the text when wrk's report lacks a line we read."""
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"no {pattern!r} in wrk's output:\n{text}")
    return m


def _ms(text: str) -> float:
    value, unit = _search(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds per service, order alternating (best and paired ratios reported)"
    )
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk not found: install it with `apt-get update && apt-get install -y wrk`", file=sys.stderr)
        return 2
    setup, query = workload()
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA.format(body=json.dumps(query, separators=(",", ":"))))
        lua = f.name
    services: dict[str, tuple[list[str], str]] = {}
    ours_port = free_port()
    services["ours"] = (["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(ours_port)], "tenant_id")
    if not ns.no_reference:
        import importlib.util

        if importlib.util.find_spec("dynamo") is None:
            print(
                "reference not installed: pip install ai-dynamo-runtime==1.6.1 (or pass --no-reference)",
                file=sys.stderr,
            )
            return 2
        services["reference"] = (["-m", "dynamo.slot_tracker", "--port", str(free_port())], "routing_group")
    results: dict[str, list[dict]] = {name: [] for name in services}
    try:
        from contextlib import ExitStack

        with ExitStack() as stack:
            urls = {}
            pids = {}
            for name, (args, tenant_key) in services.items():
                port = args[args.index("--port") + 1]
                url = f"http://127.0.0.1:{port}"
                pids[name] = stack.enter_context(process(args, f"{url}/health")).pid
                prepare(url, setup, query, tenant_key)
                run_wrk(url, lua, 2, ns.connections, ns.threads)  # warm-up
                urls[name] = url
            for i in range(ns.rounds):
                order = list(urls.items()) if i % 2 == 0 else list(reversed(urls.items()))  # alternate who goes first
                for name, url in order:
                    results[name].append(run_wrk(url, lua, ns.duration, ns.connections, ns.threads, pids[name]))
    finally:
        os.unlink(lua)
    best = {name: max(runs, key=lambda r: r["rps"]) for name, runs in results.items()}
    summary: dict[str, Any] = {
        name: {
            "rps": b["rps"],
            "p50_ms": b["p50_ms"],
            "p99_ms": b["p99_ms"],
            "all_rps": [r["rps"] for r in results[name]],
            # CPU per request is much less exposed to other load on a shared machine than req/s
            "cpu_us_per_req": round(min(r["cpu_us_per_req"] for r in results[name]), 1),
        }
        for name, b in best.items()
    }
    if "reference" in summary:
        summary["ratio_ours_over_reference"] = round(summary["ours"]["rps"] / summary["reference"]["rps"], 3)
        # rounds run back to back, so a paired ratio is less exposed to other load on the machine
        paired = [o["rps"] / r["rps"] for o, r in zip(results["ours"], results["reference"], strict=True)]
        summary["paired_ratios"] = [round(x, 3) for x in paired]
        summary["median_paired_ratio"] = round(statistics.median(paired), 3)
    if ns.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"POST /potential_loads, {QUERY_BLOCKS} hashes, {WORKERS * RANKS} ranks x {REQUESTS_PER_RANK} active "
        f"requests; wrk -t{ns.threads} -c{ns.connections} -d{ns.duration}s, best of {ns.rounds}"
    )
    print(f"{'service':<10} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11}   runs (req/s)")
    for name, s in summary.items():
        if isinstance(s, dict):
            print(
                f"{name:<10} {s['rps']:>10.0f} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['cpu_us_per_req']:>11.1f}  "
                f" {', '.join(f'{x:.0f}' for x in s['all_rps'])}"
            )
    if "ratio_ours_over_reference" in summary:
        print(f"ratio ours/reference (best of each): {summary['ratio_ours_over_reference']:.2f}x (target >= 0.40x)")
        print(
            f"paired ratios per round: {', '.join(f'{x:.2f}' for x in summary['paired_ratios'])}; median "
            f"{summary['median_paired_ratio']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
