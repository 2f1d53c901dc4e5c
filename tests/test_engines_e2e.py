"""Issue 12 (real engines), end to end: real `python -m frontend` + real `python -m mocker` processes.

Lifecycle of non-streaming requests (prefill released at the first token, decode booked to the end,
TTFT), the reassembled body, vLLM-style validation, OpenAI errors on every /v1 path, /v1/responses
and /v1/embeddings, capacity read from what engines expose, the startup line and warnings, and a
bad --model-path failing fast.

Workers: mockers 1 and 2 (vLLM-like with /server_info), mocker 3 started like a vLLM without
VLLM_SERVER_DEV_MODE (``--no-server-info``: its batch budget is exposed nowhere), and worker 4, an
in-process HTTP server answering SGLang's discovery endpoints (``/get_server_info``, ``sglang:*``
metrics) for another model: no SGLang runs on a CPU-only machine, and the frontend only reads those
endpoints from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from test_frontend_e2e import (
    MODEL,
    START_TIMEOUT,
    WAIT,
    Frontend,
    _log_dir,
    start_frontend,
    start_mockers,
    stream_until_first_chunk,
    system_prompt,
    wait_ready,
)

from support import REPO_ROOT, free_ports, wait_until

SGLANG_MODEL = "sglang-model"


class SglangLike:
    """SGLang's discovery surface (``/v1/models``, ``/get_server_info``, ``sglang:*`` metrics) in a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        info = {
            "version": "0.5.0",
            "page_size": 16,
            "max_total_num_tokens": 16000,
            "chunked_prefill_size": 4096,
            "max_prefill_tokens": 16384,
            "max_running_requests": 64,
            "context_length": 8192,
            "served_model_name": SGLANG_MODEL,
        }
        app = Starlette(
            routes=[
                Route("/health", lambda r: PlainTextResponse("")),
                Route(
                    "/v1/models",
                    lambda r: JSONResponse(
                        {
                            "object": "list",
                            "data": [
                                {"id": SGLANG_MODEL, "object": "model", "owned_by": "sglang", "max_model_len": 8192}
                            ],
                        }
                    ),
                ),
                Route(
                    "/metrics", lambda r: PlainTextResponse('sglang:num_running_reqs{model_name="sglang-model"} 0.0\n')
                ),
                Route("/get_server_info", lambda r: JSONResponse(info)),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> SglangLike:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, what="sglang-like server")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Eng:
    fe: Frontend
    log_path: str
    mocker_urls: list[str]


@pytest.fixture(scope="module")
def eng() -> Iterator[Eng]:
    with contextlib.ExitStack() as stack:
        e = Eng()
        ms = start_mockers(2, stack)
        (plain,) = start_mockers(1, stack, ["--no-server-info"])
        (sg_port,) = free_ports(1)
        stack.enter_context(SglangLike(sg_port))
        workers = [
            *["--worker", ms[0].worker_arg(1)],
            *["--worker", ms[1].worker_arg(2)],
            *["--worker", plain.worker_arg(3)],
            "--worker",
            f"id=4,url=http://127.0.0.1:{sg_port}",
        ]
        e.fe = start_frontend(["--router-mode", "kv", "--log-level", "info", *workers], stack)
        e.log_path = os.path.join(_log_dir(), f"frontend-{e.fe.port}.log")
        e.mocker_urls = [ms[0].url, ms[1].url, plain.url]
        wait_ready([*ms, plain], [e.fe])
        wait_until(
            lambda: sum(1 for w in e.fe.http.get("/admin/workers").json()["workers"] if w["healthy"]) == 4,
            START_TIMEOUT,
            what="every worker healthy",
        )
        yield e


def _workers(fe: Frontend) -> dict[int, dict]:
    return {w["id"]: w for w in fe.http.get("/admin/workers").json()["workers"]}


def _log(e: Eng) -> str:
    with open(e.log_path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------------------------
# start-up: one line, warnings, capacity


def test_startup_line_capacity_and_warnings(eng: Eng) -> None:
    port = eng.fe.port
    line = wait_until(
        lambda: next((ln for ln in _log(eng).splitlines() if "listening on" in ln), None), WAIT, what="startup line"
    )
    assert f"listening on http://127.0.0.1:{port}" in line and "router mode kv" in line
    assert "1=http://127.0.0.1:" in line and "4=http://127.0.0.1:" in line and "tokenizer: built-in" in line

    w = _workers(eng.fe)
    # vLLM's names: blocks from vllm:cache_config_info, the batch budget only from /server_info
    assert w[1]["engine"] == "mocker" and w[1]["capacity_unknown"] == [] and w[1]["warnings"] == []
    assert w[1]["capacity_sources"] == {
        "block_size": "vllm:cache_config_info",
        "num_gpu_blocks": "vllm:cache_config_info",
        "max_num_batched_tokens": "/server_info",
        "max_num_seqs": "/server_info",
        "max_model_len": "/v1/models",
    }
    assert w[1]["max_num_batched_tokens"] == 8192 and w[1]["num_gpu_blocks"] == 2048 and w[1]["max_model_len"] == 32768
    # a vLLM without /server_info: said so, not silently defaulted
    assert w[3]["capacity_unknown"] == ["max_num_batched_tokens"] and w[3]["max_num_batched_tokens"] is None
    assert w[3]["num_gpu_blocks"] == 2048
    # SGLang: page size, KV tokens / page size, chunked prefill budget, context length
    assert w[4]["engine"] == "sglang" and w[4]["models"] == [SGLANG_MODEL]
    assert (w[4]["block_size"], w[4]["num_gpu_blocks"], w[4]["max_num_batched_tokens"], w[4]["max_model_len"]) == (
        16,
        1000,
        4096,
        8192,
    )
    assert w[4]["capacity_unknown"] == []
    # kv mode + built-in tokenizer + an engine that is not the mocker: warned, in the log and the registry
    assert any("built-in tokenizer" in msg for msg in w[4]["warnings"])
    log = wait_until(
        lambda: (lambda t: t if "worker 3 (mocker) does not expose max_num_batched_tokens" in t else None)(_log(eng)),
        WAIT,
        what="capacity warning",
    )
    assert "uses the built-in tokenizer but worker 4" in log


# ---------------------------------------------------------------------------------------------
# lifecycle of a non-streaming request


def test_unary_prefill_released_at_first_token_decode_booked_to_the_end(eng: Eng) -> None:
    fe = eng.fe
    wait_until(fe.idle, WAIT, what="idle before")
    before = fe.http.get("/metrics").text
    messages = [{"role": "system", "content": system_prompt(uuid.uuid4().hex, 400)}, {"role": "user", "content": "go"}]
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        r = httpx.post(
            fe.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": MODEL,
                "messages": messages,
                "max_tokens": 1500,
                "ignore_eos": True,
                "nvext": {"extra_fields": ["worker_id"]},
            },
        )
        result["elapsed"] = time.monotonic() - t0
        result["response"] = r

    t = threading.Thread(target=send)
    t.start()
    try:
        # while the answer is still being generated: no prefill tokens left anywhere, its decode blocks booked
        seen = wait_until(
            lambda: (
                lambda loads: (
                    next(((k, v) for k, v in loads.items() if v[0] == 0 and v[1] > 0), None)
                    if "response" not in result
                    else "finished"
                )
            )(fe.loads()),
            WAIT,
            interval=0.01,
            what="prefill released with decode still booked",
        )
        assert seen != "finished", "the request ended before its booked load could be observed"
        (wid, rank), (prefill, decode) = seen
        assert decode >= 400 // 16
    finally:
        t.join(120)
    r = result["response"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 1500 and body["usage"]["prompt_tokens"] > 400
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert body["nvext"]["worker_id"]["decode_worker_id"] == wid
    wait_until(fe.idle, WAIT, what="freed at the end")
    # TTFT of this unary request is its first token, not its end-to-end time
    after = fe.http.get("/metrics").text
    name = "dynamo_frontend_time_to_first_token_seconds"
    ttft = _metric_sum(after, name + "_sum", model=MODEL) - _metric_sum(before, name + "_sum", model=MODEL)
    assert _metric_sum(after, name + "_count", model=MODEL) - _metric_sum(before, name + "_count", model=MODEL) == 1
    assert 0 < ttft < result["elapsed"] / 3


def test_unary_body_is_the_engines_answer(eng: Eng) -> None:
    """Streamed internally, reassembled: the same text and usage the engine gives non-streaming."""
    for path, extra in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}]}),
        ("/v1/completions", {"prompt": "Once upon a time"}),
    ):
        body = {"model": MODEL, "max_tokens": 12, "seed": 42, "temperature": 1.0, **extra}
        via = eng.fe.http.post(path, json=body)
        direct = httpx.post(eng.mocker_urls[0] + path, json=body, timeout=30)
        assert via.status_code == direct.status_code == 200, via.text
        a, b = via.json(), direct.json()
        assert a["object"] == b["object"] and a["model"] == b["model"]
        ca, cb = a["choices"][0], b["choices"][0]
        key = "message" if "messages" in extra else "text"
        assert ca[key] == cb[key] and ca["finish_reason"] == cb["finish_reason"]
        assert ca["stop_reason"] == cb["stop_reason"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 12
    wait_until(eng.fe.idle, WAIT, what="idle")


# ---------------------------------------------------------------------------------------------
# validation and error shapes


_BAD = [
    ({"temperature": -5}, "temperature must be non-negative, got -5", "temperature"),
    ({"temperature": 2.5}, "temperature must be in [0, 2]", "temperature"),
    ({"temperature": "hot"}, "temperature must be a number", "temperature"),
    ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]", "top_p"),
    ({"top_k": -2}, "top_k must be 0 (disable), or at least 1", "top_k"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0", "max_tokens"),
    ({"max_completion_tokens": -1}, "max_tokens must be at least 1", "max_completion_tokens"),
    ({"n": 0}, "n must be at least 1, got 0", "n"),
    ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling", "n"),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero", "repetition_penalty"),
    ({"min_p": 2}, "min_p must be in [0, 1]", "min_p"),
    ({"stop": ["ok", ""]}, "stop cannot contain an empty string", "stop"),
    ({"stop": 5}, "stop must be a string or a list of strings", "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids must contain only integers", "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2", "min_tokens"),
    (
        {"stream_options": {"include_usage": True}},
        "Stream options can only be defined when `stream=True`",
        "stream_options",
    ),
    ({"top_logprobs": 3}, "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role 'wizard' is not one of", "messages"),
    (
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content must not be null for role 'user'",
        "messages",
    ),
    (
        {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
        "must not be null for role 'system'",
        "messages",
    ),
    ({"messages": [{"content": "hi"}]}, "messages[0].role is required", "messages"),
    ({"tools": []}, "`tools` must not be an empty array", "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name: a string is required", "tools"),
    ({"max_tokens": 40000}, "maximum context length is 32768 tokens", "max_tokens"),
]


@pytest.mark.parametrize("change,message,param", _BAD, ids=[b[2] + ":" + b[1][:30] for b in _BAD])
def test_invalid_requests_get_vllm_messages(eng: Eng, change: dict, message: str, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    r = eng.fe.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param and err["code"] == 400 and err["type"] == "Bad Request"
    assert eng.fe.idle()


def test_valid_edge_values_and_null_assistant_content_pass(eng: Eng) -> None:
    client = eng.fe.client
    ok = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        temperature=0,
        top_p=1,
        n=1,
        presence_penalty=-2,
        extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1.0},
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    )
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="temperature must be non-negative"):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)


