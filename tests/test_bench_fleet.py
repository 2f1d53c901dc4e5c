"""The fleet testbed's harness (``bench peers --testbed fleet``): its workloads have the published shapes,
its engines are sized as an H200 holds the 32B model, Dynamo's selector serves through the thin gateway,
and a tiny sweep yields medians, spreads and goodput. Not a benchmark: no figure is asserted."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time

import pytest

from bench import fleet, peers
from bench.sessions import SessionGroup, Workload, session_trace
from bench.traces import Trace, TraceRequest
from kvroute_common.local_cluster import Cluster
from kvroute_common.processes import wait_until
from mocker.gpu_profile import GpuProfile


def test_the_shared_prefix_scenario_is_llm_ds():
    """Defaults are llm-d's published parameters; every prompt starts with its group's system prompt."""
    sp = fleet.SharedPrefix()
    assert (sp.groups, sp.users_per_group, sp.system_tokens, sp.question_tokens, sp.output_tokens) == (
        150, 5, 6000, 1200, 1000,
    )  # fmt: skip
    small = fleet.SharedPrefix(groups=3, users_per_group=2, system_tokens=300, question_tokens=50, duration_s=5.0)
    trace = small.trace(rate=8.0, seed=1)
    assert 10 < len(trace.requests) < 80  # Poisson at 8 QPS for 5 s
    assert all(0 <= r.arrival_s < 5.0 for r in trace.requests)
    assert all(r.max_tokens == fleet.MAX_OUTPUT_TOKENS for r in trace.requests)
    systems = {r.text.split("\n\nUser:")[0] for r in trace.requests if r.text}
    assert 1 < len(systems) <= 3
    assert len({r.text for r in trace.requests}) <= 6  # 3 groups x 2 users: prompts repeat
    for r in trace.requests:
        assert 300 <= len(r.tokens) <= 500  # about 300 + 50 tokens


def test_a_mooncake_trace_becomes_text_that_keeps_its_block_reuse(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 1536, "output_length": 300, "hash_ids": [1, 2, 3]},
        {"timestamp": 900, "input_length": 512, "output_length": 5, "hash_ids": [4]},
        {"timestamp": 5000, "input_length": 512, "output_length": 5, "hash_ids": [5]},
    ]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    trace = fleet.mooncake_text_trace(str(path), "t", window_s=2.0, rate=2.0, seed=0, max_tokens=32768)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.25, 0.45]  # the window, twice as dense
    a, b, c = trace.requests
    assert b.text is not None and a.text is not None and b.text.startswith(a.text)
    assert b.tokens[: len(a.tokens) - 1] == a.tokens[:-1]
    assert 400 < len(c.tokens) < 650  # one block: about 512 tokens
    assert b.max_tokens == fleet.MAX_OUTPUT_TOKENS and a.max_tokens == 10


def test_the_engines_hold_what_an_h200_holds_beside_the_32b_weights():
    tokens = GpuProfile.load(fleet.PROFILE).kv_capacity_tokens()
    assert tokens == int((139.8 - 61.0) * 1024**3 // 262144)
    assert fleet.engine_blocks(32) == tokens // 32 + 1


def test_goodput_is_the_highest_rate_under_the_slo():
    def cell(rate: float, p90: dict[str, float], errors: int = 0) -> dict:
        return {"rate": rate, "routers": [
            {"router": k, "errors": errors, "ttft_p90": {"median": v}} for k, v in p90.items()
        ]}  # fmt: skip

    cells = [cell(1, {"a": 100, "b": 100}), cell(2, {"a": 150, "b": 900}), cell(4, {"a": 300, "b": 100}, errors=1)]
    assert fleet.goodput(cells, 200) == {"a": 2, "b": 1}
    assert fleet.goodput([cell(1, {"a": 500})], 200) == {"a": None}


TINY = Workload(
    "tiny",
    (SessionGroup("tiny", sessions=3, turns=2, prefixes=2, prefix_tokens=(200, 300), user_tokens=32,
                  reply_tokens=32, output_tokens=2, start_window_s=0.5, think_s=0.1, think_min_s=0.1),),
)  # fmt: skip


def test_dynamos_selector_serves_every_request_through_the_gateway(tmp_path):
    """The thin gateway: tokenize, select_and_reserve, forward, prefill_complete, free; the selector is
    its child, so the router's CPU covers both."""
    args = peers.parser().parse_args(["--workers", "2", "--out-dir", str(tmp_path), "--speedup-ratio", "0"])
    args.workers, args.bin_dir = 2, None
    trace = session_trace(TINY)
    rows = peers.run_mockers(trace, [peers.ROUTERS["dynamo-select"]], args, peers.blocks_per_engine(trace, args))
    (row,) = rows
    assert row["completed"] == row["requests"] == len(trace.requests), row["error_examples"]
    assert row["hit_rate"] is not None and row["hit_rate"] > 0
    assert row["router_cpu_s"] is not None and row["router_cpu_s"] > 0


