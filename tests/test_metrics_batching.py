"""Streamed tokens reach the metrics in batches: the same exposition as one observation per chunk."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.dispatch.lifecycle import TOKEN_BATCH
from kvroute_common.local_cluster import DEFAULT_MODEL, MockerOptions, start_cluster
from kvroute_common.processes import wait_until

# through a real frontend: every streamed token counted once, batched or not (``LoopHistogram.observe_many``
# against one ``observe`` per value: tests/test_loop_metrics.py)


def _metric(text: str, name: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("model", DEFAULT_MODEL) == DEFAULT_MODEL
    )


@pytest.fixture(scope="module")
def frontend_url():
    cluster = start_cluster(1, MockerOptions(speedup_ratio=50.0), "kv", frontend_args=["--log-level", "warning"])
    try:
        assert cluster.frontend_url is not None
        yield cluster.frontend_url
    finally:
        cluster.stop()


def _delta(http: httpx.Client, before: str) -> tuple[float, float]:
    """(output tokens, inter-token-latency observations) counted since ``before``, once nothing is in flight."""
    wait_until(lambda: _metric(http.get("/metrics").text, "dynamo_frontend_inflight_requests") == 0, 30.0, what="idle")
    after = http.get("/metrics").text
    names = ("dynamo_frontend_output_tokens_total", "dynamo_frontend_inter_token_latency_seconds_count")
    out, itl = (_metric(after, name) - _metric(before, name) for name in names)
    return out, itl


def test_streamed_tokens_reach_the_metrics_once_each(frontend_url: str) -> None:
    http = httpx.Client(base_url=frontend_url, timeout=60.0)
    n = TOKEN_BATCH * 2 + 5  # two full batches told mid-stream, the rest at the end
    body = {"model": DEFAULT_MODEL, "prompt": "count the tokens", "max_tokens": n, "stream": True,
            "ignore_eos": True}  # fmt: skip
    before = http.get("/metrics").text
    texts = 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                texts += 1
    assert texts == n
    out, itl = _delta(http, before)
    assert out == n
    # one gap per read of the worker's stream after the first (a read may bring several tokens)
    assert 1 <= itl <= n - 1

    # a client that leaves mid-stream: the tokens relayed to it are counted when its lease is released
    before = http.get("/metrics").text
    with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 4 * TOKEN_BATCH}) as r:
        read = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                read += 1
                if read == 10:
                    break
    out, _ = _delta(http, before)
    assert 10 <= out <= 4 * TOKEN_BATCH
