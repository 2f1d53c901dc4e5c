"""Trace handling of the replay benchmark: Mooncake loading/scaling, token determinism, the oracle,
the synthetic generator, counters and statistics (no processes; fast)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest

from bench.replay import (
    RequestResult,
    cache_delta,
    markdown_report,
    percentile,
    read_counter,
    summarize,
    verdict,
    write_outputs,
)
from bench.synthetic import SyntheticConfig, synthetic_trace
from bench.traces import (
    DEFAULT_TRACES_DIR,
    MOONCAKE_SHA256,
    MOONCAKE_TRACES,
    BlockTokens,
    Scaling,
    find_trace,
    load_mooncake,
    oracle,
    read_mooncake,
    trace_sha256,
)  # fmt: skip


def write_trace(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


TINY_ROWS = [
    {"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 1300, "output_length": 7, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 1000, "hash_ids": [1, 4]},
    {"timestamp": 9000, "input_length": 512, "output_length": 1, "hash_ids": [5]},
]


def test_block_tokens_are_deterministic_per_id_and_seed():
    a, b = BlockTokens(32, seed=3), BlockTokens(32, seed=3)
    assert a(17) == b(17)
    assert len(a(17)) == 32
    assert a(17) != a(18)
    assert BlockTokens(32, seed=4)(17) != a(17)
    assert all(1000 <= t < 16000 for t in a(17))


def test_mooncake_scaling_keeps_prefix_structure_and_cuts_last_block(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TINY_ROWS)
    sc = Scaling(window_s=None, tokens_per_block=16, max_prompt_tokens=None, output_scale=0.1, max_output_tokens=50)
    t1 = load_mooncake(path, sc, seed=1)
    t2 = load_mooncake(path, sc, seed=1)
    assert [r.tokens for r in t1.requests] == [r.tokens for r in t2.requests]
    r0, r1, r2, r3 = t1.requests
    assert len(r0.tokens) == 32  # 1024 tokens x 16/512
    assert len(r1.tokens) == round(1300 * 16 / 512) == 41  # last block cut
    assert r1.tokens[:32] == r0.tokens  # same ids -> same prefix tokens
    assert r2.tokens[:16] == r0.tokens[:16] and r2.tokens[16:] != r0.tokens[16:19]
    assert [r.max_tokens for r in t1.requests] == [10, 1, 50, 1]  # clamp(round(out x 0.1), 1, 50)
    assert [r.arrival_s for r in t1.requests] == [0.0, 0.5, 2.0, 9.0]
    assert load_mooncake(path, sc, seed=2).requests[0].tokens != r0.tokens


def test_mooncake_window_and_rate_scaling(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TINY_ROWS)
    t = load_mooncake(path, Scaling(start_s=0.4, window_s=5.0, rate_scale=2.0, tokens_per_block=8))
    assert [r.arrival_s for r in t.requests] == [0.0, 0.75]  # rows at 0.5 s and 2.0 s, 2x faster, rebased
    assert "2x faster" in t.scaling["description"] and "8 tokens" in t.scaling["description"]
    assert len(load_mooncake(path, Scaling(window_s=None, max_requests=3)).requests) == 3
    capped = load_mooncake(path, Scaling(window_s=None, tokens_per_block=16, max_prompt_tokens=20))
    assert max(len(r.tokens) for r in capped.requests) == 20


def test_mooncake_bad_row_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_mooncake(str(path))


def test_oracle_on_hand_made_trace():
    a = list(range(1, 9))  # two blocks of 4
    prompts = [
        a,  # nothing seen: 0 hits
        a + [9, 10, 11, 12, 13],  # blocks 1-2 seen, 3 new: 2 hits
        [1, 2, 3, 4, 99, 98, 97, 96],  # block 1 seen: 1 hit
        a,  # both seen, but the last token is always computed: 1 hit (2 without that rule)
        [5, 6, 7, 8, 1, 2, 3, 4],  # same block contents as earlier but a different prefix: 0 hits
    ]
    o = oracle(prompts, 4)
    assert (o.prompt_blocks, o.hit_blocks, o.prompt_tokens) == (11, 4, 45)
    assert o.block_share == pytest.approx(4 / 11)
    assert o.token_share == pytest.approx(16 / 45)
    assert oracle(prompts, 4, recompute_last_token=False).hit_blocks == 5
    assert oracle([], 4).token_share == 0.0


def test_oracle_matches_hash_id_reuse_when_one_trace_block_is_one_engine_block(tmp_path):
    rows = [
        {"timestamp": i * 10, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 7], [8, 2, 3]])
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    t = load_mooncake(path, Scaling(window_s=None, tokens_per_block=8, max_prompt_tokens=None))
    o = oracle([r.tokens for r in t.requests], 8, recompute_last_token=False)
    # prefix-id reuse: [1,2] of row 2, [1] of row 3, [1,2,3] of row 5 -> 6 of 16 blocks
    assert (o.hit_blocks, o.prompt_blocks) == (6, 16)


def test_synthetic_generator_is_deterministic_and_multi_turn():
    cfg = SyntheticConfig(
        seed=5,
        sessions=6,
        turns=3,
        system_prompts=2,
        system_tokens=64,
        user_tokens=20,
        reply_tokens=10,
        start_window_s=5.0,
        think_s=1.0,
    )
    t1, t2 = synthetic_trace(cfg), synthetic_trace(cfg)
    assert [(r.arrival_s, r.tokens, r.max_tokens, r.session) for r in t1.requests] == [
        (r.arrival_s, r.tokens, r.max_tokens, r.session) for r in t2.requests
    ]
    assert len(t1.requests) == 18
    assert [r.arrival_s for r in t1.requests] == sorted(r.arrival_s for r in t1.requests)
    assert synthetic_trace(dataclasses.replace(cfg, seed=6)).requests[0].tokens != t1.requests[0].tokens
    by_session: dict[int, list] = {}
    for r in t1.requests:
        by_session.setdefault(r.session, []).append(r.tokens)
    systems = set()
    for turns in by_session.values():
        assert len(turns) == 3
        for prev, nxt in itertools.pairwise(turns):
            assert nxt[: len(prev)] == prev and len(nxt) > len(prev) + 10  # history grows by reply + new message
        systems.add(tuple(turns[0][:64]))
    assert 1 <= len(systems) <= 2  # sessions share the system prompts
    o = oracle([r.tokens for r in t1.requests], 16)
    assert 0.4 < o.token_share < 1.0


def test_real_mooncake_traces_load():
    for name in MOONCAKE_TRACES:
        path = find_trace(name)
        assert path is not None, f"{name}: not vendored in {DEFAULT_TRACES_DIR}"
        t = load_mooncake(path, Scaling(window_s=120.0, tokens_per_block=16, max_prompt_tokens=2048), name=name)
        assert len(t.requests) > 50
        assert all(0 < len(r.tokens) <= 2048 and r.max_tokens >= 1 for r in t.requests)
        assert 0.0 < oracle([r.tokens for r in t.requests], 16).token_share < 1.0


def test_vendored_traces_match_the_published_checksums():
    """bench/data/ holds the Mooncake traces gzip-compressed; their content is byte-identical to upstream."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.samefile(DEFAULT_TRACES_DIR, os.path.join(repo, "bench", "data"))  # inside the clone, not ../shared
    for fname, digest in MOONCAKE_SHA256.items():
        path = os.path.join(DEFAULT_TRACES_DIR, fname + ".gz")
        assert os.path.getsize(path) < 2_000_000
        assert trace_sha256(path) == digest, f"{path}: content differs from the published trace"
    rows = read_mooncake(find_trace("mooncake_synthetic"))
    assert len(rows) == 3993 and rows[0]["hash_ids"]


