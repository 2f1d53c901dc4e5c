"""Speculative prefill (frontend/routing/speculative.py): next-turn prompt, text collection, bounded scheduling."""

from __future__ import annotations

import asyncio

import orjson

from frontend.routing.speculative import SpeculativePrefiller, TurnTextCollector, next_turn_body, strip_thinking


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# --- next-turn body -------------------------------------------------------------------------------


def test_chat_next_turn_appends_reply_and_asks_one_token():
    req = {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 300,
        "max_completion_tokens": 300,
        "n": 2,
        "temperature": 0.7,
    }
    req["min_tokens"] = 20
    body = next_turn_body(req, "hello there")
    assert body["messages"] == req["messages"] + [{"role": "assistant", "content": "hello there"}]
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "max_completion_tokens" not in body and "n" not in body and "stream_options" not in body
    assert "min_tokens" not in body  # would contradict max_tokens=1
    assert body["model"] == "m" and body["temperature"] == 0.7
    assert len(req["messages"]) == 2 and req["stream"] is True  # the original is untouched


def test_thinking_is_stripped_from_history_and_reply():
    req = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>hmm</think>a1", "reasoning_content": "hmm"},
            {"role": "user", "content": "q2"},
        ],
    }
    body = next_turn_body(req, "<think>\nlong\nthoughts\n</think>\n\nfinal answer")
    assert body["messages"][1] == {"role": "assistant", "content": "a1"}
    assert body["messages"][-1] == {"role": "assistant", "content": "final answer"}
    assert req["messages"][1]["content"] == "<think>hmm</think>a1"


def test_strip_thinking_edge_cases():
    assert strip_thinking("plain") == "plain"
    assert strip_thinking("<think>a</think>b<think>c</think>d") == "bd"
    assert strip_thinking("answer<think>unterminated") == "answer"


def test_completion_next_turn_extends_text_prompt_only():
    body = next_turn_body({"model": "m", "prompt": "Once upon", "max_tokens": 50, "stream": True}, " a time")
    assert body["prompt"] == "Once upon a time" and body["max_tokens"] == 1 and body["stream"] is False
    assert next_turn_body({"model": "m", "prompt": [1, 2, 3]}, "x") is None
    assert next_turn_body({"model": "m"}, "x") is None


# --- text collection ------------------------------------------------------------------------------


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_collects_streamed_chat_text_across_split_chunks():
    stream = (
        _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        + _sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
        + b": keep-alive comment\n\n"
        + _sse({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]})
        + _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        + _sse({"choices": [], "usage": {"completion_tokens": 2}})
        + b"data: [DONE]\n\n"
    )
    c = TurnTextCollector()
    for i in range(0, len(stream), 7):  # arbitrary network chunking
        c.feed_sse(stream[i : i + 7])
    assert c.text() == "Hello" and c.finished


def test_collects_streamed_completion_text():
    c = TurnTextCollector()
    c.feed_sse(
        _sse({"choices": [{"index": 0, "text": "a b"}]})
        + _sse({"choices": [{"index": 0, "text": " c", "finish_reason": "length"}]})
    )
    assert c.text() == "a b c" and c.finished


def test_unfinished_stream_is_not_finished():
    c = TurnTextCollector()
    c.feed_sse(_sse({"choices": [{"index": 0, "delta": {"content": "partial"}}]}))
    assert c.text() == "partial" and not c.finished


def test_collects_non_streaming_bodies():
    c = TurnTextCollector()
    c.feed_json(
        orjson.dumps(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]}
        )
    )
    assert c.text() == "done" and c.finished
    c = TurnTextCollector()
    c.feed_json({"choices": [{"index": 0, "text": "t", "finish_reason": "stop"}]})
    assert c.text() == "t"


def test_other_choices_and_garbage_are_ignored():
    c = TurnTextCollector()
    c.feed_sse(_sse({"choices": [{"index": 1, "delta": {"content": "other"}}]}) + b"data: {not json\n\n")
    assert c.text() == ""


# --- scheduling -----------------------------------------------------------------------------------


def test_warm_up_is_sent_to_the_same_worker_in_the_background():
    async def main():
        sent = []
        gate = asyncio.Event()

        async def send(body, worker_id, dp_rank):
            await gate.wait()
            sent.append((body, worker_id, dp_rank))

        spec = SpeculativePrefiller(send)
        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert spec.on_turn_finished(req, "hello", 7, 1) is True  # returns at once
        assert spec.in_flight == 1 and sent == []
        gate.set()
        await spec.wait_idle()
        ((body, w, r),) = sent
        assert (w, r) == (7, 1) and body["max_tokens"] == 1
        assert body["messages"][-1] == {"role": "assistant", "content": "hello"}
        assert spec.stats() == {"in_flight": 0, "scheduled": 1, "completed": 1, "failed": 0, "dropped": 0}

    run(main())


def test_bounded_in_flight_drops_extra_warm_ups():
    async def main():
        gate = asyncio.Event()
        calls = []

        async def send(body, worker_id, dp_rank):
            calls.append(worker_id)
            await gate.wait()

        spec = SpeculativePrefiller(send, max_in_flight=2)
        req = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        results = [spec.on_turn_finished(req, "y", i, 0) for i in range(5)]
        assert results == [True, True, False, False, False]
        assert spec.in_flight == 2 and spec.dropped == 3
        gate.set()
        await spec.wait_idle()
        assert spec.in_flight == 0 and spec.completed == 2
        assert spec.on_turn_finished(req, "y", 9, 0) is True  # room again
        await spec.wait_idle()
        assert sorted(calls) == [0, 1, 9]

    run(main())


def test_busy_worker_gets_no_warm_up_and_broken_probe_is_contained():
    async def main():
        async def send(body, worker_id, dp_rank):
            raise AssertionError("must not be sent")

        spec = SpeculativePrefiller(send, is_busy=lambda w, r: w == 1)
        req = {"model": "m", "messages": []}
        assert spec.on_turn_finished(req, "x", 1, 0) is False

        def broken(w, r):
            raise RuntimeError("probe failed")

        spec2 = SpeculativePrefiller(send, is_busy=broken)
        assert spec2.on_turn_finished(req, "x", 2, 0) is False
        assert spec.dropped == 1 and spec2.dropped == 1

    run(main())


def test_failed_warm_up_is_only_counted():
    async def main():
        async def send(body, worker_id, dp_rank):
            raise ConnectionError("worker went away")

        spec = SpeculativePrefiller(send)
        assert spec.on_turn_finished({"model": "m", "messages": []}, "x", 1, 0)
        await spec.wait_idle()
        assert spec.failed == 1 and spec.completed == 0 and spec.in_flight == 0

    run(main())


def test_aclose_cancels_in_flight():
    async def main():
        started = asyncio.Event()

        async def send(body, worker_id, dp_rank):
            started.set()
            await asyncio.Event().wait()

        spec = SpeculativePrefiller(send)
        spec.on_turn_finished({"model": "m", "messages": []}, "x", 1, 0)
        await started.wait()
        await spec.aclose()
        assert spec.in_flight == 0

    run(main())


def test_token_prompt_turn_is_dropped_not_sent():
    async def main():
        async def send(*a):
            raise AssertionError

        spec = SpeculativePrefiller(send)
        assert spec.on_turn_finished({"model": "m", "prompt": [1, 2]}, "x", 1, 0) is False

    run(main())
