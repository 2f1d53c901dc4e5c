"""Issue 12 (real engines), the pure parts: reassembling a streamed answer, reading capacity from
vLLM / SGLang answers, the GIL-free tokenizer path, prompt sizes, the Responses -> chat conversion."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest

from frontend.dispatch.unary_stream import UnaryAssembler, convertible, streaming_body
from frontend.pool.capacity import (
    EngineCapacity,
    apply_metrics,
    apply_models,
    apply_sglang_server_info,
    apply_vllm_server_info,
    engine_kind,
    unknown_capacity_message,
)
from kvroute_common.openai_api import OpenAIError, responses_to_chat
from kvroute_common.tokenize_offload import TokenizeOffload, prompt_chars
from kvroute_common.tokenizer import PromptTooLong, chat_request_token_ids, load_tokenizer, prompt_encoder
from support import until


def _sse(*objs: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def test_chat_stream_reassembles_text_reasoning_tool_calls_logprobs_and_usage() -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    lp = lambda t: {"content": [{"token": t, "logprob": -0.5, "bytes": None, "top_logprobs": []}]}  # noqa: E731
    data = _sse(
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"reasoning_content": "think"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "Hel"}, "logprobs": lp("Hel"), "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "lo"}, "logprobs": lp("lo"), "finish_reason": None}]},
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get", "arguments": '{"a"'},
                            }
                        ]
                    },
                }
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]},
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 6,
                "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    )
    asm = UnaryAssembler(chat=True)
    # fed in awkward pieces: events split across reads
    counts = [asm.feed(data[i : i + 37]) for i in range(0, len(data), 37)]
    assert sum(counts) == 6 and asm.first_token and asm.done and asm.error is None
    body = orjson.loads(asm.body())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["created"] == 7
    (choice,) = body["choices"]
    msg = choice["message"]
    assert msg["content"] == "Hello" and msg["reasoning_content"] == "think" and msg["role"] == "assistant"
    assert msg["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    ]
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["Hel", "lo"]
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] is None
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 and asm.completion_tokens == 6


def test_completion_stream_reassembles_choices_and_stop_reason() -> None:
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    asm = UnaryAssembler(chat=False)
    asm.feed(
        _sse(
            {**base, "choices": [{"index": 1, "text": "b", "logprobs": None, "finish_reason": None}]},
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]},
                        "finish_reason": None,
                    }
                ],
            },
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "text": "!",
                        "logprobs": {"tokens": ["!"], "token_logprobs": [-2.0]},
                        "finish_reason": "stop",
                        "stop_reason": "END",
                    }
                ],
            },
            {**base, "choices": [{"index": 1, "text": "", "finish_reason": "length", "stop_reason": None}]},
            {**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}},
        )
    )
    body = orjson.loads(asm.body())
    assert [c["index"] for c in body["choices"]] == [0, 1]
    c0, c1 = body["choices"]
    assert c0["text"] == "a!" and c0["logprobs"] == {"tokens": ["a", "!"], "token_logprobs": [-1.0, -2.0]}
    assert c0["finish_reason"] == "stop" and c0["stop_reason"] == "END"
    assert c1["text"] == "b" and c1["finish_reason"] == "length" and c1["logprobs"] is None


def test_error_event_and_conversion_rules() -> None:
    asm = UnaryAssembler(chat=True)
    asm.feed(b'data: {"error": {"message": "boom", "code": 400}}\n\n')
    assert asm.error == {"message": "boom", "code": 400} and not asm.first_token
    assert convertible({"messages": []}) and convertible({"echo": False})
    for key, value in (("prompt_logprobs", 1), ("echo", True), ("best_of", 2), ("kv_transfer_params", {})):
        assert not convertible({key: value})
    sent = orjson.loads(streaming_body({"model": "m", "stream": False, "max_tokens": 3}))
    assert sent == {"model": "m", "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}


def test_streaming_body_appends_to_the_raw_bytes_and_reencodes_only_when_it_must() -> None:
    want = {"stream": True, "stream_options": {"include_usage": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 1}
    raw = b'{ "model": "m", "messages": [{"role": "user", "content": "' + b"x" * 100_000 + b'"}], "max_tokens": 1 }\n'
    sent = streaming_body(body, raw)
    assert sent.startswith(raw[:40]) and orjson.loads(sent) == {**body, **want}  # the client's bytes, extended
    for fields in ({"stream": False}, {"stream_options": {"include_usage": False}}):
        with_field = {**body, **fields}  # appending would duplicate a key: the body is encoded again
        sent = streaming_body(with_field, orjson.dumps(with_field))
        assert orjson.loads(sent) == {**body, **want} and sent.count(b'"stream"') == 1


def test_streaming_body_encodes_again_what_is_sent_not_the_clients_body() -> None:
    """A unary request that said ``stream: false`` is encoded again from the bytes the engine was to get:
    a prompt sent as the router's ids and a decode request's transfer parameters stay in it."""
    from frontend.routing.disagg import decode_body

    body = {"model": "m", "prompt": "a b", "stream": False, "max_tokens": 1}
    want = {"stream": True, "stream_options": {"include_usage": True}}
    as_ids = orjson.dumps({**body, "prompt": [1, 2]})
    assert orjson.loads(streaming_body(body, as_ids)) == {**body, "prompt": [1, 2], **want}
    decode = decode_body(body, {"remote_block_ids": [7]})
    assert orjson.loads(streaming_body(body, decode)) == {
        **body,
        "kv_transfer_params": {"remote_block_ids": [7]},
        **want,
    }


def test_capacity_from_vllm_metrics_and_server_info() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
        'gpu_memory_utilization="0.9",num_gpu_blocks="31000",num_gpu_blocks_override="None"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    )
    assert engine_kind(text) == "vllm"
    cap = EngineCapacity()
    apply_models(cap, {"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]})
    apply_metrics(cap, text)
    assert cap.engine == "vllm" and cap.values == {"max_model_len": 4096, "block_size": 16, "num_gpu_blocks": 31000}
    assert cap.unknown == ["max_num_batched_tokens"]
    msg = unknown_capacity_message(7, cap)
    assert "worker 7 (vllm) does not expose max_num_batched_tokens" in msg and "VLLM_SERVER_DEV_MODE" in msg
    apply_vllm_server_info(
        cap,
        {
            "vllm_config": {
                "scheduler_config": {"max_num_batched_tokens": 2048, "max_num_seqs": 128},
                "cache_config": {"block_size": 32},
            }
        },
    )
    assert (
        cap.unknown == [] and cap.values["max_num_batched_tokens"] == 2048 and cap.values["block_size"] == 16
    )  # first source wins
    assert (
        cap.sources["max_num_batched_tokens"] == "/server_info"
        and cap.sources["block_size"] == "vllm:cache_config_info"
    )


def test_capacity_from_sglang_server_info_and_config_first() -> None:
    cap = EngineCapacity()
    cap.set("max_num_batched_tokens", 999, "config")
    apply_sglang_server_info(
        cap,
        {
            "page_size": 64,
            "chunked_prefill_size": -1,
            "max_prefill_tokens": 16384,
            "max_running_requests": 32,
            "context_length": 32768,
            "internal_states": [{"max_total_num_tokens": 640000}],
        },
    )
    assert cap.engine == "sglang"
    assert cap.values == {
        "max_num_batched_tokens": 999,
        "block_size": 64,
        "num_gpu_blocks": 10000,
        "max_num_seqs": 32,
        "max_model_len": 32768,
    }
    cap2 = EngineCapacity()
    apply_sglang_server_info(cap2, {"page_size": 1, "max_total_num_tokens": 5000, "chunked_prefill_size": 8192})
    assert (cap2.values["block_size"], cap2.values["num_gpu_blocks"], cap2.values["max_num_batched_tokens"]) == (
        1,
        5000,
        8192,
    )
    assert engine_kind('kvroute_mocker_info{model_name="m",tokenizer="builtin"} 1.0\nvllm:x 1\n') == "mocker"


def test_gil_free_encode_gives_the_same_ids_and_refuses_long_prompts() -> None:
    tok = load_tokenizer(None)
    enc = prompt_encoder(tok)
    text = "Hello  world!\n\n<|im_start|>ünï ☃ code() " * 50
    assert (
        enc.encode(text, nogil=True)
        == enc.encode(text)
        == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    )
    assert enc.encode(text, add_special_tokens=True, nogil=True) == enc.encode(text, add_special_tokens=True)
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}
    ids = chat_request_token_ids(tok, body)
    assert chat_request_token_ids(tok, body, nogil=True) == ids
    with pytest.raises(PromptTooLong) as err:
        chat_request_token_ids(tok, body, nogil=True, limit=len(ids))
    assert err.value.n_tokens == len(ids)
    assert chat_request_token_ids(tok, body, nogil=True, limit=len(ids) + 1) == ids


def test_inline_encode_of_few_or_many_unseen_pieces_gives_the_backends_ids() -> None:
    from kvroute_common.tokenizer import PromptEncoder

    tok = load_tokenizer(None)
    enc = PromptEncoder(tok)  # empty caches: every piece is unseen once
    few = "hi 4711 there"  # under GIL_HELD_PIECES: encoded one by one
    many = " ".join(f"w{i}x{i * 7}" for i in range(3 * enc.GIL_HELD_PIECES))  # over it: one batch
    for text in (few, many, few + " " + many):
        assert enc.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert enc.encode(text, add_special_tokens=True) == tok.backend_tokenizer.encode(text).ids


def test_offload_runs_long_prompts_on_a_thread_and_short_ones_inline() -> None:
    off = TokenizeOffload(100)
    seen: list[tuple[str, bool]] = []

    def fn(x: int, nogil: bool = False, extra: int = 0) -> int:
        seen.append((threading.current_thread().name, nogil))
        return x + extra

    async def main() -> tuple[int, int]:
        return await off.run(10, fn, 1), await off.run(1000, fn, 2, extra=3)

    try:
        assert asyncio.run(main()) == (1, 5)
    finally:
        off.close()
    assert seen[0] == (threading.main_thread().name, False)
    assert seen[1][0].startswith("tokenize") and seen[1][1] is True and off.offloaded == 1
    assert not TokenizeOffload(0).offloads(10**9)
    with pytest.raises(ValueError):
        TokenizeOffload(-1)


def test_started_offload_runs_long_prompts_on_threads_started_before_any_request() -> None:
    off = TokenizeOffload(100)
    off.start()
    started = set(threading.enumerate())
    gate = threading.Barrier(2, timeout=10)  # both prompts on a thread at once: two threads, both started

    def fn(nogil: bool = False) -> threading.Thread:
        gate.wait()
        return threading.current_thread()

    async def main() -> list[threading.Thread]:
        return list(await asyncio.gather(off.run(1000, fn), off.run(1000, fn)))

    try:
        ran_on = asyncio.run(main())
    finally:
        off.close()
    assert len(set(ran_on)) == 2 and set(ran_on) <= started and set(threading.enumerate()) <= started
    never = TokenizeOffload(0)
    never.start()  # never offloads: no thread
    assert set(threading.enumerate()) <= started


def test_huge_prompts_are_encoded_one_at_a_time_on_their_own_thread_beside_the_others() -> None:
    """Two huge prompts never encode at once (they would take both cores of a small machine from the
    loop), and a long prompt under ``bulk_chars`` does not wait behind them."""
    off = TokenizeOffload(100, bulk_chars=10_000)
    off.start()
    started = set(threading.enumerate())
    release = threading.Event()
    huge_running: list[int] = []
    ran_on: dict[str, set[str]] = {"huge": set(), "long": set()}
    most_at_once = [0]
    lock = threading.Lock()

    def huge(nogil: bool = False) -> None:
        with lock:
            huge_running.append(1)
            most_at_once[0] = max(most_at_once[0], len(huge_running))
            ran_on["huge"].add(threading.current_thread().name)
        release.wait(10)
        with lock:
            huge_running.pop()

    def long(nogil: bool = False) -> str:
        ran_on["long"].add(threading.current_thread().name)
        return "done"

    async def main() -> None:
        huges = [asyncio.ensure_future(off.run(20_000, huge)) for _ in range(3)]
        await until(lambda: len(huge_running) == 1, what="the first huge prompt encoding")
        assert await asyncio.wait_for(off.run(5_000, long), 10) == "done"  # not behind the huge ones
        release.set()
        await asyncio.gather(*huges)

    try:
        asyncio.run(main())
    finally:
        release.set()
        off.close()
    assert most_at_once[0] == 1
    assert len(ran_on["huge"]) == 1 and next(iter(ran_on["huge"])).startswith("tokenize-bulk")
    assert ran_on["long"].isdisjoint(ran_on["huge"]) and set(threading.enumerate()) <= started


def test_prompt_chars_and_responses_to_chat() -> None:
    assert (
        prompt_chars(
            {
                "messages": [
                    {"role": "user", "content": "abc"},
                    {"role": "user", "content": [{"type": "text", "text": "de"}]},
                    {"role": "assistant", "content": None},
                ]
            }
        )
        == 5
    )
    assert (
        prompt_chars({"prompt": "abcd"}) == 4
        and prompt_chars({"prompt": ["ab"]}) == 2
        and prompt_chars({"prompt": [1, 2, 3]}) == 0
    )
    assert (
        prompt_chars(
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "xyz"}]}], "instructions": "ab"}
        )
        == 5
    )
    chat = responses_to_chat(
        {
            "instructions": "sys",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                "d",
            ],
        }
    )
    assert chat == {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ]
    }
    for bad in (
        {"input": []},
        {"input": [{"type": "function_call"}]},
        {"input": "x", "instructions": 3},
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    ):
        with pytest.raises(OpenAIError) as err:
            responses_to_chat(bad)
        assert err.value.status == 400
