"""What kvroute's endpoint picker costs: time added per request and CPU per picked request, side by side
with kvroute as the proxy and with Envoy alone.

    python -m bench gateway                      # ~2 min: nginx engines, four paths, two loads
    python -m bench gateway --duration 20

The engines are nginx answering the chat route with a canned stream (``bench/frontend_scale.py``: a few
microseconds of CPU per request, so what is measured is the path in front of them). The same streamed
chat request (``max_tokens`` 1) goes, one path at a time:

* ``direct``: to the engines themselves (round robin by wrk's connections over one port: the floor);
* ``envoy``: through Envoy alone, round robin over the engines (what an inference gateway costs without a
  picker);
* ``kvroute proxy``: through ``python -m frontend`` (kv mode, the approximate index: nginx publishes no
  KV events);
* ``envoy + kvroute picker``: through Envoy configured as inference gateways are (ext_proc, bodies
  FULL_DUPLEX_STREAMED) with that same frontend's ``--epp-port`` as its picker.

Per path: latency p50 / p99 with one request at a time (``wrk -c1``: the time the path adds, without
queueing), req/s at ``--connections`` (default 16), and the CPU per request of the frontend process and
of Envoy over the loaded run. Figures: docs/benchmarks.md.

    python -m bench gateway --workload agentic   # ~8 min: routing quality through the gateway

``--workload``: the same multi-turn agentic schedule (bench/sessions.py, 24 sessions x 5 turns) replayed
through kvroute as its own proxy and through Envoy with kvroute's picker in each body configuration
(bodies ``FULL_DUPLEX_STREAMED`` as GIE gateways ship them; response body ``NONE``; and request body
``BUFFERED`` with response body ``NONE``), in one run, at each
``--concurrency`` (12 and 32 requests in flight at most; the schedule is made as much denser), in front
of fresh mockers per path (4, ``--speedup-ratio 4``, kv mode); the order of the paths turns at each load.
Per path: the engines' hit rate, TTFT p50 / p90, the frontend's CPU per request and, through the gateway,
the ext_proc messages per request and the frontend's CPU per streamed chunk (the full-duplex run's CPU
above the NONE run's, over its response-body messages). ``--paths proxy,none,buffered-none`` runs only
those paths, ``--runs N`` the whole run N times (the order of the paths turns from run to run), and
prints (and writes with ``--out``) per concurrency and path the mean hit rate, the medians over the runs
and each run's CPU per request above the proxy's in that run. Figures: docs/deploy.md. Nothing here
asserts: benchmarks measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.frontend_scale import MODEL, NginxUpstream, children, cpu_seconds, run_wrk

BODY = json.dumps(
    {
        "model": MODEL,
        "max_tokens": 1,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a haiku about routers."}],
    }
).encode()


def _ms(value: str) -> float:
    """wrk's latency cell (``812.00us``, ``1.23ms``, ``2.00s``) in milliseconds."""
    for unit, scale in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if value.endswith(unit):
            return round(float(value[: -len(unit)]) * scale, 3)
    return float(value)


def measure_path(
    name: str, url: str, pids: Callable[[], dict[str, list[int]]], duration: float, connections: int
) -> dict[str, Any]:
    """One path: unloaded latency (``-c1``), then req/s and CPU per request under ``connections``."""
    run_wrk(url, BODY, 2.0, connections, 1)  # warm-up: connections, tokenizer and caches
    _, quiet, errors_quiet = run_wrk(url, BODY, duration, 1, 1)
    groups = pids()
    before = {g: sum(cpu_seconds(p) for p in ps) for g, ps in groups.items()}
    rps, loaded, errors = run_wrk(url, BODY, duration, connections, 1)
    n = max(1.0, rps * duration)
    cpu = {
        f"{g}_cpu_ms_per_request": round((sum(cpu_seconds(p) for p in ps) - before[g]) * 1e3 / n, 3)
        for g, ps in groups.items()
    }
    lat = quiet["latency"]
    return {
        "path": name,
        "p50_ms_one_at_a_time": _ms(lat.get("50", "0")),
        "p99_ms_one_at_a_time": _ms(lat.get("99", "0")),
        "rps": round(rps, 1),
        "p50_ms_loaded": _ms(loaded["latency"].get("50", "0")),
        "p99_ms_loaded": _ms(loaded["latency"].get("99", "0")),
        "non_2xx": errors + errors_quiet,
        **cpu,
    }


