"""Anthropic's Messages API through the frontend, with the ``anthropic`` SDK, against mockers that
answer ``/v1/messages`` as vLLM does: tokenized as the engine renders it (so the overlap the router
finds is the engine's cache read), routed by KV overlap, streamed and not, counted, and refused in
Anthropic's error shape. The same against real vLLM is in tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from kvroute_common import anthropic_api
from support import frontend_client, mocker_url, wait_until

MODEL = "claude-local"
BS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(mocker_url(MODEL, "--max-model-len", "4096", block_size=BS)) for _ in range(2)]
        fe = stack.enter_context(frontend_client(urls))
        base = str(fe.base_url).rstrip("/")
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        yield {"url": base, "fe": fe, "client": client, "workers": urls}


ROUTING = {"nvext": {"extra_fields": ["routing"]}}

CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "List the files of the repository and summarise what the router does. " * 4},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "I will look at the files."},
            {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "router/ frontend/ indexer/ README.md"},
            {"type": "text", "text": "Now read the router."},
        ],
    },
]
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=4f2a;"},
    {"type": "text", "text": "You are a coding agent working in a repository. " * 6},
]
TOOLS = [{"name": "ls", "description": "list a directory", "input_schema": {"type": "object"}}]


def _create(client: anthropic.Anthropic, **kwargs: Any) -> tuple[anthropic.types.Message, dict[str, Any]]:
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, extra_body=ROUTING, **kwargs)
    return raw.parse(), raw.http_response.json()


def _prompt_tokens(usage: Any) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_a_conversation_is_tokenized_as_the_engine_renders_it_and_routed_to_its_cache(cluster) -> None:
    """Each turn's prompt tokens equal the engine's, its next turn goes to the worker holding it, and the
    overlap the router found is the engine's cache read (whole blocks of the prompt)."""
    client, fe = cluster["client"], cluster["fe"]
    messages = list(CONVERSATION)
    message, body = _create(client, system=SYSTEM, tools=TOOLS, messages=messages)
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "text"
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS, messages=messages).input_tokens
    assert _prompt_tokens(message.usage) == count == body["nvext"]["routing"]["isl"]
    engine_count = httpx.post(
        f"{cluster['workers'][0]}/v1/messages/count_tokens",
        json={"model": MODEL, "system": SYSTEM, "tools": TOOLS, "messages": messages},
    ).json()["input_tokens"]
    assert engine_count == count
    worker = body["nvext"]["routing"]["worker_id"]

    for turn in range(3):
        messages += [
            {"role": "assistant", "content": message.content[0].text or "ok"},
            {"role": "user", "content": f"turn {turn}: go on " * 8},
        ]
        previous = {"system": SYSTEM, "tools": TOOLS, "messages": messages[:-2]}
        wait_until(lambda p=previous, n=count: _overlap(fe, worker, p) == n // BS, 30, what="the previous turn indexed")
        message, body = _create(client, system=SYSTEM, tools=TOOLS, messages=messages)
        record = body["nvext"]["routing"]
        assert record["worker_id"] == worker, record
        cached = message.usage.cache_read_input_tokens
        assert cached is not None and cached > 0
        assert record["overlap_blocks"] * BS == cached, (record, message.usage)
        count = _prompt_tokens(message.usage)


def test_streams_carry_the_text_and_the_cache_read(cluster) -> None:
    client = cluster["client"]
    messages = [{"role": "user", "content": "stream me a story about caches " * 10}]
    first = client.messages.create(model=MODEL, max_tokens=6, messages=messages)
    full = _prompt_tokens(first.usage) // BS
    wait_until(lambda: _overlap(cluster["fe"], None, {"messages": messages}) == full, 30, what="the prompt indexed")
    with client.messages.stream(model=MODEL, max_tokens=6, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text") and text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0
    assert _prompt_tokens(final.usage) == _prompt_tokens(first.usage)
    assert final.usage.cache_read_input_tokens == full * BS


def _overlap(fe: httpx.Client, worker: int | None, request: dict[str, Any]) -> int:
    """The overlap (blocks) the router finds now for a Messages request on ``worker`` (None: the best)."""
    from kvroute_common.tokenizer import load_tokenizer

    merge = anthropic_api.requires_system_first(anthropic_api.tokenizer_template(load_tokenizer()))
    chat = anthropic_api.to_chat({"model": MODEL, "max_tokens": 1, **request}, merge)
    candidates = fe.post("/admin/route", json=chat).json()["candidates"]
    return max(c["overlap_blocks"] for c in candidates if worker is None or c["worker_id"] == worker)


def test_errors_take_anthropics_shape(cluster) -> None:
    client, url = cluster["client"], cluster["url"]
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"] == {"type": "invalid_request_error", "message": "max_tokens: an integer >= 1 is required"}
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 5000}])
    assert "context length" in str(too_long.value)
    for bad in (
        {"model": MODEL, "max_tokens": 4, "messages": []},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 7}]},
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": "ls"},
    ):
        r = httpx.post(f"{url}/v1/messages", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)
    r = httpx.get(f"{url}/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "nope", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # accounting: nothing left booked after the refusals
    loads = cluster["fe"].get("/loads").json()
    assert all(row["active_decode_blocks"] == 0 and row["active_prefill_tokens"] == 0 for row in loads), loads


def test_messages_are_counted_under_their_own_endpoint(cluster) -> None:
    """A success and a failure on /v1/messages, sent here (the test does not lean on the tests before it),
    are counted under ``endpoint="messages"`` with their status. The failure is a prompt over the
    context: refused once it is tokenized (a body refused by validation before that is not counted)."""
    url = cluster["url"]
    user = {"role": "user", "content": "hi"}
    ok = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [user]})
    assert ok.status_code == 200, ok.text
    too_long = {"role": "user", "content": "word " * 6000}  # --max-model-len 4096
    bad = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [too_long]})
    assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
    text = cluster["fe"].get("/metrics").text
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("dynamo_frontend_requests_total{") and 'endpoint="messages"' in ln
    ]
    assert any('status="success"' in ln for ln in lines), lines
    assert any('status="error"' in ln for ln in lines), lines


def test_inline_system_messages_follow_the_template() -> None:
    """A template that takes a system message anywhere keeps inline ones in place; one that fails on a
    late system message gets them merged into the leading system message (as the engine does)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "system": "lead",
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": "b"},
        ],
    }
    kept = anthropic_api.to_chat(body, merge_inline_system=False)["messages"]
    assert [m["role"] for m in kept] == ["system", "user", "system", "user"]
    merged = anthropic_api.to_chat(body, merge_inline_system=True)["messages"]
    assert merged[0] == {"role": "system", "content": "leadreminder"} and len(merged) == 3
    strict = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise(1) }}{% endif %}{% endfor %}"
    )
    assert anthropic_api.requires_system_first(strict)
    assert not anthropic_api.requires_system_first("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert anthropic_api.requires_system_first(None)