def test_a_tiny_fleet_sweep_gives_medians_spreads_and_goodput(tmp_path, monkeypatch):
    """Two engines timed by the profile, two rates, two runs each with the order rotated: every cell has
    its medians and spread in simulated ms, and goodput is read from the sweep."""

    def build(rate: float, seed: int, quick: bool) -> Trace:
        trace = session_trace(TINY.at_load(rate), seed)
        return Trace("tiny", [TraceRequest(r.index, r.arrival_s, r.tokens, r.max_tokens, r.session, r.text)
                              for r in trace.requests], trace.scaling)  # fmt: skip

    w = fleet.FleetWorkload("tiny", (1.0, 2.0), (1.0,), "x", build)
    args = argparse.Namespace(quick=False, runs=2, seed=0, workers=2, slowdown=2.0, slo_ms=10_000.0,
                              out_dir=str(tmp_path), max_concurrency=64, max_duration=120.0, request_timeout=60.0,
                              bin_dir=None)  # fmt: skip
    specs = [peers.ROUTERS["kvroute-kv"], peers.ROUTERS["round_robin"]]
    order: list[str] = []
    real_run_once = fleet.run_once

    def spy(trace, spec, engines, a, tag):
        order.append(spec.label)
        return real_run_once(trace, spec, engines, a, tag)

    monkeypatch.setattr(fleet, "run_once", spy)
    engines = fleet.start_engines(args, str(tmp_path / "engines"))
    try:
        result = fleet.run_workload(w, specs, engines, args)
    finally:
        engines.stop()
    assert order == ["kvroute-kv", "round_robin", "round_robin", "kvroute-kv"] * 2  # rotated per run
    assert [c["rate"] for c in result["cells"]] == [1.0, 2.0]
    for cell in result["cells"]:
        for r in cell["routers"]:
            assert r["runs"] == 2 and r["errors"] == 0
            p90 = r["ttft_p90"]
            assert p90["min"] <= p90["median"] <= p90["max"]
            assert p90["median"] > 20  # simulated ms: at least a 32B prefill of a few hundred tokens
            assert r["hit_rate"]["median"] is not None
    assert result["goodput"] == {"kvroute-kv": 2.0, "round_robin": 2.0}
    for cell in result["cells"]:  # every run's seconds: reset, start until it serves, replay
        assert len(cell["phases_s"]) == 4
        for p in cell["phases_s"]:
            assert 0 <= p["reset"] < p["replay"] and 0 < p["start"]
    over = fleet.overhead([result])
    assert over["runs"] == 8 and over["start"] > 0 and over["replay"] > over["reset"]
    text = fleet.markdown({"engines": "e", "command": "c", "peers": "p", "machine": "m", "slo_ms": 1.0, "runs": 2,
                           "workloads": [result, {"workload": "x", "skipped": "why"}]})  # fmt: skip
    assert "kvroute-kv" in text and "not run (why)" in text


@pytest.mark.parametrize("name", ["shared-prefix", "conversation", "agentic"])
def test_every_fleet_workload_builds(name):
    w = fleet.WORKLOADS_FLEET[name]
    trace = w.build(w.quick_rates[0], 0, True)
    assert trace.requests and all(r.text or r.messages for r in trace.requests)


