"""OpenTelemetry traces (``--otlp-traces-endpoint``, ``frontend/observability/tracing.py``), exported to a
real OTLP/gRPC receiver on loopback: the request's spans and their attributes against a mocker, then one
trace id across the client, kvroute and a real vLLM (CPU build) exporting its own spans to the same
receiver."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute_common.real_engines.vllm_cpu import BLOCK_SIZE, SERVED_NAME, VllmEngine
from otlp_receiver import OtlpReceiver, ReceivedSpan
from support import FAST_EXPORT, free_port, frontend_client, mocker_url, service, wait_until

MODEL = "trace-model"
SPANS = {"kvroute.request", "kvroute.tokenize", "kvroute.queue", "kvroute.route", "kvroute.engine"}
SPANS_WITH_OUTPUT = SPANS | {"kvroute.first_token", "kvroute.stream"}
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _by_name(spans: list[ReceivedSpan], service: str | None = None) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if service is None or s.service == service}


def _kvroute_spans(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
    return wait_until(
        lambda: (found := _by_name(receiver.trace(trace_id), "kvroute-frontend")).keys() >= names and found,
        20,
        0.05,
        what=f"kvroute's spans {sorted(names)} of trace {trace_id}",
    )


@pytest.fixture(scope="module")
def traced() -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(OtlpReceiver())
        mocker = stack.enter_context(mocker_url(MODEL, "--max-model-len", "4096"))
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        for k, v in FAST_EXPORT.items():
            patch.setenv(k, v)
        flags = ("--otlp-traces-endpoint", receiver.endpoint, "--rate-limit-rps", "100")
        fe = stack.enter_context(frontend_client([mocker], *flags))
        yield {"receiver": receiver, "fe": fe, "url": str(fe.base_url).rstrip("/")}


def test_a_request_is_one_trace_under_the_clients_span(traced: dict[str, Any]) -> None:
    receiver, url = traced["receiver"], traced["url"]
    parent, trace_id, client_span = _traceparent()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about tracing. " * 8}],
        max_tokens=6,
        stream=True,
        extra_headers={"traceparent": parent},
    )
    assert sum(1 for _ in stream) > 0
    spans = _kvroute_spans(receiver, trace_id, SPANS_WITH_OUTPUT)
    root = spans["kvroute.request"]
    assert root.parent_span_id == client_span and root.kind == SPAN_KIND_SERVER
    for name in ("kvroute.tokenize", "kvroute.queue", "kvroute.route", "kvroute.engine"):
        assert spans[name].parent_span_id == root.span_id, name
        assert root.start_ns <= spans[name].start_ns <= spans[name].end_ns <= root.end_ns, name
    engine = spans["kvroute.engine"]
    assert engine.kind == SPAN_KIND_CLIENT
    assert spans["kvroute.first_token"].parent_span_id == engine.span_id
    assert spans["kvroute.stream"].parent_span_id == engine.span_id
    assert spans["kvroute.first_token"].end_ns <= spans["kvroute.stream"].end_ns
    route = spans["kvroute.route"].attributes
    assert route["kvroute.worker_id"] == 1 and route["kvroute.dp_rank"] == 0
    assert route["kvroute.router_mode"] == "kv" and isinstance(route["kvroute.cost"], float)
    assert route["kvroute.overlap_blocks"] >= 0 and route["kvroute.attempt"] == 1
    prompt_tokens = spans["kvroute.tokenize"].attributes["kvroute.prompt_tokens"]
    assert prompt_tokens > 50
    assert root.attributes["gen_ai.request.model"] == MODEL and root.attributes["kvroute.api"] == "chat"
    assert root.attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert root.attributes["gen_ai.usage.completion_tokens"] == 6
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["kvroute.ttft_ms"] > 0
    # the same prompt again: the route span shows the blocks the engine now holds
    parent2, trace2, _ = _traceparent()
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about tracing. " * 8}],
        max_tokens=2,
        extra_headers={"traceparent": parent2},
    )
    again = _kvroute_spans(receiver, trace2, SPANS_WITH_OUTPUT)
    assert again["kvroute.route"].attributes["kvroute.overlap_blocks"] > 0


def test_without_a_client_trace_kvroute_starts_one_and_errors_are_traced(traced: dict[str, Any]) -> None:
    receiver, url = traced["receiver"], traced["url"]
    with httpx.Client(base_url=url, timeout=30) as h:
        before = {s.trace_id for s in receiver.received()}
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 2})
        assert r.status_code == 200
        new = wait_until(
            lambda: [s for s in receiver.received() if s.trace_id not in before and s.name == "kvroute.request"],
            20,
            0.05,
            what="a new root span",
        )
        assert new[0].parent_span_id == "" and new[0].attributes["kvroute.api"] == "completions"
        # a refused request is one span, with its status
        parent, trace_id, _ = _traceparent()
        bad = h.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"traceparent": parent})
        assert bad.status_code == 404
        spans = _kvroute_spans(receiver, trace_id, {"kvroute.request"})
        assert spans["kvroute.request"].attributes["http.response.status_code"] == 404
        assert set(spans) == {"kvroute.request"}


def test_otlp_http_protobuf_and_the_service_name() -> None:
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``: the same spans over OTLP/HTTP, under the
    ``OTEL_SERVICE_NAME`` given."""
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "edge-router"}
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(OtlpReceiver())
        mocker = stack.enter_context(mocker_url(MODEL, "--max-model-len", "4096"))
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        for k, v in env.items():
            patch.setenv(k, v)
        fe = stack.enter_context(frontend_client([mocker], "--otlp-traces-endpoint", receiver.http_endpoint))
        parent, trace_id, client_span = _traceparent()
        body = {"model": MODEL, "prompt": "over http", "max_tokens": 2}
        assert fe.post("/v1/completions", json=body, headers={"traceparent": parent}).status_code == 200
        spans = wait_until(
            lambda: (found := _by_name(receiver.trace(trace_id), "edge-router")).keys() >= SPANS_WITH_OUTPUT and found,
            20,
            0.05,
            what="the spans over OTLP/HTTP",
        )
        assert spans["kvroute.request"].parent_span_id == client_span


