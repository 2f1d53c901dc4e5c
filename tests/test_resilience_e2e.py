"""Request migration and the stream idle timeout, through real processes (resilience).

Real mockers and a real frontend on loopback. Faults are real: a mocker process is SIGKILLed in the
middle of a response, or started with ``--stall-after-tokens`` so it goes silent mid-stream. Kills
land mid-response without racing the generation: either the mocker is stalled after N tokens
(``--stall-after-tokens``: it holds the connection open, sending nothing) when the client, having
received those N chunks, kills it, or it is slowed down (``--speedup-ratio``) so a 40-token stream
lasts over a second and the kill follows the 5th chunk at once. A second worker is added
(``POST /admin/workers``) only once the request is held by the first, so the first routing choice
is known. Every test ends with every load in /loads back at 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator

import httpx
import openai

from support import free_port, service, wait_until

MODEL = "resilience-model"
QUEUE_GAUGES = (
    "dynamo_frontend_queued_requests",
    "dynamo_frontend_inflight_requests",
    "dynamo_frontend_active_requests",
)
SLOW = ["--speedup-ratio", "0.2"]  # ~30 ms per decode step: a 40-token stream takes over a second


@contextlib.contextmanager
def mocker(extra: list[str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "mocker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--no-kv-events",
        "--seed",
        "3",
        *(extra or []),
    ]
    with service(args, ready_url=f"{url}/v1/models", timeout=90) as proc:
        yield url, proc


class Frontend:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60.0)
        self.sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60.0)

    def loads(self) -> dict[int, tuple[int, int]]:
        return {
            r["worker_id"]: (r["active_prefill_tokens"], r["active_decode_blocks"])
            for r in self.http.get("/loads").json()
        }

    def busy_workers(self) -> list[int]:
        return [w for w, v in self.loads().items() if v != (0, 0)]

    def assert_idle(self) -> None:
        wait_until(lambda: not self.busy_workers(), 30, what="every load in /loads back at 0")

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def add_worker(self, wid: int, url: str) -> None:
        r = self.http.post("/admin/workers", json={"id": wid, "url": url})
        assert r.status_code in (200, 201), r.text


@contextlib.contextmanager
def frontend(workers: list[tuple[int, str]], *flags: str) -> Iterator[Frontend]:
    port = free_port()
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--router-mode",
        "round_robin",
        "--health-check-interval",
        "0.5",
        *flags,
    ]
    for wid, url in workers:
        args += ["--worker", f"id={wid},url={url}"]
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        r = httpx.get(f"{base}/v1/models", timeout=2)
        return r.status_code == 200 and any(m["id"] == MODEL for m in r.json().get("data", []))

    with service(args, ready=ready, timeout=90):
        fe = Frontend(base)
        try:
            yield fe
        finally:
            fe.http.close()


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def test_killed_worker_mid_stream_migrates_to_another_and_the_client_sees_one_stream() -> None:
    """--migration-limit 3, chat via the openai SDK: worker A is killed after 5 chunks; the stream
    goes on from worker B with the same id, one role chunk, one finish, usage over both workers."""
    with mocker(["--stall-after-tokens", "5"]) as (url_a, proc_a), mocker(SLOW) as (url_b, _):
        with frontend([(1, url_a)], "--migration-limit", "3") as fe:
            messages = [{"role": "user", "content": "Tell me a long story about routers and caches."}]
            prompt_tokens = httpx.post(f"{url_b}/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
            stream = fe.sdk.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=40,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = []
            content_chunks = 0
            for chunk in stream:
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    content_chunks += 1
                if content_chunks == 5 and proc_a.poll() is None:
                    assert fe.busy_workers() == [1]
                    fe.add_worker(2, url_b)  # waits for its first health check
                    kill(proc_a)
            ids = {c.id for c in chunks}
            assert len(ids) == 1, ids
            roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
            assert len(roles) == 1
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finishes == ["length"]
            assert content_chunks == 40  # the mocker sends one token per chunk: none lost, none repeated
            usage = [c.usage for c in chunks if c.usage is not None]
            assert len(usage) == 1 and chunks[-1].usage is not None
            assert usage[0].completion_tokens == 40
            assert usage[0].prompt_tokens == prompt_tokens
            assert usage[0].total_tokens == prompt_tokens + 40
            assert (
                fe.metric("dynamo_frontend_model_migration_total", model=MODEL, migration_type="ongoing_request") == 1
            )
            # the request is counted when the frontend ends it, which may be just after the client read the end
            wait_until(
                lambda: fe.metric("dynamo_frontend_requests_total", model=MODEL) >= 1, 30, what="the request counted"
            )
            assert fe.metric("dynamo_frontend_requests_total", model=MODEL, status="success") == 1
            assert fe.metric("dynamo_frontend_requests_total", model=MODEL) == 1
            fe.assert_idle()
            assert fe.loads().get(1, (0, 0)) == (0, 0)


def test_killed_worker_with_migration_off_gives_a_clean_error_event() -> None:
    """--migration-limit 0 (default): the stream ends with an OpenAI error event and [DONE]; a
    non-streaming request whose worker dies gets an OpenAI-style 502."""
    with mocker(SLOW) as (url_a, proc_a), mocker(["--stall-after-tokens", "2"]) as (url_b, proc_b):
        with frontend([(1, url_a)]) as fe:
            body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}
            events = []
            with fe.http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for data in sse_events(r.iter_lines()):
                    events.append(data)
                    if len(events) == 5:
                        kill(proc_a)
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])
            assert err["error"]["code"] == 500 and "failed mid-stream" in err["error"]["message"]
            assert all("error" not in json.loads(e) for e in events[:-2])
            fe.assert_idle()

            fe.add_worker(2, url_b)
            wait_until(lambda: fe.http.get("/health").status_code == 200, 30, what="worker 2 serving")
            box: dict = {}
            t = threading.Thread(
                target=lambda: box.update(r=fe.http.post("/v1/completions", json={**body, "stream": False}))
            )
            t.start()
            wait_until(lambda: fe.busy_workers() == [2], 30, what="the request on worker 2")
            kill(proc_b)
            t.join(60)
            r = box["r"]
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == 502
            fe.assert_idle()
            assert fe.metric("dynamo_frontend_model_migration_total") == 0


def test_non_streaming_request_migrates_when_its_worker_dies() -> None:
    """A unary request whose worker dies before answering is sent again elsewhere (new_request)."""
    with mocker(["--stall-after-tokens", "2"]) as (url_a, proc_a), mocker(SLOW) as (url_b, _):
        with frontend([(1, url_a)], "--migration-limit", "1") as fe:
            box: dict = {}
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 30,
                "ignore_eos": True,
            }
            t = threading.Thread(target=lambda: box.update(r=fe.http.post("/v1/chat/completions", json=body)))
            t.start()
            # in flight on worker 1, the only worker ("hi" fills no KV block, so /loads shows it only until
            # its first token: a poll can miss that window on a busy machine; the gauge holds to the end)
            wait_until(lambda: fe.metric("dynamo_frontend_active_requests") >= 1, 30, what="the request in flight")
            # its first tokens arrived (the unary answer is reassembled from the engine's stream)
            wait_until(
                lambda: fe.metric("dynamo_frontend_time_to_first_token_seconds_count") >= 1, 30, what="first token"
            )
            fe.add_worker(2, url_b)
            kill(proc_a)
            t.join(60)
            r = box["r"]
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["completion_tokens"] == 30 and out["choices"][0]["finish_reason"] == "length"
            assert fe.metric("dynamo_frontend_model_migration_total", migration_type="new_request") == 1
            fe.assert_idle()
            # the first attempt had its first token: the request leaves the queued gauge once, not twice
            for gauge in QUEUE_GAUGES:
                assert fe.metric(gauge) == 0, gauge


def test_unary_request_that_cannot_migrate_after_its_first_token_ends_once_in_the_metrics() -> None:
    """--migration-limit 1, one worker: a unary request's worker goes silent after its first tokens,
    the request is routed again and finds no other worker. It ends as a 503 counted once, and every
    gauge is back at 0 (its first token already took it off the queued gauge: the 503 must not take
    it off a second time)."""
    with mocker(["--stall-after-tokens", "2"]) as (url, _):
        with frontend([(1, url)], "--migration-limit", "1", "--stream-idle-timeout", "1") as fe:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 30,
                "ignore_eos": True,
            }
            r = fe.http.post("/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == 503
            assert fe.metric("dynamo_frontend_time_to_first_token_seconds_count") == 1
            assert fe.metric("dynamo_frontend_model_migration_total", migration_type="new_request") == 1
            assert fe.metric("dynamo_frontend_requests_total") == 1
            assert fe.metric("dynamo_frontend_requests_total", status="error", error_type="unavailable") == 1
            fe.assert_idle()
            for gauge in QUEUE_GAUGES:
                assert fe.metric(gauge) == 0, gauge


def test_stalled_stream_is_cut_after_the_idle_timeout_and_its_booking_freed() -> None:
    with mocker(["--stall-after-tokens", "3"]) as (url, _):
        with frontend([(1, url)], "--stream-idle-timeout", "2") as fe:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
            with fe.http.stream("POST", "/v1/completions", json=body) as r:
                events = list(sse_events(r.iter_lines()))
            assert len(events) == 5, events  # 3 tokens, the error event, [DONE]
            err = json.loads(events[3])["error"]
            assert err["code"] == 504 and "stopped sending" in err["message"]
            assert events[4] == "[DONE]"
            fe.assert_idle()
            assert fe.metric("dynamo_frontend_requests_total", status="error", error_type="response_timeout") == 1
            # the worker saw the disconnect and dropped the request too
            wait_until(
                lambda: (
                    "vllm:num_requests_running{" in (t := httpx.get(f"{url}/metrics").text)
                    and all(
                        float(line.rsplit(" ", 1)[1]) == 0
                        for line in t.splitlines()
                        if line.startswith("vllm:num_requests_running{")
                    )
                ),
                30,
                what="the mocker to drop the stalled request",
            )


def test_stalled_stream_migrates_when_migration_is_on() -> None:
    """One stalling and one healthy worker, round robin: of two streams one lands on the staller
    and is continued on the other after the idle timeout; both complete."""
    with mocker(["--stall-after-tokens", "3"]) as (url_s, _), mocker() as (url_h, _):
        with frontend([(1, url_s), (2, url_h)], "--stream-idle-timeout", "2", "--migration-limit", "2") as fe:
            wait_until(lambda: len(fe.loads()) == 2, 30, what="both workers registered")
            for _ in range(2):
                body = {
                    "model": MODEL,
                    "prompt": "a b c",
                    "max_tokens": 12,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                with fe.http.stream("POST", "/v1/completions", json=body) as r:
                    events = list(sse_events(r.iter_lines()))
                assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
                objs = [json.loads(e) for e in events[:-1]]
                assert all("error" not in o for o in objs), objs
                assert len({o["id"] for o in objs}) == 1
                text_events = [o for o in objs if o["choices"] and o["choices"][0]["text"]]
                assert len(text_events) == 12
                assert objs[-1]["usage"]["completion_tokens"] == 12
            # round robin: at least one of the two streams started on the staller (both may have)
            assert fe.metric("dynamo_frontend_model_migration_total", migration_type="ongoing_request") >= 1
            fe.assert_idle()
