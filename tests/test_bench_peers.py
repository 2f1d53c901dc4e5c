"""The peers benchmark's harness (python -m bench peers): the peer routers start, route through it to real
mocker processes, and every router's row is complete. A tiny run, not a benchmark: no figure is asserted."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable

import pytest

from bench import peers
from bench.sessions import WORKLOADS, SessionGroup, Workload, completion_text, session_trace

TINY = Workload(
    "tiny",
    (
        SessionGroup("tiny", sessions=3, turns=2, prefixes=2, prefix_tokens=(200, 300), user_tokens=32,
                     reply_tokens=32, output_tokens=2, start_window_s=0.5, think_s=0.1, think_min_s=0.1),
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def peers_bin() -> str:
    """The peers' bin directory; skips (fails under KVROUTE_REQUIRE_PEERS, as in CI) without it."""
    path = peers.peers_bin()
    if path is None:
        if os.environ.get(peers.REQUIRE_ENV):
            pytest.fail(peers.missing_reason())
        pytest.skip(peers.missing_reason())
    return path


def test_each_turn_repeats_the_session_so_far():
    """Turn k's prompt is a prefix of turn k+1's, in text and in the engine's tokens (the reuse the
    routers compete for); chat groups send messages that extend the same way."""
    trace = session_trace(TINY)
    assert len(trace.requests) == 6
    by_session: dict[int | None, list] = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        first, second = turns
        assert first.text is not None and second.text is not None and second.text.startswith(first.text)
        assert second.tokens[: len(first.tokens) - 1] == first.tokens[:-1]
    chat = session_trace(Workload("chat", (SessionGroup("c", 1, 2, 1, (50, 60), api="chat"),)))
    first, second = chat.requests
    assert first.text is None and first.messages is not None and second.messages is not None
    assert second.messages[: len(first.messages)] == first.messages
    assert completion_text(first.messages).endswith("Assistant:")


def test_every_router_serves_every_request_and_reports_a_hit_rate(peers_bin: str, tmp_path):
    """Each peer (and kvroute) in front of two fresh mockers: all requests answered, the engines' counters
    read, the router's CPU measured."""
    labels = [
        "sglang-cache_aware",
        "sglang-power_of_two",
        "smg-cache_aware",
        "smg-prefix_hash",
        "vllm-kv_aware",
        "vllm-cache_aware",
        "kvroute-latency",
    ]
    args = peers.parser().parse_args(["--workers", "2", "--out-dir", str(tmp_path), "--speedup-ratio", "0"])
    args.bin_dir = peers_bin
    trace = session_trace(TINY)
    prompt_tokens = sum(len(r.tokens) for r in trace.requests)
    rows = peers.run_mockers(
        trace, [peers.ROUTERS[label] for label in labels], args, peers.blocks_per_engine(trace, args)
    )
    assert [r["router"] for r in rows] == labels
    for row in rows:
        assert row["completed"] == row["requests"] == len(trace.requests), (row["router"], row["error_examples"])
        assert row["hit_rate"] is not None, row["router"]
        # every prompt token reached an engine and was counted there (the hit rate covers the whole schedule)
        assert row["cache"]["queries"] >= prompt_tokens, row["router"]
        assert row["router_cpu_s"] is not None and row["router_cpu_s"] >= 0, row["router"]
    table = peers.table({"oracle": {"token_share": 0.5}, "routers": rows})
    assert all(label in table for label in labels)


def test_the_peers_report_their_versions(peers_bin: str):
    """Both SGLang gateway packages (they share the executable name smg) are there, each reporting its own
    version from its own environment."""
    versions = peers.peer_versions(peers_bin)
    assert versions == {"sglang-router": "0.3.2", "vllm-router": "0.1.17", "smg": "1.13.0"}
    assert peers.ROUTERS["smg-prefix_hash"].describe() == "smg-1.13 launch --policy prefix_hash"


def test_a_load_factor_packs_the_same_sessions_closer():
    """Load 2: the same requests (same tokens, same order within each session) in half the time."""
    base = session_trace(TINY)
    dense = session_trace(TINY.at_load(2.0))
    assert [r.tokens for r in dense.requests] == [r.tokens for r in base.requests]
    assert dense.duration_s == pytest.approx(base.duration_s / 2, rel=1e-3)
    assert TINY.at_load(1.0) is TINY
    with pytest.raises(ValueError):
        TINY.at_load(0.0)