def run(duration: float, connections: int, engines: int) -> list[dict[str, Any]]:
    from kvroute_common.local_cluster import Cluster
    from kvroute_common.local_gateway import write_config
    from kvroute_common.ports import free_port
    from kvroute_common.processes import http_ready, service

    rows = []
    with contextlib.ExitStack() as stack:
        nginx = NginxUpstream(engines)
        stack.callback(nginx.close)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-bench-gateway-"))
        cluster = stack.enter_context(Cluster())
        epp = free_port()
        frontend = cluster.start_frontend(
            "kv",
            extra_args=[
                "--log-level",
                "warning",
                "--no-router-kv-events",
                "--epp-port",
                str(epp),
                *nginx.worker_args(),
            ],
            kv_events=False,
        )
        cluster.wait_frontend_ready(MODEL)
        assert cluster.frontend is not None
        fe_pid = cluster.frontend.proc.pid
        gateways = {}
        for name, picker, rr in (("picker", epp, ()), ("envoy", None, nginx.ports)):
            gw = write_config(tmp, picker, round_robin=rr)
            proc = stack.enter_context(
                service([*gw.args(), "--concurrency", "1"], ready=http_ready(gw.ready_url), timeout=60)
            )
            gateways[name] = (gw.url, proc.pid)

        def envoy_pids(pid: int) -> list[int]:
            return [pid, *children(pid)]

        paths: Sequence[tuple[str, str, Callable[[], dict[str, list[int]]]]] = (
            ("direct", f"http://127.0.0.1:{nginx.ports[0]}", lambda: {"engines": nginx.pids()}),
            ("envoy", gateways["envoy"][0], lambda: {"envoy": envoy_pids(gateways["envoy"][1])}),
            ("kvroute proxy", frontend, lambda: {"frontend": [fe_pid]}),
            (
                "envoy + kvroute picker",
                gateways["picker"][0],
                lambda: {"frontend": [fe_pid], "envoy": envoy_pids(gateways["picker"][1])},
            ),
        )
        for name, url, pids in paths:
            row = measure_path(name, url, pids, duration, connections)
            row["loadavg_1m"] = round(os.getloadavg()[0], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# the paths of --workload: (label, gateway?, the gateway's envoy_config options)
WORKLOAD_PATHS: tuple[tuple[str, bool, tuple[tuple[str, Any], ...]], ...] = (
    ("kvroute proxy", False, ()),
    ("envoy + picker, bodies full duplex", True, ()),
    ("envoy + picker, response body NONE", True, (("response_body_mode", "NONE"),)),
    (
        "envoy + picker, request BUFFERED, response NONE",
        True,
        (("request_body_mode", "BUFFERED"), ("response_body_mode", "NONE")),
    ),
)
# --paths: short names of WORKLOAD_PATHS, in its order
PATH_NAMES = {"proxy": 0, "duplex": 1, "none": 2, "buffered-none": 3}


def _frontend_counters(url: str) -> dict[str, float]:
    """The picker's ext_proc message counts from the frontend's /metrics (before it stops)."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for kind, value in re.findall(r'^kvroute_epp_messages_total\{kind="(\w+)"\} (\S+)', text, re.M):
        out[kind] = float(value)
    return out


def run_workload(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """The agentic schedule through each path of WORKLOAD_PATHS, at each concurrency."""
    from dataclasses import replace

    import httpx

    from bench.peers import READY_TIMEOUT, RouterSpec, Testbed, blocks_per_engine, run_router
    from bench.replay import RunOptions
    from bench.sessions import AGENTIC, Workload, session_trace
    from bench.traces import oracle
    from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
    from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR

    base = Workload("agentic", (replace(AGENTIC, sessions=ns.sessions, turns=ns.turns),))
    bed = Testbed(DEFAULT_MODEL, BUILTIN_TOKENIZER_DIR, None)
    rows: list[dict[str, Any]] = []
    for i, concurrency in enumerate(ns.concurrency):
        trace = session_trace(base.at_load(concurrency / ns.concurrency[0]), ns.seed)
        sizing = argparse.Namespace(num_gpu_blocks=0, cache_fraction=0.5, workers=ns.workers)
        blocks = blocks_per_engine(trace, sizing)
        orc = round(oracle([r.tokens for r in trace.requests], bed.block_size).token_share, 3)
        mocker = MockerOptions(block_size=bed.block_size, num_gpu_blocks=blocks, speedup_ratio=ns.speedup_ratio)
        opts = RunOptions(workers=ns.workers, max_concurrency=concurrency, max_duration_s=600.0, model=DEFAULT_MODEL)
        chosen = tuple(WORKLOAD_PATHS[PATH_NAMES[n]] for n in ns.paths)
        paths = chosen if (i + ns.run_index) % 2 == 0 else tuple(reversed(chosen))
        for label, gateway, options in paths:
            spec = RouterSpec(label, "kvroute", "kv", gateway=gateway, gateway_options=options)
            with Cluster(log_dir=os.path.join(ns.log_dir, f"c{concurrency}-{len(rows)}")) as cluster:
                for _ in range(ns.workers):
                    cluster.start_mocker(mocker)
                cluster.wait_workers_ready(READY_TIMEOUT)
                row = run_router(trace, spec, cluster, bed, opts, None, cluster.check_alive)
                assert cluster.frontend_url is not None
                try:
                    messages = _frontend_counters(cluster.frontend_url)
                except httpx.HTTPError:
                    messages = {}
            done = max(1, row["completed"])
            out = {
                "path": label,
                "concurrency": concurrency,
                "requests": row["requests"],
                "completed": row["completed"],
                "hit_rate": row["hit_rate"],
                "oracle": orc,
                "ttft_p50_ms": row["ttft_ms"]["p50"],
                "ttft_p90_ms": row["ttft_ms"]["p90"],
                "frontend_cpu_ms_per_request": row["router_cpu_ms_per_request"],
                "frontend_cpu_s": row["router_cpu_s"],
                "ext_proc_messages_per_request": round(sum(messages.values()) / done, 1) if messages else None,
                "response_body_messages": messages.get("response_body", 0.0),
                "loadavg_1m": round(os.getloadavg()[0], 1),
            }
            rows.append(out)
            print(json.dumps(out), flush=True)
        by = {r["path"]: r for r in rows if r["concurrency"] == concurrency}
        duplex, none = by.get(WORKLOAD_PATHS[1][0]), by.get(WORKLOAD_PATHS[2][0])
        if duplex is not None and none is not None and duplex["response_body_messages"]:
            extra = (duplex["frontend_cpu_s"] - none["frontend_cpu_s"]) * 1e3 / duplex["response_body_messages"]
            duplex["frontend_cpu_ms_per_streamed_chunk"] = round(extra, 3)
            print(json.dumps({"concurrency": concurrency, "cpu_ms_per_streamed_chunk": round(extra, 3)}), flush=True)
    return rows


def workload_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| in flight | path | hit rate | TTFT p50 / p90 ms | frontend CPU ms / request | ext_proc messages / request "
        "| frontend CPU ms / streamed chunk | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        hit = f"{r['hit_rate']:.3f} (oracle {r['oracle']})" if r["hit_rate"] is not None else "n/a"
        lines.append(
            f"| {r['concurrency']} | {r['path']} | {hit} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} "
            f"| {r['frontend_cpu_ms_per_request']} | {r['ext_proc_messages_per_request'] or ''} "
            f"| {r.get('frontend_cpu_ms_per_streamed_chunk', '')} | {r['loadavg_1m']} |"
        )
    return "\n".join(lines)


def workload_summary(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per concurrency and path over the runs: mean hit rate, median TTFT p50 / p90 and median CPU per
    request, and the median of each run's CPU against the proxy's in that run (a run's load is the same
    for all its paths; loads differ between runs)."""
    from statistics import fmean, median

    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rows in runs:
        for r in rows:
            cells.setdefault((r["concurrency"], r["path"]), []).append(r)
    proxy = WORKLOAD_PATHS[0][0]
    out = []
    for (concurrency, path), rs in cells.items():
        hits = [r["hit_rate"] for r in rs if r["hit_rate"] is not None]
        row: dict[str, Any] = {
            "concurrency": concurrency,
            "path": path,
            "runs": len(rs),
            "hit_rate_mean": round(fmean(hits), 3) if hits else None,
            "ttft_p50_ms_median": round(median(r["ttft_p50_ms"] for r in rs), 1),
            "ttft_p90_ms_median": round(median(r["ttft_p90_ms"] for r in rs), 1),
            "frontend_cpu_ms_per_request_median": round(median(r["frontend_cpu_ms_per_request"] for r in rs), 2),
        }
        if path != proxy:
            diffs = []
            for rows in runs:
                by = {(r["concurrency"], r["path"]): r for r in rows}
                if (concurrency, path) in by and (concurrency, proxy) in by:
                    mine, theirs = by[(concurrency, path)], by[(concurrency, proxy)]
                    diffs.append(mine["frontend_cpu_ms_per_request"] - theirs["frontend_cpu_ms_per_request"])
            if diffs:
                row["cpu_minus_proxy_ms_per_run"] = [round(d, 2) for d in diffs]
                row["cpu_minus_proxy_ms_median"] = round(median(diffs), 2)
        out.append(row)
    return sorted(out, key=lambda r: (r["concurrency"], r["path"]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gateway", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("agentic",), default=None, help="routing quality through the gateway")
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[12, 32],
                   help="--workload: requests in flight at most, comma-separated [12,32]")  # fmt: skip
    p.add_argument("--sessions", type=int, default=24, help="--workload: sessions [24]")
    p.add_argument("--turns", type=int, default=5, help="--workload: turns per session [5]")
    p.add_argument("--workers", type=int, default=4, help="--workload: mockers [4]")
    p.add_argument("--speedup-ratio", type=float, default=4.0, help="--workload: mocker speed [4]")
    p.add_argument("--paths", type=lambda v: v.split(","), default=list(PATH_NAMES),
                   help=f"--workload: the paths, comma-separated, of {','.join(PATH_NAMES)} [all]")  # fmt: skip
    p.add_argument("--runs", type=int, default=1, help="--workload: whole runs, one after the other [1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="bench/out/gateway", help="--workload: the processes' logs")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement [10]")
    p.add_argument("--connections", type=int, default=16, help="concurrent requests of the loaded run [16]")
    p.add_argument("--engines", type=int, default=2, help="nginx engine ports [2]")
    p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    ns = p.parse_args(argv)
    t0 = time.time()
    if ns.workload is not None:
        unknown = [n for n in ns.paths if n not in PATH_NAMES]
        if unknown:
            p.error(f"--paths: unknown {unknown} (known: {', '.join(PATH_NAMES)})")
        runs: dict[str, Any] = {}
        for index in range(ns.runs):
            ns.run_index = index  # the order of the paths turns from run to run too
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            t_run = time.time()
            rows = run_workload(ns)
            print(workload_table(rows), flush=True)
            runs[f"run {index + 1}"] = {"started": started, "rows": rows, "seconds": round(time.time() - t_run)}
        overall = workload_summary([r["rows"] for r in runs.values()])
        for row in overall:
            print(json.dumps(row), flush=True)
        if ns.out:
            with open(ns.out, "w", encoding="utf-8") as f:
                json.dump({"runs": runs, "overall": overall, "seconds": round(time.time() - t0)}, f, indent=1)
        return 0
    rows = run(ns.duration, ns.connections, ns.engines)
    by = {r["path"]: r for r in rows}
    summary = {
        "picker_adds_ms_p50_vs_envoy": round(
            by["envoy + kvroute picker"]["p50_ms_one_at_a_time"] - by["envoy"]["p50_ms_one_at_a_time"], 3
        ),
        "proxy_adds_ms_p50_vs_direct": round(
            by["kvroute proxy"]["p50_ms_one_at_a_time"] - by["direct"]["p50_ms_one_at_a_time"], 3
        ),
        "frontend_cpu_ms_per_request_proxy": by["kvroute proxy"].get("frontend_cpu_ms_per_request"),
        "frontend_cpu_ms_per_request_picker": by["envoy + kvroute picker"].get("frontend_cpu_ms_per_request"),
        "seconds": round(time.time() - t0),
    }
    print(json.dumps(summary), flush=True)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
