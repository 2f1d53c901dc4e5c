"""The long-context benchmark's harness (python -m bench long_context): the tiny requests' sender, a process of
its own, reports every request (and the frontend's split of it), or the error that ended the run; the engine
floor's long prompts are pinned to one engine and its tiny requests go straight to the other. No figure is
asserted."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from bench import long_context, tiny_sender
from kvroute_common.local_cluster import Cluster, MockerOptions, start_cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(2, MockerOptions(speedup_ratio=0.0), "latency", frontend_args=["--log-level", "warning"])
    try:
        yield c
    finally:
        c.stop()


def _sender(url: str, *args: str) -> tuple[list[str], dict]:
    argv = [sys.executable, "-m", "bench.tiny_sender", url, "--interval", "0.002", *args]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_the_tiny_sender_reports_every_request_with_the_frontends_split(cluster: Cluster) -> None:
    assert cluster.frontend_url is not None
    lines, result = _sender(cluster.frontend_url, "--count", "25", "--timing")
    assert lines[0] == "ready"
    samples = result["samples"]
    assert len(samples) == 25
    sent = [s[0] for s in samples]
    assert len(set(sent)) == 25  # one sample per request (in the order they were answered)
    for _, ms, before, in_handler, after in samples:
        assert ms > 0 and in_handler > 0
        assert before + in_handler + after == pytest.approx(ms)


def test_the_tiny_sender_sends_chat_requests_straight_to_an_engine(cluster: Cluster) -> None:
    _, result = _sender(cluster.workers[0].url, "--count", "10", "--chat")
    assert [len(s) for s in result["samples"]] == [2] * 10


def test_a_refused_tiny_request_ends_the_run_with_its_error(cluster: Cluster) -> None:
    assert cluster.frontend_url is not None
    lines, result = _sender(cluster.frontend_url, "--count", "5", "--model", "no-such-model")
    assert lines == [json.dumps(result)]  # not ready: its warm-up was refused
    assert result["error"].startswith("tiny request failed: 404")


def test_connections_the_server_closed_are_not_used_again() -> None:
    """A server that closes every connection after its answer (as servers close kept-alive connections idle
    a few seconds): every request is answered, on a new connection each."""
    connections = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(answer, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        _, result = _sender(f"http://127.0.0.1:{port}", "--count", "10")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    assert len(result["samples"]) == 10
    assert len(connections) == tiny_sender.WARM_REQUESTS + 10


def test_the_floor_pins_the_long_prompts_and_sends_the_tiny_requests_to_the_other_engine(cluster: Cluster) -> None:
    """``_scenario`` with ``tiny_url``: the tiny requests are answered by the engine, the long prompts (pinned
    with ``nvext.backend_instance_id``) by the frontend from the other engine."""
    url, frontend = cluster.frontend_url, cluster.frontend
    assert url is not None and frontend is not None
    engine, other = cluster.workers
    bodies = [long_context._pinned(long_context._completion(300, k, 1.6), other.worker_id) for k in range(4)]
    assert all(json.loads(b)["nvext"] == {"backend_instance_id": other.worker_id} for b in bodies)
    before = {w.worker_id: _engine_requests(w.url) for w in cluster.workers}
    r = asyncio.run(long_context._scenario(url, frontend.proc.pid, bodies, 20.0, False, tiny_url=engine.url))
    assert r["long_statuses"] == [200] and r["long_prompt_tokens"] > 250
    assert r["tiny_ms"]["n"] > 0
    after = {w.worker_id: _engine_requests(w.url) for w in cluster.workers}
    assert after[other.worker_id] - before[other.worker_id] == 4  # every long prompt, and nothing else
    # the warm-up and every tiny request, sent straight to it (the window counts those sent while long prompts went)
    assert after[engine.worker_id] - before[engine.worker_id] >= 20 + r["tiny_ms"]["n"]


def _engine_requests(url: str) -> int:
    """The prompts an engine has taken (its ``vllm:request_prompt_tokens`` histogram's count)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "vllm:request_prompt_tokens_count"
        )
    )
