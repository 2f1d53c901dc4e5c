"""End-to-end smoke of the trace replay: real mockers + frontend processes, tiny schedules, sane numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.replay import main as replay_main
from kvroute_common.local_cluster import MockerOptions, start_cluster
from support import REPO_ROOT

TINY_SYNTHETIC = [
    "--sessions", "4", "--turns", "3", "--system-prompts", "2", "--system-tokens", "64", "--user-tokens", "24",
    "--reply-tokens", "16", "--output-tokens", "4", "--start-window", "1", "--think-time", "0.3", "--think-min", "0.2",
]  # fmt: skip


def check_mode(m: dict, requests: int) -> None:
    assert m["completed"] == m["requests"] == requests, m
    for key in ("ttft_ms", "e2e_ms"):
        assert 0 < m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"] < 60_000, m
    assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"]
    assert m["throughput_rps"] > 0
    assert m["hit_rate"] is not None and 0.0 <= m["hit_rate"] <= 1.0, m
    assert m["cache"]["queries"] > 0
    # the per-request usage (cached_tokens of the final stream chunk) agrees with the engines' counters
    assert m["usage_cached_share"] is not None and abs(m["usage_cached_share"] - m["hit_rate"]) < 0.02, m


def test_replay_cli_starts_cold_clusters_per_mode_and_writes_outputs(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "replay", "--trace", "synthetic", "--modes", "kv,round_robin",
           "--workers", "2", "--variant", "none", "--num-gpu-blocks", "256", "--speedup-ratio", "10",
           "--max-duration", "60", "--out-dir", str(out), *TINY_SYNTHETIC]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "oracle" in run.stdout and "[kv]" in run.stdout and "[round_robin]" in run.stdout  # progress output
    for ext in ("json", "md", "png"):
        assert (out / f"synthetic.{ext}").stat().st_size > 0
    report = json.loads((out / "synthetic.json").read_text())
    assert [m["mode"] for m in report["modes"]] == ["kv", "round_robin"]
    for m in report["modes"]:
        check_mode(m, 12)
    assert 0.0 < report["oracle"]["token_share"] < 1.0
    assert report["pooled_lru"]["capacity_blocks"] == 2 * 256
    assert report["pooled_lru"]["token_share"] <= report["oracle"]["token_share"]
    # the cache can never beat the oracle (same block size, same schedule)
    assert all(m["hit_rate"] <= report["oracle"]["token_share"] + 1e-9 for m in report["modes"])
    md = (out / "synthetic.md").read_text()
    assert "| kv |" in md and "oracle" in md and "python -m bench replay" in md


def test_replay_against_a_running_frontend_with_a_mooncake_slice(tmp_path):
    trace = tmp_path / "tiny.jsonl"
    rows = [
        {"timestamp": i * 100, "input_length": 1024 + 100 * i, "output_length": 40, "hash_ids": [0, 1, 100 + i]}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = MockerOptions(num_gpu_blocks=256, speedup_ratio=10)
    with start_cluster(2, opts, router_mode="kv", log_dir=str(tmp_path / "logs")) as cluster:
        args = ["--trace", str(trace), "--url", cluster.frontend_url, "--label", "kv-external",
                "--out-dir", str(tmp_path / "out"), "--window", "0", "--rate-scale", "4", "--tokens-per-block", "32",
                "--output-scale", "0.1"]  # fmt: skip
        for w in cluster.workers:
            args += ["--metrics-url", w.metrics_url]
        assert replay_main(args) == 0
        assert all(c.alive() for c in [cluster.frontend, *(w.child for w in cluster.workers)])
    report = json.loads((tmp_path / "out" / "tiny.json").read_text())
    (m,) = report["modes"]
    assert m["mode"] == "kv-external"
    check_mode(m, 8)
    assert "4x faster" in report["scaling"]["description"]
    # 8 prompts of 2 shared trace blocks (64 tokens = 4 blocks of 16) + 1 own block: 7 x 4 blocks reusable
    assert report["oracle"]["hit_blocks"] == 28
    assert m["hit_rate"] > 0.0
    assert os.path.exists(tmp_path / "out" / "tiny.png")


def test_auto_kv_blocks_hold_the_mooncake_schedules_distinct_blocks(tmp_path):
    from bench.replay import DEFAULT_WINDOWS, SYNTHETIC_GPU_BLOCKS, build_trace, gpu_blocks_for, parser
    from bench.traces import distinct_blocks

    trace = tmp_path / "tiny.jsonl"
    rows = [
        {
            "timestamp": i * 100,
            "input_length": 4096,
            "output_length": 4,
            "hash_ids": [0, 1] + [1000 * i + j for j in range(6)],
        }
        for i in range(40)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = parser().parse_args(["--trace", str(trace), "--workers", "3", "--tokens-per-block", "64"])
    t = build_trace(str(trace), args)
    assert len(t.requests) == 40 and t.scaling["window_s"] == 600.0  # a path gets the generic window
    distinct = distinct_blocks([r.tokens for r in t.requests], 16)
    blocks = gpu_blocks_for(t, args)
    assert blocks % 1024 == 0 and blocks * 3 >= distinct > (blocks - 1024) * 3  # pooled capacity ~ the distinct blocks
    assert gpu_blocks_for(t, parser().parse_args(["--num-gpu-blocks", "777"])) == 777
    synth = build_trace("synthetic", parser().parse_args(TINY_SYNTHETIC))
    assert gpu_blocks_for(synth, parser().parse_args([])) == SYNTHETIC_GPU_BLOCKS
    with pytest.raises(SystemExit):
        gpu_blocks_for(t, parser().parse_args(["--num-gpu-blocks", "lots"]))
    assert DEFAULT_WINDOWS["mooncake_synthetic"] == 0.0  # the whole 17-minute trace (its 64 % reuse)


def test_mooncake_replay_runs_from_a_clean_copy_without_shared(tmp_path):
    """``python -m bench replay --trace mooncake_synthetic`` needs nothing outside the repository."""
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(REPO_ROOT, clone, ignore=shutil.ignore_patterns(".git", "__pycache__", "out", ".benchmarks"))
    assert not (tmp_path / "shared").exists()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "replay", "--trace", "mooncake_synthetic", "--modes", "latency",
           "--variant", "none", "--workers", "1", "--max-requests", "12", "--num-gpu-blocks", "1024",
           "--speedup-ratio", "10", "--max-duration", "60", "--out-dir", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=clone, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "mooncake_synthetic.json").read_text())
    assert report["trace"]["requests"] == 12
    check_mode(report["modes"][0], 12)


def test_disaggregated_row(tmp_path):
    from bench.replay import ModeSpec

    assert ModeSpec.parse_variant("kv-disagg=kv,prefill=1,--router-kv-overlap-score-weight=2") == ModeSpec(
        "kv-disagg", "kv", ("--router-kv-overlap-score-weight=2",), 1
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "replay", "--trace", "synthetic", "--modes", "kv", "--workers", "2",
           "--variant", "kv-disagg=kv,prefill=1", "--num-gpu-blocks", "256", "--speedup-ratio", "10",
           "--max-duration", "60", "--out-dir", str(out), *TINY_SYNTHETIC]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (js,) = [p for p in os.listdir(out) if p.endswith(".json")]
    report = json.loads((out / js).read_text())
    rows = {m["mode"]: m for m in report["modes"]}
    disagg = rows["kv-disagg"]
    assert disagg["prefill_workers"] == 1 and disagg["completed"] == disagg["requests"] > 0, disagg
    assert 0 < disagg["ttft_ms"]["p50"] <= disagg["e2e_ms"]["p50"]
    assert "disaggregated" in (out / js.replace(".json", ".md")).read_text()


def test_a_chat_streams_opening_role_delta_is_not_its_first_token(tmp_path):
    """The client's TTFT is the first generated text: a chat stream's role-only first chunk (the mocker
    sends it before the prefill, as a proxy may) neither stops the clock nor counts as output."""
    import asyncio

    import httpx

    from bench.replay import RequestResult, send_one
    from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster

    async def both(url: str) -> tuple[RequestResult, RequestResult]:
        chat, text = RequestResult(0, 0.0), RequestResult(1, 0.0)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
        async with httpx.AsyncClient(timeout=30.0) as client:
            await send_one(client, url, DEFAULT_MODEL, [], 5, chat, messages=messages)
            await send_one(client, url, DEFAULT_MODEL, [], 5, text, text="hello there")
        return chat, text

    with Cluster(log_dir=str(tmp_path / "logs")) as cluster:
        worker = cluster.start_mocker(MockerOptions(speedup_ratio=10))
        cluster.wait_workers_ready(60)
        chat, text = asyncio.run(both(worker.url))
    assert chat.ok and text.ok, (chat.error, text.error)
    assert chat.output_chunks == text.output_chunks == 5  # 5 generated tokens; the role chunk is not one


def test_the_replay_client_reads_each_stream_to_its_end_and_keeps_its_connection(tmp_path):
    """Like the OpenAI SDK, the replay client reads a stream past ``data: [DONE]`` to the end of the
    response, so its connection goes back to the pool: requests in a row share one connection. A
    client that stopped at ``[DONE]`` closed it and opened one per request, which charged every
    router a TCP accept and a protocol set-up per request that real clients do not cause."""
    import asyncio

    import httpx

    from bench.replay import RequestResult, send_one
    from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def through_counting_proxy(port: int) -> tuple[list[RequestResult], int]:
        accepted = 0

        async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

        server = await asyncio.start_server(forward, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        results = [RequestResult(i, 0.0) for i in range(3)]
        async with server, httpx.AsyncClient(timeout=30.0) as client:
            for r in results:
                await send_one(client, url, DEFAULT_MODEL, [], 4, r, text="hello there")
        return results, accepted

    with Cluster(log_dir=str(tmp_path / "logs")) as cluster:
        worker = cluster.start_mocker(MockerOptions(speedup_ratio=10))
        cluster.wait_workers_ready(60)
        results, accepted = asyncio.run(through_counting_proxy(int(worker.url.rsplit(":", 1)[1])))
    assert all(r.ok and r.output_chunks == 4 for r in results), [(r.error, r.output_chunks) for r in results]
    assert accepted == 1