def _mocker(stack: contextlib.ExitStack, *flags: str) -> tuple[str, Any]:
    port = free_port()
    args = ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
    url = f"http://127.0.0.1:{port}"
    proc = stack.enter_context(service([*args, "--no-kv-events", *flags], ready_url=f"{url}/v1/models", timeout=90))
    return url, proc


def test_a_migrated_stream_stays_one_trace() -> None:
    """--migration-limit: worker 1 stalls after 5 tokens and is killed; the stream goes on on worker 2.
    The trace holds both decisions and both engine calls (the first marked migrated), one request span."""
    import signal

    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(OtlpReceiver())
        url_a, proc_a = _mocker(stack, "--stall-after-tokens", "5")
        url_b, _ = _mocker(stack, "--speedup-ratio", "0.2")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "round_robin"]
        args += ["--health-check-interval", "0.5", "--migration-limit", "2", "--worker", f"id=1,url={url_a}"]
        args += ["--otlp-traces-endpoint", receiver.endpoint]
        stack.enter_context(service(args, ready_url=f"{base}/health", timeout=90, env=FAST_EXPORT))
        wait_until(lambda: httpx.get(f"{base}/v1/models").json()["data"], 30, what="the model served")
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        parent, trace_id, _ = _traceparent()
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A long story about caches, please."}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": parent},
        )
        content = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                content += 1
            if content == 5 and proc_a.poll() is None:  # worker 1 holds the stream, stalled
                r = httpx.post(f"{base}/admin/workers", json={"id": 2, "url": url_b})
                assert r.status_code in (200, 201), r.text
                os.killpg(proc_a.pid, signal.SIGKILL)
                proc_a.wait(timeout=30)
        assert content == 20
        spans = wait_until(
            lambda: (
                (found := [s for s in receiver.trace(trace_id) if s.service == "kvroute-frontend"])
                and any(s.name == "kvroute.request" for s in found)
                and found
            ),
            20,
            0.05,
            what="the migrated request's spans",
        )
        routes = sorted((s for s in spans if s.name == "kvroute.route"), key=lambda s: s.start_ns)
        assert [r.attributes["kvroute.worker_id"] for r in routes] == [1, 2]
        assert [r.attributes["kvroute.attempt"] for r in routes] == [1, 2]
        engines = sorted((s for s in spans if s.name == "kvroute.engine"), key=lambda s: s.start_ns)
        assert [e.attributes["kvroute.worker_id"] for e in engines] == [1, 2]
        assert [e.attributes["kvroute.outcome"] for e in engines] == ["migrated", "success"]
        root = next(s for s in spans if s.name == "kvroute.request")
        assert root.attributes["gen_ai.usage.completion_tokens"] == 20
        assert all(s.parent_span_id == root.span_id for s in routes + engines)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Off (no flag, no variable): the frontend's request path never loads the SDK."""
    import subprocess
    import sys

    code = (
        "import sys; from frontend.cli import build_parser, make_state; "
        "s = make_state(build_parser().parse_args(['--worker', 'http://127.0.0.1:9'])); "
        "assert s.tracing is None; import frontend.app, frontend.dispatch.request_path; "
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'sdk imported'"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# ---- one trace across client, kvroute and real vLLM --------------------------------------------------


@pytest.fixture(scope="module")
def traced_vllm(small_cache_vllm: VllmEngine, tiny_model: str, otlp_receiver: OtlpReceiver) -> Iterator[dict[str, Any]]:
    """The session's small vLLM (CPU), which exports its spans with ``--otlp-traces-endpoint`` to the
    session's receiver (tests/conftest.py), and a kvroute frontend exporting to the same receiver."""
    engine, receiver = small_cache_vllm, otlp_receiver
    port = free_port()
    args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv"]
    args += ["--model-path", tiny_model, "--kv-cache-block-size", str(BLOCK_SIZE), "--no-router-kv-events"]
    args += ["--otlp-traces-endpoint", receiver.endpoint, "--worker", f"id=1,url={engine.url}"]
    url = f"http://127.0.0.1:{port}"
    with service(
        args,
        ready_url=f"{url}/health",
        timeout=120,
        env={**FAST_EXPORT, "OTEL_SERVICE_NAME": "kvroute-frontend"},
    ):
        wait_until(
            lambda: all(w["healthy"] for w in httpx.get(f"{url}/admin/workers", timeout=2).json()["workers"]),
            60,
            what="the vLLM worker healthy",
        )
        yield {"receiver": receiver, "url": url}


def _vllm_span(receiver: OtlpReceiver, trace_id: str) -> ReceivedSpan:
    return wait_until(
        lambda: next((s for s in receiver.trace(trace_id) if s.name == "llm_request"), None),
        60,
        0.1,
        what=f"vLLM's llm_request span in trace {trace_id}",
    )


def test_one_trace_id_across_client_kvroute_and_vllm(traced_vllm: dict[str, Any]) -> None:
    receiver, url = traced_vllm["receiver"], traced_vllm["url"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    parent, trace_id, client_span = _traceparent()
    out = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Say hello to the tracing test."}],
        max_tokens=4,
        extra_headers={"traceparent": parent},
    )
    assert out.usage is not None and out.usage.completion_tokens == 4
    ours = _kvroute_spans(receiver, trace_id, SPANS_WITH_OUTPUT)
    assert ours["kvroute.request"].parent_span_id == client_span
    theirs = _vllm_span(receiver, trace_id)
    # vLLM's request span is a child of kvroute's engine call: one trace, client -> kvroute -> vLLM
    assert theirs.parent_span_id == ours["kvroute.engine"].span_id
    assert theirs.service != "kvroute-frontend"
    assert (
        theirs.attributes.get("gen_ai.usage.prompt_tokens")
        == ours["kvroute.tokenize"].attributes["kvroute.prompt_tokens"]
    )

    # no traceparent from the client: kvroute's own context reaches vLLM (a streamed request this time)
    before = {s.trace_id for s in receiver.received()}
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "And now stream."}], max_tokens=3, stream=True
    )
    assert sum(1 for _ in stream) > 0
    root = wait_until(
        lambda: next(
            (s for s in receiver.received() if s.trace_id not in before and s.name == "kvroute.request"), None
        ),
        30,
        0.05,
        what="kvroute's root span of the streamed request",
    )
    assert root.parent_span_id == ""
    engine_call = _kvroute_spans(receiver, root.trace_id, SPANS_WITH_OUTPUT)["kvroute.engine"]
    assert _vllm_span(receiver, root.trace_id).parent_span_id == engine_call.span_id