def test_every_v1_error_is_openai_shaped(eng: Eng) -> None:
    http = eng.fe.http
    cases = [
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("POST", "/v1/nope", 404),
        ("GET", "/v1/nope/deeper", 404),
        ("POST", "/v1", 404),
        ("GET", "/v1/models/no-such", 404),
    ]
    for method, path, status in cases:
        r = http.request(method, path)
        assert r.status_code == status, (method, path, r.status_code, r.text)
        err = r.json()["error"]
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, r.text
        assert err["code"] == status and err["message"]
    assert "POST" in http.get("/v1/chat/completions").headers["allow"]
    with pytest.raises(openai.NotFoundError):
        eng.fe.client.post("/nope", cast_to=dict, body={})
    # outside /v1 the services' own shape stays
    assert http.get("/nope").json() == {"error": "route not found"}


# ---------------------------------------------------------------------------------------------
# /v1/responses and /v1/embeddings


def test_responses_are_tokenized_like_chat_and_routed_kv(eng: Eng) -> None:
    fe = eng.fe
    text = system_prompt(uuid.uuid4().hex, 300)
    r1 = fe.client.responses.create(
        model=MODEL,
        input=text,
        instructions="answer briefly",
        max_output_tokens=4,
        extra_body={"nvext": {"extra_fields": ["worker_id"]}},
    )
    assert r1.object == "response" and r1.output_text and r1.usage.output_tokens == 4
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": text}]
    assert r1.usage.input_tokens == fe.explain(messages)["isl"]  # the router's tokens are the engine's
    first = r1.model_extra["nvext"]["worker_id"]["decode_worker_id"]
    # once the worker's KV events are in, the same prompt goes back where its blocks are
    wait_until(lambda: fe.explain(messages)["overlap_blocks"] > 0, WAIT, what="responses prompt indexed")
    assert fe.explain(messages)["worker_id"] == first
    r2 = fe.client.responses.create(
        model=MODEL,
        input=text,
        instructions="answer briefly",
        max_output_tokens=2,
        extra_body={"nvext": {"extra_fields": ["worker_id"]}},
    )
    assert r2.model_extra["nvext"]["worker_id"]["decode_worker_id"] == first
    assert r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="input"):
        fe.client.responses.create(model=MODEL, input=[])
    wait_until(fe.idle, WAIT, what="idle")