def test_a_router_is_stopped_behind_the_next_run_and_killed_after_its_grace(tmp_path):
    """Stopping a router does not hold up the next run; one that ignores SIGTERM is killed after the grace."""
    cluster = Cluster(log_dir=str(tmp_path))
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up'); time.sleep(60)"
    child = cluster.start_router("stubborn", sys.executable, ["-c", stubborn], "http://127.0.0.1:9")
    wait_until(lambda: "up" in child.log_tail(), timeout=30, what="SIGTERM ignored")
    stopping = fleet.Stopping(grace=0.5)
    t0 = time.perf_counter()
    stopping.stop(cluster)
    assert time.perf_counter() - t0 < 0.2  # returned at once: the stop goes on behind
    assert child.proc.poll() is None
    stopping.join()
    assert time.perf_counter() - t0 < 10
    assert child.proc.wait(timeout=5) == -9  # SIGKILL after the grace
    assert stopping.threads == []


def test_rates_are_parsed_for_the_fleet_and_bad_ones_refused(tmp_path):
    args = peers.parser().parse_args(["--testbed", "fleet", "--rates", "4,8", "--out-dir", str(tmp_path)])
    assert args.rates == "4,8"
    for bad in ("x", "0,4"):
        with pytest.raises(SystemExit, match="--rates"):
            fleet.run_fleet(peers.parser().parse_args(["--testbed", "fleet", "--rates", bad, "--routers",
                                                       "kvroute-kv", "--out-dir", str(tmp_path)]), "c")  # fmt: skip


def _wl(cells: list[dict], goodput: dict) -> dict:
    return {"workload": "w", "rate_unit": "QPS", "cells": cells, "goodput": goodput}


def _router(name: str, hit: float, p90: float, p99: float, errors: int = 0) -> dict:
    return {"router": name, "errors": errors, "hit_rate": {"median": hit},
            "ttft_p90": {"median": p90}, "ttft_p99": {"median": p99}}  # fmt: skip


def test_the_recommended_mode_is_named_behind_where_a_peer_beats_it():
    """Hit rate, TTFT p90 and p99 medians per cell, then goodput; kvroute's other modes and routers with
    failed requests are not compared."""
    cell = {"rate": 8.0, "routers": [
        _router("kvroute-latency", 0.40, 900, 1500), _router("kvroute-kv", 0.9, 100, 100),
        _router("smg-prefix_hash", 0.46, 1000, 1400), _router("round_robin", 0.1, 800, 2000),
        _router("vllm-kv_aware", 0.99, 1, 1, errors=3),
    ]}  # fmt: skip
    lost = fleet.behind(_wl([cell], {"kvroute-latency": 8.0, "smg-prefix_hash": 16.0, "round_robin": None}))
    assert lost == [
        "8 QPS: hit rate to smg-prefix_hash (46.0% vs 40.0%)",
        "8 QPS: TTFT p99 to smg-prefix_hash (1,400 vs 1,500 ms)",
        "8 QPS: TTFT p90 to round_robin (800 vs 900 ms)",
        "goodput to smg-prefix_hash (16 vs 8 QPS)",
    ]
    ahead = {"rate": 8.0, "routers": [_router("kvroute-latency", 0.5, 100, 100), _router("round_robin", 0.1, 800, 900)]}
    assert fleet.behind(_wl([ahead], {"kvroute-latency": 8.0, "round_robin": 8.0})) == []


def test_goodput_gain_over_round_robin_says_what_the_sweep_resolves():
    cells = [{"rate": r, "routers": []} for r in (8.0, 16.0, 24.0)]
    assert fleet.goodput_gain(_wl(cells, {"kvroute-latency": 16.0, "round_robin": 8.0})) == "16 against 8 QPS: +100%"
    top = fleet.goodput_gain(_wl(cells, {"kvroute-latency": 24.0, "round_robin": 8.0}))
    assert top.startswith("24 against 8 QPS: +200%") and "or more" in top
    assert "round robin met the SLO at no swept rate" in fleet.goodput_gain(
        _wl(cells, {"kvroute-latency": 8.0, "round_robin": None})
    )
    assert "neither" in fleet.goodput_gain(_wl(cells, {"kvroute-latency": None, "round_robin": None}))