def test_the_workloads_have_their_shapes():
    """RAG: many readers of a few long documents; long-context: nothing shared, each context long; the
    burst: many sessions starting within a second; chat: messages, not text."""

    rag = WORKLOADS["rag"].groups[0]
    assert rag.sessions >= 8 * rag.prefixes and rag.prefix_tokens[0] >= 3000
    long = WORKLOADS["long-context"].groups[0]
    assert long.prefixes == long.sessions and long.prefix_tokens[0] >= 4000
    burst = WORKLOADS["agentic-burst"].groups[1]
    assert burst.start_window_s <= 1.0 and burst.prefix_pool == "agentic"
    assert WORKLOADS["agentic-chat"].groups[0].api == "chat"
    assert peers.workloads_of("all") == list(WORKLOADS.values())
    assert peers.loads_of("1,2") == [1.0, 2.0]


def test_the_recommended_mode_is_compared_with_every_peer_only():
    """A peer ahead on hit rate or TTFT p50 / p90 is named; kvroute's other modes are not peers."""

    def row(router: str, kind: str, hit: float, p50: float, p90: float) -> dict:
        return {"router": router, "kind": kind, "hit_rate": hit, "ttft_ms": {"p50": p50, "p90": p90},
                "completed": 10, "requests": 10}  # fmt: skip

    report = {
        "routers": [
            row("kvroute-latency", "kvroute", 0.8, 20.0, 50.0),
            row("kvroute-kv", "kvroute", 0.9, 10.0, 40.0),
            row("sglang-cache_aware", "smg", 0.7, 15.0, 60.0),
            row("vllm-kv_aware", "vllm-router", 0.85, 30.0, 70.0),
        ]
    }
    lost = peers.lost_to_peers(report)
    assert len(lost) == 2
    assert lost[0].startswith("TTFT p50 to sglang-cache_aware (15 vs 20 ms)")
    assert lost[1].startswith("hit rate to vllm-kv_aware (85.0% vs 80.0%)")


def test_several_runs_report_each_figures_median_and_the_per_run_ratios():
    """--runs N: each router's median with its min-max, and the recommended row against each router as
    the median of the per-run ratios (not the ratio of the medians)."""

    def run(ours: tuple[float, float], theirs: tuple[float, float]) -> dict:
        def row(router: str, p50: float, cpu: float, hit: float) -> dict:
            return {"router": router, "hit_rate": hit, "router_cpu_ms_per_request": cpu,
                    "ttft_ms": {"p50": p50, "p90": 2 * p50, "p99": 3 * p50}}  # fmt: skip

        return {
            "workload": "w", "testbed": "mocker", "setup": "s", "command": "c", "machine": {"load_before": 1.0},
            "routers": [row("kvroute-latency", *ours, 0.88), row("smg-cache_aware", *theirs, 0.87)],
        }  # fmt: skip

    runs = [run((11.0, 3.0), (10.0, 2.0)), run((20.0, 3.0), (10.0, 3.0)), run((12.0, 4.0), (12.0, 2.0))]
    text = peers.runs_markdown(runs)
    assert "| kvroute-latency | 88.0% (88.0%-88.0%) | 12 (11-20) |" in text
    # per-run p50 ratios 1.1, 2.0, 1.0 -> median 1.10 (the ratio of the medians would be 12 / 10 = 1.2)
    assert "| smg-cache_aware | +1.0 (+1.0 to +1.0) | 1.10x (1.00-2.00) | 1.10x (1.00-2.00) |" in text
    assert text.rstrip().endswith("| 1.50x (1.00-2.00) |")  # CPU: 1.5, 1.0, 2.0
    assert "above idle" not in text  # bench peers measures no idle CPU

    # bench data_path's rows carry the CPU above each router's idle CPU: a ratio column of its own
    for r, (mine, theirs) in zip(runs, ((2.0, 1.0), (3.0, 2.0), (2.0, 2.0)), strict=True):
        r["routers"][0]["router_cpu_above_idle_ms_per_request"] = mine
        r["routers"][1]["router_cpu_above_idle_ms_per_request"] = theirs
    text = peers.runs_markdown(runs)
    assert "| TTFT p99 | router CPU | router CPU above idle |" in text
    assert text.rstrip().endswith("| 1.50x (1.00-2.00) | 1.50x (1.00-2.00) |")  # above idle: 2.0, 1.5, 1.0