def test_embeddings_are_routed_by_load(eng: Eng) -> None:
    fe = eng.fe
    emb = fe.client.embeddings.create(model=MODEL, input=["alpha beta", "gamma"])
    assert [d.index for d in emb.data] == [0, 1] and all(len(d.embedding) == 16 for d in emb.data)
    again = fe.client.embeddings.create(model=MODEL, input="alpha beta")
    assert again.data[0].embedding == pytest.approx(emb.data[0].embedding, abs=1e-6)
    assert emb.usage.prompt_tokens > again.usage.prompt_tokens > 0
    # one worker busy with a long generation: embeddings go to the others
    stream = stream_until_first_chunk(fe, [{"role": "user", "content": system_prompt(uuid.uuid4().hex, 400)}])
    try:
        busy = {k[0] for k, v in fe.loads().items() if v != (0, 0)}
        assert len(busy) == 1
        for i in range(6):
            r = fe.http.post(
                "/v1/embeddings",
                json={
                    "model": MODEL,
                    "input": f"text {i} " * 50,
                    "encoding_format": "float",
                    "nvext": {"extra_fields": ["worker_id"]},
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["nvext"]["worker_id"]["decode_worker_id"] not in busy
    finally:
        stream.close()
    r = fe.http.post("/v1/embeddings", json={"model": MODEL, "input": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    wait_until(fe.idle, WAIT, what="idle")


# ---------------------------------------------------------------------------------------------
# fail fast


@pytest.mark.parametrize("kind", ["missing", "empty_dir"])
def test_bad_model_path_exits_nonzero_with_the_reason(kind: str, tmp_path) -> None:
    path = str(tmp_path / "nowhere") if kind == "missing" else str(tmp_path)
    (port,) = free_ports(1)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--model-path",
            path,
            "--worker",
            "id=1,url=http://127.0.0.1:9",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode != 0
    assert re.search(r"--model-path '.*': (not a directory|cannot load a tokenizer)", proc.stderr), proc.stderr[-2000:]
    assert "listening on" not in proc.stdout


def test_request_timeout_still_bounds_a_whole_unary_answer(eng: Eng) -> None:
    """Non-streaming requests are streams to the engine now: --request-timeout must still cover the whole answer."""
    with contextlib.ExitStack() as stack:
        fe = start_frontend(
            ["--router-mode", "kv", "--request-timeout", "1", "--worker", f"id=1,url={eng.mocker_urls[0]}"], stack
        )
        wait_until(lambda: fe.http.get("/health").status_code == 200, START_TIMEOUT, what="timeout frontend")
        t0 = time.monotonic()
        r = fe.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "long"}],
                "max_tokens": 5000,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 504 and "within 1.0 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 20
        wait_until(fe.idle, WAIT, what="timed-out request freed")
        ok = fe.http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "short"}], "max_tokens": 2},
        )
        assert ok.status_code == 200, ok.text
