"""Every remaining nvext field and header of the router guide (and the reference frontend's behaviour): honoured
(the worker sees the effect, the client the response fields) or refused with an OpenAI-style 400; none ignored.

The worker is a small in-process OpenAI-style server that records the body and headers it receives;
the frontend is the real `python -m frontend` process."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from support import free_ports, service, wait_until

MODEL = "rec-model"


class RecordingWorker:
    def __init__(self, port: int) -> None:
        self.seen: list[tuple[dict, dict]] = []  # (headers, body)
        app = Starlette(
            routes=[
                Route("/health", lambda r: PlainTextResponse("")),
                Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": [{"id": MODEL}]})),
                Route(
                    "/metrics",
                    lambda r: PlainTextResponse('vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'),
                ),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/v1/completions", self.generate, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    async def generate(self, request: Request):
        body = await request.json()
        self.seen.append((dict(request.headers), body))
        chat = "messages" in body
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "stop", "stop_reason": "END"}
            choice.update({"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"})
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [choice],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )

        async def gen():
            for i, fin in ((0, None), (1, "stop")):
                choice = {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": fin}
                if fin:
                    choice["stop_reason"] = "END"
                chunk = {"object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    def __enter__(self) -> RecordingWorker:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, what="recording worker")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fw():
    wport, fport = free_ports(2)
    with RecordingWorker(wport) as worker:
        url = f"http://127.0.0.1:{fport}"
        args = [
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(fport),
            "--router-mode",
            "kv",
            "--worker",
            f"id=7,url=http://127.0.0.1:{wport}",
            "--health-check-interval",
            "0.5",
            "--log-level",
            "warning",
        ]
        with service(args, ready_url=url + "/health", timeout=90):
            wait_until(lambda: httpx.get(url + "/health").status_code == 200, 60, what="frontend ready")
            with httpx.Client(base_url=url, timeout=30) as client:
                yield client, worker


def chat(nvext: dict | None = None, **kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, **kw}
    if nvext is not None:
        body["nvext"] = nvext
    return body


def refused(resp: httpx.Response, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] and err["code"] == 400 and "param" in err
    for w in words:
        assert w in err["message"], err["message"]


def test_greed_sampling_makes_the_worker_decode_greedily(fw):
    client, worker = fw
    r = client.post("/v1/chat/completions", json=chat({"greed_sampling": True}, temperature=1.3, top_p=0.5))
    assert r.status_code == 200, r.text
    _, body = worker.seen[-1]
    assert body["temperature"] == 0.0 and "top_p" not in body and "nvext" not in body
    r = client.post("/v1/chat/completions", json=chat({"greed_sampling": False}, temperature=1.3))
    assert worker.seen[-1][1]["temperature"] == 1.3


def test_use_raw_prompt(fw):
    client, worker = fw
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "raw text", "max_tokens": 2, "nvext": {"use_raw_prompt": True}},
    )
    assert r.status_code == 200, r.text  # completions prompts are never templated: honoured as is
    assert worker.seen[-1][1]["prompt"] == "raw text"
    refused(client.post("/v1/chat/completions", json=chat({"use_raw_prompt": True})), "use_raw_prompt")


@pytest.mark.parametrize(
    "nvext, word",
    [
        ({"max_thinking_tokens": 64}, "max_thinking_tokens"),
        ({"metadata_upload": {"url": "s3://bucket/x"}}, "metadata_upload"),
        ({"routing_constraints": {"required_taints": ["gpu-a"]}}, "required_taints"),
        ({"routing_constraints": {"preferred_taints": {"fast": 0.5}}}, "preferred_taints"),
        ({"extra_fields": ["routed_experts"]}, "routed_experts"),
        ({"extra_fields": ["engine_data"]}, "engine_data"),
        ({"extra_fields": ["completion_token_ids"]}, "completion_token_ids"),
        ({"extra_fields": ["prompt_logprobs"]}, "prompt_logprobs"),
        ({"annotations": ["query_instance_id:abc"]}, "query_instance_id"),
        ({"annotations": ["nonsense"]}, "unknown annotation"),
        ({"annotations": ["formatted_prompt"]}, "stream=true"),  # unary: nowhere to send the event
    ],
)
def test_unsupported_fields_are_a_clear_400_and_book_nothing(fw, nvext, word):
    client, worker = fw
    n = len(worker.seen)
    refused(client.post("/v1/chat/completions", json=chat(nvext)), word)
    assert len(worker.seen) == n
    assert all(r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in client.get("/loads").json())


def test_empty_constraints_are_fine(fw):
    client, _ = fw
    assert client.post("/v1/chat/completions", json=chat({"routing_constraints": {}})).status_code == 200


def test_stop_reason_extra_field(fw):
    client, _ = fw
    r = client.post("/v1/chat/completions", json=chat({"extra_fields": ["stop_reason"]}))
    assert r.status_code == 200 and r.json()["nvext"] == {"stop_reason": "END"}
    with client.stream(
        "POST", "/v1/chat/completions", json=chat({"extra_fields": ["stop_reason", "worker_id"]}, stream=True)
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["nvext"]["stop_reason"] == "END" and events[-1]["nvext"]["worker_id"]["decode_worker_id"] == 7
    # worker_id on every piece from the first (a client learns its worker mid-stream, as from the reference);
    # the stop reason only on the piece that finishes
    assert len(events) >= 2 and all(e["nvext"]["worker_id"]["decode_worker_id"] == 7 for e in events if e["choices"])
    assert all("stop_reason" not in e["nvext"] for e in events[:-1])


def test_annotations_are_sse_events_before_the_stream(fw):
    client, _ = fw
    with client.stream(
        "POST", "/v1/chat/completions", json=chat({"annotations": ["formatted_prompt", "token_ids"]}, stream=True)
    ) as s:
        assert s.status_code == 200
        text = s.read().decode()
    events = text.split("\n\n")
    assert events[0].startswith("event: formatted_prompt\n:")
    prompt = json.loads(events[0].split("\n:", 1)[1])
    assert "hello there" in prompt
    assert events[1].startswith("event: token_ids\n:")
    ids = json.loads(events[1].split("\n:", 1)[1])
    assert ids and all(isinstance(i, int) for i in ids)
    assert events[2].startswith("data: {") and "data: [DONE]" in text
    r = client.post("/admin/route", json={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]})
    assert r.json()["isl"] == len(ids)  # the same tokens the router hashed


def test_request_id_header(fw):
    client, worker = fw
    rid = str(uuid.uuid4())
    r = client.post("/v1/chat/completions", json=chat(), headers={"x-dynamo-request-id": rid.upper()})
    assert r.status_code == 200 and r.headers["x-dynamo-request-id"] == rid
    assert worker.seen[-1][0]["x-request-id"] == rid
    with client.stream(
        "POST", "/v1/chat/completions", json=chat(stream=True), headers={"x-dynamo-request-id": rid}
    ) as s:
        assert s.headers["x-dynamo-request-id"] == rid
        s.read()
    r = client.post("/v1/chat/completions", json=chat(), headers={"x-dynamo-request-id": "not-a-uuid"})
    fresh = r.headers["x-dynamo-request-id"]
    assert uuid.UUID(fresh).version == 4 and worker.seen[-1][0]["x-request-id"] == fresh


def test_metadata_headers_reach_the_worker_within_limits(fw):
    client, worker = fw
    r = client.post(
        "/v1/chat/completions", json=chat(), headers={"x-dynamo-meta-policy-class": "gold", "x-dynamo-meta-team": "a"}
    )
    assert r.status_code == 200
    seen = worker.seen[-1][0]
    assert seen["x-dynamo-meta-policy-class"] == "gold" and seen["x-dynamo-meta-team"] == "a"
    n = len(worker.seen)
    refused(
        client.post("/v1/chat/completions", json=chat(), headers={f"x-dynamo-meta-k{i}": "v" for i in range(65)}),
        "at most 64",
    )
    refused(client.post("/v1/chat/completions", json=chat(), headers={"x-dynamo-meta-big": "v" * 70000}), "bytes")
    assert len(worker.seen) == n
