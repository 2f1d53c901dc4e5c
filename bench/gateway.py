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
of Envoy over the loaded run. Figures: docs/benchmarks.md. Nothing here asserts: benchmarks measure.
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gateway", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement [10]")
    p.add_argument("--connections", type=int, default=16, help="concurrent requests of the loaded run [16]")
    p.add_argument("--engines", type=int, default=2, help="nginx engine ports [2]")
    p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    ns = p.parse_args(argv)
    t0 = time.time()
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