def test_every_router_runs_in_front_of_canned_engines(peers_bin: str):
    """The overhead harness (python -m bench peers_overhead): each router in front of nginx engines
    answers the replayed schedule, streamed, without a non-2xx, and its CPU is measured."""
    from bench import peers_overhead

    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            pytest.fail(f"{tool} is not installed (Debian package {tool}; .ci/run installs it)")
    labels = ["kvroute-latency", "sglang-cache_aware", "vllm-kv_aware"]
    rows = peers_overhead.run([peers.ROUTERS[label] for label in labels], "agentic", 1.0, 4, 2, peers_bin)
    assert [r["router"] for r in rows] == ["direct", *labels]
    for row in rows:
        assert row["non_2xx"] == 0, row
        assert row["rps_loaded"] > 0 and row["p50_ms"] > 0, row
    for row in rows[1:]:
        assert row["cpu_ms_per_request"] > 0, row
    assert all(label in peers_overhead.table(rows) for label in labels)


def test_each_pass_of_the_overhead_schedule_is_new_to_the_router():
    """Every line is a route and a streamed body whose text carries the pass mark (replaced per pass by wrk)
    at its start, at least every MARK_EVERY characters and at its end, so no text kvroute's tokenizer caches (chunks of
    512 characters and more, segments of 256 and more) is seen in two passes; a session's later turn repeats
    its earlier turn's marked text."""
    from bench import peers_overhead

    mark, every = peers_overhead.PASS_MARK, peers_overhead.MARK_EVERY
    assert every < 256
    trace = session_trace(TINY)
    lines = peers_overhead.schedule_lines(trace, "m")
    assert len(lines) == len(trace.requests)
    prompts = []
    for line, req in zip(lines, trace.requests, strict=True):
        route, body = line.split("\t")
        data = json.loads(body)
        assert route == "/v1/completions" and data["stream"] is True
        prompt = data["prompt"]
        assert prompt.startswith(mark) and prompt.endswith(" " + mark)
        assert prompt.replace(" " + mark, "").replace(mark + " ", "", 1) == req.text
        gaps = [len(piece) for piece in prompt.split(mark)[1:-1]]
        assert gaps and max(gaps) < every + 40, gaps  # the words here are short: a mark every ~200 characters
        prompts.append(prompt)
    # a session's later turn starts with its earlier turn's marked text (less the end mark)
    assert sum(1 for a in prompts for b in prompts if len(b) > len(a) and b.startswith(a[: -len(mark)])) > 0

    for line in peers_overhead.schedule_lines(session_trace(WORKLOADS["agentic-chat"]), "m")[:20]:
        data = json.loads(line.split("\t")[1])
        texts = [m["content"] for m in data["messages"] if isinstance(m["content"], str)]
        assert texts and all(t.startswith(mark) for t in texts)


def test_a_later_pass_of_the_overhead_schedule_misses_kvroutes_tokenizer_caches_like_the_first():
    """kvroute's encoder on two passes of the agentic schedule (the marks replaced as wrk does): the second pass
    finds no more of its text chunks in the cache than the first did (only its sessions' own earlier turns);
    with a single mark at each prompt's start it would find nearly all of them."""
    from bench import peers_overhead
    from kvroute_common.tokenizer import PromptEncoder, load_tokenizer

    requests = session_trace(WORKLOADS["agentic"]).requests[:40]

    def misses(mark: Callable[[str], str]) -> list[int]:
        encoder = PromptEncoder(load_tokenizer(None))
        out = []
        for p in range(2):
            before = encoder.chunks.misses
            for r in requests:
                assert r.text is not None
                encoder.encode(mark(r.text).replace(peers_overhead.PASS_MARK, f"run-{p}"))
            out.append(encoder.chunks.misses - before)
        return out

    first, second = misses(peers_overhead.marked)
    assert first > 50 and second >= 0.9 * first, (first, second)
    first, second = misses(lambda text: f"{peers_overhead.PASS_MARK} {text}")
    assert second < 0.1 * first, (first, second)


def test_another_interpreter_runs_each_kvroute_row_again(tmp_path):
    """--python NAME=PATH: each kvroute row also runs on that interpreter, labelled [NAME], right after it;
    the peers' rows are left alone, and a malformed or missing interpreter is refused before anything runs."""
    specs = peers.router_specs("kvroute-latency,smg-cache_aware", python=f"pgo={sys.executable}")
    assert [(s.label, s.python) for s in specs] == [
        ("kvroute-latency", None),
        ("kvroute-latency [pgo]", os.path.abspath(sys.executable)),
        ("smg-cache_aware", None),
    ]
    assert specs[1].describe().endswith(f"(on {os.path.abspath(sys.executable)})")
    for bad in (sys.executable, "pgo=", f"pgo={tmp_path / 'missing'}"):
        with pytest.raises(SystemExit, match="--python"):
            peers.router_specs("kvroute-latency", python=bad)
