"""In-process pieces of request resilience: queue bounds (frontend/routing/admission.py), the migration
continuation and SSE rewriting (frontend/dispatch/migration.py), the upstream idle timeout and the flags."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from frontend.dispatch.migration import SseTracker, continuation_body, migratable
from frontend.dispatch.upstream import UpstreamPool, UpstreamTimeout
from frontend.request.hints import RequestHints
from frontend.routing.admission import AdmissionQueue, QueueRejected
from router.config import RouterConfig, add_router_args

MODEL = "m"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def until(pred, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0)


# --- router queue bounds -------------------------------------------------------------------------


def test_full_queue_rejects_at_once_and_keeps_the_held_requests():
    async def main():
        cap = {"free": False}
        aq = AdmissionQueue("fcfs", 0.5, lambda m, h, t: cap["free"], max_queued=2)
        held = [asyncio.create_task(aq.wait(MODEL, RequestHints())) for _ in range(2)]
        await until(lambda: aq.depth(MODEL) == 2)
        with pytest.raises(QueueRejected) as info:
            await aq.wait(MODEL, RequestHints())
        assert info.value.reason == "request_limit" and aq.rejected_full == 1
        assert aq.depth(MODEL) == 2  # the rejected one never entered; the held ones still wait
        cap["free"] = True
        aq.notify(MODEL)
        await asyncio.gather(*held)
        assert aq.depth(MODEL) == 0 and aq.admitted_after_wait == 2
        # capacity available: a newcomer is admitted directly whatever the bound
        assert await aq.wait(MODEL, RequestHints()) == 0.0

    run(main())


def test_queue_max_zero_never_holds():
    async def main():
        aq = AdmissionQueue("fcfs", 0.5, lambda m, h, t: False, max_queued=0)
        with pytest.raises(QueueRejected):
            await aq.wait(MODEL, RequestHints())
        assert aq.depth(MODEL) == 0

    run(main())


def test_queue_timeout_takes_the_request_out_of_the_queue():
    async def main():
        cap = {"free": False}
        aq = AdmissionQueue("fcfs", 0.5, lambda m, h, t: cap["free"], queue_timeout=0.05, recheck_interval=0.01)
        with pytest.raises(QueueRejected) as info:
            await aq.wait(MODEL, RequestHints())
        assert info.value.reason == "queue_timeout" and aq.rejected_timeout == 1
        assert aq.depth(MODEL) == 0
        cap["free"] = True  # a later request is not affected by the timed-out one
        assert await aq.wait(MODEL, RequestHints()) == 0.0

    run(main())


def test_queue_bounds_are_validated():
    with pytest.raises(ValueError):
        AdmissionQueue("fcfs", 0.5, lambda *a: True, max_queued=-1)
    with pytest.raises(ValueError):
        AdmissionQueue("fcfs", 0.5, lambda *a: True, queue_timeout=0)


def test_flags_and_env():
    p = argparse.ArgumentParser()
    add_router_args(
        p, environ={"DYN_MIGRATION_LIMIT": "3", "DYN_ROUTER_QUEUE_MAX": "8", "DYN_STREAM_IDLE_TIMEOUT": "30"}
    )
    cfg = RouterConfig.from_args(p.parse_args(["--router-queue-timeout-secs", "2.5"]))
    assert (cfg.migration_limit, cfg.router_queue_max, cfg.router_queue_timeout_secs, cfg.stream_idle_timeout) == (
        3,
        8,
        2.5,
        30.0,
    )
    p = argparse.ArgumentParser()
    add_router_args(p, environ={})
    cfg = RouterConfig.from_args(p.parse_args([]))
    assert (cfg.migration_limit, cfg.router_queue_max, cfg.router_queue_timeout_secs, cfg.stream_idle_timeout) == (
        0,
        None,
        None,
        None,
    )
    for bad in (["--migration-limit", "-1"], ["--router-queue-max", "-2"], ["--stream-idle-timeout", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


# --- continuation ---------------------------------------------------------------------------------


def test_chat_continuation_is_a_partial_assistant_message_with_fewer_tokens():
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "min_tokens": 10}
    out = continuation_body(body, True, "Hello the", 2)
    assert out["messages"][-1] == {"role": "assistant", "content": "Hello the"}
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_tokens"] == 38 and out["min_tokens"] == 8
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 40  # original untouched


def test_completion_continuation_appends_the_text():
    assert continuation_body({"prompt": "a b", "max_tokens": 5}, False, " c d", 2)["prompt"] == "a b c d"
    assert continuation_body({"prompt": ["a b"], "max_tokens": 5}, False, " c", 1)["prompt"] == "a b c"
    ids = continuation_body({"prompt": [5, 6], "max_tokens": 5}, False, " c", 1, lambda text: [len(text)])
    assert ids["prompt"] == [5, 6, 2] and ids["max_tokens"] == 4
    assert continuation_body({"prompt": [5, 6]}, False, " c", 1) is None
    assert continuation_body({"prompt": "a", "max_tokens": 3}, False, " x y z", 3)["max_tokens"] == 1  # never 0
    assert continuation_body({"prompt": "a"}, False, " x", 1) == {"prompt": "a x"}  # no limit stays no limit
    assert migratable({"n": 1}) and migratable({}) and not migratable({"n": 2})


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_tracker_passes_whole_events_and_records_the_text():
    t = SseTracker(chat=True, prompt_tokens=7)
    first = _ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    tok = _ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    assert t.feed(first + tok[:10]) == first  # the partial event is held
    assert t.feed(tok[10:]) == tok
    assert t.generated_text() == "Hi" and t.generated == 1 and not t.finished


def test_tracker_rewrites_the_continuation_as_the_same_response():
    t = SseTracker(chat=True, prompt_tokens=7)
    t.feed(_ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"content": "Hi"}}]}))
    t.feed(
        _ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"content": " there"}}]})[:12]
    )  # torn by the failure
    t.switch()
    role = _ev({"id": "B", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    tok = _ev(
        {"id": "B", "created": 2, "choices": [{"index": 0, "delta": {"content": " you"}, "finish_reason": "length"}]}
    )
    usage = _ev(
        {
            "id": "B",
            "created": 2,
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
        }
    )
    out = t.feed(role + tok + usage + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3  # no second role chunk
    a, b = json.loads(events[0][6:]), json.loads(events[1][6:])
    assert a["id"] == b["id"] == "A" and a["created"] == 1 and a["choices"][0]["delta"] == {"content": " you"}
    assert b["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert events[2] == b"data: [DONE]" and t.done and t.finished
    assert t.generated_text() == "Hi you"


# --- idle timeout ---------------------------------------------------------------------------------


def test_upstream_idle_timeout_only_after_the_first_bytes():
    """A raw socket server that sends a chunked head and one chunk, then nothing."""

    async def main():
        gate = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await gate.wait()  # silent before the first body byte: not an idle timeout
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.Event().wait()  # then silent for good

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        try:
            resp = await pool.request("POST", "/x", b"{}", stream=True)
            got = []

            async def read():
                async for chunk in resp.aiter_raw(0.2):
                    got.append(chunk)

            reader = asyncio.create_task(read())
            await asyncio.sleep(0.4)  # longer than the idle timeout, before any body byte
            assert not reader.done()
            gate.set()
            with pytest.raises(UpstreamTimeout):
                await reader
            assert got == [b"hello"]
            await resp.aclose()
        finally:
            await pool.aclose()
            server.close()

    run(main())
