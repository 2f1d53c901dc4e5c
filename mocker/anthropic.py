"""The mocker's ``/v1/messages``: an Anthropic Messages request answered like vLLM 0.32 answers it.

vLLM renders the request as a chat request (``kvroute_common.anthropic_api.to_chat``), generates it
as one, and converts the chat answer: a body with ``content`` text blocks, ``stop_reason``
(``end_turn`` / ``max_tokens`` / ``stop_sequence``) and ``usage`` whose ``input_tokens`` excludes the
cached prompt tokens (``cache_read_input_tokens``); a stream of ``message_start``, one text block
(``content_block_start`` / ``_delta`` / ``_stop``), ``message_delta`` with the stop reason and the
usage, ``message_stop``. Errors use Anthropic's envelope.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from kvroute_common import anthropic_api


def chat_body(body: dict[str, Any], template: str | None) -> dict[str, Any]:
    """The chat request vLLM generates for a validated Messages request (sampling fields included)."""
    chat = anthropic_api.to_chat(body, anthropic_api.requires_system_first(template))
    for key in ("temperature", "top_p", "top_k", "priority"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def error(status: int, message: str) -> Response:
    return Response(anthropic_api.error_body(status, message), status_code=status, media_type="application/json")


def from_openai_error(answer: Response) -> Response:
    """A chat error answer (vLLM's OpenAI envelope) in Anthropic's envelope."""
    try:
        message = orjson.loads(bytes(answer.body))["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = "request failed"
    return error(answer.status_code, message)


def _stop(finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage.get("completion_tokens") or 0}
    if cached is not None:
        out["input_tokens"] = max(0, usage["prompt_tokens"] - cached)
        out["cache_read_input_tokens"] = cached
    return out


def message(done: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body as an Anthropic message."""
    choice = done["choices"][0]
    reason, sequence = _stop(choice["finish_reason"], choice.get("stop_reason"))
    text = choice["message"]["content"] or ""
    return {
        "id": done["id"],
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}] if text else [],
        "model": done["model"],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done.get("usage")),
    }


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def stream(chunks: AsyncIterable[bytes | str | memoryview]) -> AsyncIterator[bytes]:
    """A chat completion stream (with its usage chunk) as Anthropic events."""
    started = in_block = False
    finish: str | None = None
    stop_reason: Any = None
    buf = b""
    async for raw in chunks:
        buf += raw.encode() if isinstance(raw, str) else bytes(raw)
        *events, buf = buf.split(b"\n\n")
        out = bytearray()
        for ev in events:
            if not ev.startswith(b"data: "):
                continue
            data = ev[6:]
            if data == b"[DONE]":
                out += _event("message_stop", {"type": "message_stop"})
                continue
            chunk = orjson.loads(data)
            if not started:
                started = True
                message_start = {
                    "id": chunk["id"],
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": chunk["model"],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": _usage(chunk.get("usage")),
                }
                out += _event("message_start", {"type": "message_start", "message": message_start})
                continue
            if not chunk["choices"]:  # the usage chunk: the end of the message
                if in_block:
                    out += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    in_block = False
                reason, sequence = _stop(finish, stop_reason)
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                out += _event(
                    "message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(chunk["usage"])}
                )
                continue
            choice = chunk["choices"][0]
            text = choice.get("delta", {}).get("content")
            if text:
                if not in_block:
                    in_block = True
                    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    out += _event("content_block_start", block)
                delta = {"type": "text_delta", "text": text}
                out += _event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
            if choice.get("finish_reason") is not None:
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
        if out:
            yield bytes(out)


def streaming(answer: StreamingResponse) -> StreamingResponse:
    return StreamingResponse(
        stream(answer.body_iterator), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
