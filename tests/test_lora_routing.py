"""LoRA-aware routing against mockers serving adapters (``--lora-modules``, vLLM's syntax): the
adapters are learnt from each worker's ``/v1/models``, an adapter's blocks are hashed with its name
(as the engine's KV events carry it), base-model and adapter blocks never match, and a request for
an adapter goes only to workers serving it. Real processes and sockets; the same behaviour against
real vLLM is in tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx

from support import frontend_client, mocker_url, wait_until

MODEL = "lora-base"
BS = 16


def mocker(*adapters: str) -> contextlib.AbstractContextManager[str]:
    lora = ["--enable-lora", "--lora-modules", *(f"{a}=/adapters/{a}" for a in adapters)] if adapters else []
    return mocker_url(MODEL, *lora, block_size=BS)


def frontend(*urls: str) -> contextlib.AbstractContextManager[httpx.Client]:
    return frontend_client(urls)


def chat(fe: httpx.Client, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = fe.post("/v1/chat/completions", json={**body, "nvext": {"extra_fields": ["routing"]}}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def overlap(fe: httpx.Client, body: dict[str, Any], worker: int) -> int:
    cands = fe.post("/admin/route", json=body).json()["candidates"]
    return next((c["overlap_blocks"] for c in cands if c["worker_id"] == worker), 0)


def test_adapters_are_routed_by_their_own_blocks_and_only_to_workers_serving_them() -> None:
    with mocker("a1", "a2") as one, mocker("a1") as two, frontend(one, two) as fe:
        rows = {w["id"]: w for w in fe.get("/admin/workers").json()["workers"]}
        assert rows[1]["adapters"] == {"a1": MODEL, "a2": MODEL} and rows[2]["adapters"] == {"a1": MODEL}
        models = {m["id"]: m["parent"] for m in httpx.get(f"{one}/v1/models").json()["data"]}
        assert models == {MODEL: None, "a1": MODEL, "a2": MODEL}

        base = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 100}], "max_tokens": 2}
        out = chat(fe, base, **{"x-dynamo-worker-instance-id": "1"})
        full = out["usage"]["prompt_tokens"] // BS
        wait_until(lambda: overlap(fe, base, 1) == full, 30, what="base blocks indexed")

        a1 = {**base, "model": "a1"}
        assert overlap(fe, a1, 1) == 0  # the base model's blocks are not the adapter's
        first = chat(fe, a1, **{"x-dynamo-worker-instance-id": "1"})
        assert first["nvext"]["routing"]["lora_name"] == "a1"
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nor are they in the engine
        wait_until(lambda: overlap(fe, a1, 1) == full, 30, what="adapter blocks indexed")
        again = chat(fe, a1)
        record = again["nvext"]["routing"]
        assert (record["worker_id"], record["overlap_blocks"]) == (1, full)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert overlap(fe, {**base, "model": "a2"}, 1) == 0  # nor another adapter's

        for i in range(4):
            body = {"model": "a2", "messages": [{"role": "user", "content": f"only one has me {i}"}]}
            record = chat(fe, body)["nvext"]["routing"]
            assert [c["worker_id"] for c in record["candidates"]] == [1]
        assert fe.post("/v1/chat/completions", json={**base, "model": "a3"}).status_code == 404
        loads = fe.get("/loads").json()
        assert {row["model_name"] for row in loads} == {MODEL}  # adapters book on the base model's tracker