def test_gzip_and_plain_traces_read_the_same(tmp_path):
    import gzip

    plain = write_trace(tmp_path / "t.jsonl", TINY_ROWS)
    with open(plain, "rb") as f, gzip.open(tmp_path / "u.jsonl.gz", "wb") as g:
        g.write(f.read())
    assert read_mooncake(plain) == read_mooncake(str(tmp_path / "u.jsonl.gz"))
    assert find_trace("u.jsonl", str(tmp_path)) == str(tmp_path / "u.jsonl.gz")
    assert find_trace("nothing.jsonl", str(tmp_path)) is None
    assert load_mooncake(str(tmp_path / "u.jsonl.gz"), Scaling(window_s=None)).name == "u"
    assert trace_sha256(plain) == trace_sha256(str(tmp_path / "u.jsonl.gz"))


METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
"""


def test_counters_and_deltas():
    assert read_counter(METRICS, "vllm:prefix_cache_queries") == 150.0
    assert read_counter(METRICS, "vllm:prefix_cache_hits") == 30.0
    assert read_counter(METRICS, "vllm:num_requests_running") is None
    d = cache_delta({"a": (10.0, 0.0), "b": (0.0, 0.0)}, {"a": (110.0, 40.0), "b": (100.0, 20.0)})
    assert d["hit_rate"] == pytest.approx(60 / 200)
    assert cache_delta({"a": None}, {"a": (1.0, 1.0)}) is None


def test_summary_report_and_outputs(tmp_path):
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None
    results = [
        RequestResult(i, 0.0, ttft_s=0.01 * (i + 1), e2e_s=0.1, prompt_tokens=100, output_chunks=4, cached_tokens=50)
        for i in range(10)
    ]
    results.append(RequestResult(10, 0.0, error="HTTP 503: no worker"))
    s = summarize(results, 2.0)
    assert s["completed"] == 10 and s["errors"] == {"HTTP 503": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(55.0) and s["throughput_rps"] == 5.0 and s["usage_cached_share"] == 0.5
    rr = {**s, "mode": "round_robin", "hit_rate": 0.2, "ttft_ms": {"p50": 200.0, "p90": 300.0, "p99": 400.0}}
    report = {
        "trace": {
            "name": "tiny",
            "requests": 11,
            "span_s": 1.0,
            "rate_rps": 11.0,
            "mean_prompt_tokens": 100,
            "max_prompt_tokens": 100,
            "mean_output_tokens": 4,
        },
        "scaling": {"description": "tiny"},
        "oracle": {"token_share": 0.5, "block_share": 0.5},
        "setup": "none",
        "command": "python -m bench replay --trace tiny",
        "modes": [{**s, "mode": "kv", "hit_rate": 0.48}, rr],
    }
    report["verdict"] = verdict(report)
    assert any("96% of the oracle" in v and "met" in v for v in report["verdict"])
    assert any("0.28 x round_robin" in v for v in report["verdict"])
    md = markdown_report(report)
    assert "| kv |" in md and "| round_robin |" in md and "48.0 %" in md
    paths = write_outputs(report, str(tmp_path), "tiny")
    assert json.load(open(paths["json"]))["modes"][0]["mode"] == "kv"
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(paths["png"]) < 200_000


def _row(mode: str, router_mode: str, hit: float, p50: float, p90: float) -> dict:
    return {
        "mode": mode,
        "router_mode": router_mode,
        "hit_rate": hit,
        "requests": 10,
        "completed": 10,
        "ttft_ms": {"p50": p50, "p90": p90, "p99": p90 * 2},
        "e2e_ms": {"p50": p50 * 2, "p90": p90 * 2, "p99": p90 * 3},
    }


def test_latency_verdict_and_the_side_by_side_summary(tmp_path):
    from bench.replay import parse_loads, summary_table, write_summary

    def report(speed: float, lat_p90: float) -> dict:
        r = {
            "trace": {"name": "tiny", "requests": 10},
            "oracle": {"token_share": 0.5},
            "speedup_ratio": speed,
            "command": "python -m bench replay --trace tiny --speedup-ratio 0.5,0.35",
            "modes": [
                _row("latency", "latency", 0.48, 40.0, lat_p90),
                _row("kv", "kv", 0.40, 80.0, 150.0),
                _row("kv-w4", "kv", 0.46, 60.0, 120.0),
                _row("round_robin", "round_robin", 0.25, 100.0, 300.0),
            ],
        }
        r["verdict"] = verdict(r)
        return r

    good, bad = report(0.5, 100.0), report(0.35, 130.0)
    lat = next(v for v in good["verdict"] if v.startswith("latency:"))
    assert (
        "96% of the oracle" in lat and "goal >= 95%: met" in lat and "0.40 x round_robin's (goal <= 0.45: met)" in lat
    )
    assert "best kv 120 ms" in lat and "goal < every kv weight: met" in lat
    assert "goal < every kv weight: NOT met" in next(v for v in bad["verdict"] if v.startswith("latency:"))
    assert any(
        v.startswith("kv-w4:") and "goal >= 90%: met" in v for v in good["verdict"]
    )  # kv rows keep the first goal
    table = summary_table([good, bad])
    assert "| tiny | 0.5 | 50.0% | 96%, 40 / 100 (0.40x) |" in table and "| tiny | 0.35 |" in table
    paths = write_summary([good, bad], str(tmp_path))
    assert "Replay summary" in open(paths["md"]).read()
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert parse_loads("0.5, 0.35") == [0.5, 0.35]
    for bad_text in ("", "fast", "-1"):
        with pytest.raises(SystemExit):
            parse_loads(bad_text)


def test_pooled_lru_reuse_is_bounded_by_capacity():
    from bench.traces import pooled_lru_hits

    a, b = list(range(1, 17)), list(range(101, 117))  # 4 blocks of 4 each
    prompts = [a, b, a + [0]]  # a comes back after b
    assert pooled_lru_hits(prompts, 4, capacity_blocks=100).hit_blocks == oracle(prompts, 4).hit_blocks == 4
    assert pooled_lru_hits(prompts, 4, capacity_blocks=4).hit_blocks == 0  # b evicted all of a
    assert (
        pooled_lru_hits(prompts, 4, capacity_blocks=6).hit_blocks == 0
    )  # a's first blocks are the oldest: the prefix is gone


def test_distinct_blocks_counts_prefix_paths_once():
    from bench.traces import distinct_blocks

    a, b = list(range(1, 17)), list(range(101, 117))  # 4 blocks of 4 each
    assert (
        distinct_blocks([a, b, a + [0], a[:8] + b[:8]], 4) == 4 + 4 + 2
    )  # a's tail and repeats are known; a[:8]+b[:8] adds 2 new paths
    assert distinct_blocks([], 4) == 0


def test_offline_routing_simulation_compares_cost_models():
    """bench.routing_sim: the replay's schedule through the real router cores and the mocker's scheduler in
    virtual time."""
    from bench.routing_sim import simulate, ttft_floor_ms

    t = synthetic_trace(
        SyntheticConfig(
            sessions=8,
            turns=4,
            system_prompts=2,
            system_tokens=256,
            user_tokens=64,
            reply_tokens=64,
            output_tokens=2,
            start_window_s=2.0,
            think_s=0.5,
            think_min_s=0.2,
        )
    )
    orc = oracle([r.tokens for r in t.requests], 16).token_share
    rows = {p: simulate(t, p, workers=3, blocks=2048, speedup=0.5) for p in ("latency", "kv", "round_robin")}
    for r in rows.values():
        assert r["completed"] == r["requests"] == len(t.requests)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
        assert 0.0 <= r["hit_rate"] <= orc + 1e-9
    assert rows["latency"]["hit_rate"] > rows["round_robin"]["hit_rate"]
    assert rows["latency"]["latency_models"]  # it learned from the simulated first tokens
    assert simulate(t, "latency", 3, 2048, 0.5) == rows["latency"]  # deterministic
    assert 0 < ttft_floor_ms(t, 16, 0.5) <= rows["latency"]["ttft_ms"]["p50"]
    # a client that keeps at most 2 in flight, as the replay's --max-concurrency: every request still runs
    assert rows["latency"]["most_in_flight"] > 2
    capped = simulate(t, "latency", 3, 2048, 0.5, max_concurrency=2)
    assert capped["most_in_flight"] == 2 and capped["completed"] == len(t.requests)


def test_the_sweep_compares_policies_cell_by_cell():
    """``routing_sim --sweep``: per cell each policy's oracle share and TTFT percentiles, then a summary with
    the cells where a policy's p90 is above the first's. On the peers testbed's fast engines (seed 4, 12 in
    flight) every engine gets one system prompt's sessions, as SGLang's smallest-tree rule places them, with
    or without the new-prefix charge: two prompts piled onto one engine while ranks with a few observations
    were scored against the prior (``router.latency.scoring_models``), not for want of the charge."""
    from bench.routing_sim import simulate, sweep, sweep_cells
    from bench.sessions import WORKLOADS, session_trace

    cells = sweep_cells([1, 2])
    assert len(cells) == len(WORKLOADS) * 2 * 5 * 2 + 2 * 2 and ("agentic-dense", 4.0, 4096, 32, 2) in cells
    table = sweep(["latency", "latency:n=0"], [8], jobs=1, cells=[("agentic-dense", 4.0, 4096, 12, 8)])
    rows = [line for line in table.splitlines() if line.startswith("| agentic-dense | 4 | 4096 | 12 |")]
    assert len(rows) == 1 and rows[0].count(" %, ") == 2
    summary = [line for line in table.splitlines() if line.startswith("| latency")]
    assert len(summary) == 2 and summary[0].endswith("| 0 of 1 |")  # the reference is never above itself
    trace = session_trace(WORKLOADS["agentic-dense"], 4)
    new = simulate(trace, "latency", 4, 4096, 4.0, seed=4, max_concurrency=12)
    old = simulate(trace, "latency:n=0", 4, 4096, 4.0, seed=4, max_concurrency=12)
    tree = simulate(trace, "tree", 4, 4096, 4.0, seed=4, max_concurrency=12)
    assert sorted(new["requests_per_worker"]) == sorted(tree["requests_per_worker"])  # one prompt per engine
    assert sorted(old["requests_per_worker"]) == sorted(new["requests_per_worker"])
    assert (old["hit_rate"], old["ttft_ms"]) == (new["hit_rate"], new["ttft_ms"])  # the same decisions here
