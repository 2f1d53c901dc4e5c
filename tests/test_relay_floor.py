"""The floor row of the benchmarks (``bench/relay_floor.py``): the cheapest relay, in front of real mocker
processes, passes every request and its streamed response through, in turn over the workers."""

from __future__ import annotations

import os
import sys

import httpx

from bench import peers
from bench.sessions import session_trace
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
from tests.test_bench_peers import TINY


def test_the_floor_relays_every_request_in_turn_over_the_workers(tmp_path) -> None:
    """As a row of ``bench peers`` (no peers' environment needed): every request answered, the prompt
    tokens reached the engines half each (round robin), the relay's CPU measured."""
    args = peers.parser().parse_args(["--workers", "2", "--out-dir", str(tmp_path), "--speedup-ratio", "0"])
    args.bin_dir = None
    trace = session_trace(TINY)
    (row,) = peers.run_mockers(trace, [peers.ROUTERS["relay-floor"]], args, peers.blocks_per_engine(trace, args))
    assert row["completed"] == row["requests"] == len(trace.requests), row["error_examples"]
    assert row["router_cpu_s"] is not None and row["router_cpu_s"] >= 0
    per_worker = [w["queries"] for w in row["cache"]["per_worker"].values()]
    assert len(per_worker) == 2 and min(per_worker) > 0, per_worker
    assert "relay-floor" not in peers.DEFAULT_ROUTERS  # a reference asked for by name, not a router


def test_a_stream_passes_through_whole_and_a_dead_worker_is_a_502(tmp_path) -> None:
    cluster = Cluster(log_dir=str(tmp_path / "logs"))
    try:
        worker = cluster.start_mocker(MockerOptions(speedup_ratio=0))
        cluster.wait_workers_ready(60)
        port, dead = cluster.port(), cluster.port()  # nothing listens on ``dead``
        url = f"http://127.0.0.1:{port}"
        args = ["-m", "bench.relay_floor", "--port", str(port), "--worker", worker.url]
        cluster.start_router("relay-floor", sys.executable, [*args, "--worker", f"http://127.0.0.1:{dead}"], url)
        peers.wait_serving(cluster, url, DEFAULT_MODEL, timeout=60)
        body = {"model": DEFAULT_MODEL, "prompt": "a floor", "max_tokens": 5, "stream": True}
        outcomes = []
        with httpx.Client(base_url=url, timeout=30) as c:
            for _ in range(4):  # in turn: the living worker, then the dead one
                with c.stream("POST", "/v1/completions", json=body) as r:
                    text = r.read().decode()
                outcomes.append((r.status_code, text.count("data: ") if r.status_code == 200 else 0))
                if r.status_code == 200:
                    assert text.rstrip().endswith("data: [DONE]"), text
        assert sorted(outcomes) == [(200, 6), (200, 6), (502, 0), (502, 0)], outcomes
    finally:
        cluster.stop()
    assert os.path.isdir(tmp_path / "logs")
