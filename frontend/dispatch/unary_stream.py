"""Non-streaming requests are streamed from the engine and reassembled into the normal body.

Why: prefill is complete at the engine's first token. A non-streaming answer arrives only when the
whole generation is done, so its prompt would stay booked as prefill load for the whole decode (load
over-counted, TTFT metric = end-to-end). Asking the engine for a stream (with
``stream_options.include_usage``) shows the first token when it happens; the client still gets one
OpenAI body, built here from the chunks: text, reasoning text, tool calls (merged by index),
logprobs, finish and stop reasons per choice, and the engine's usage (``prompt_tokens_details``
included).

Requests whose non-streaming answer carries something a stream cannot (``prompt_logprobs``,
``echo``, ``best_of``, beam search, ``kv_transfer_params``) are sent as they are (``convertible``).
"""

from __future__ import annotations

from typing import Any

import orjson

_NOT_CONVERTIBLE = ("prompt_logprobs", "echo", "best_of", "use_beam_search", "kv_transfer_params")


def convertible(body: dict) -> bool:
    """Whether a non-streaming request can be streamed from the engine and reassembled exactly."""
    for key in _NOT_CONVERTIBLE:
        if body.get(key) not in (None, False):
            return False
    return True


_STREAM_FIELDS = b',"stream":true,"stream_options":{"include_usage":true}}'


def streaming_body(body: dict, raw: bytes | None = None) -> bytes:
    """The body sent to the engine: the same request, streamed, with usage at the end.

    ``raw``: the JSON sent otherwise, which wins over ``body`` (its prompt may be token ids where
    ``body`` has text: ``--send-token-ids``). When ``body`` has neither field, they are appended to
    those bytes instead of serialising the whole body again: a long prompt's body is copied once on
    the event loop, not re-encoded (orjson, ~0.5 ms per MB)."""
    if raw is not None and body and "stream" not in body and "stream_options" not in body:
        end = raw.rstrip()
        if end.endswith(b"}"):
            return b"".join((memoryview(end)[:-1], _STREAM_FIELDS))
    out = orjson.loads(raw) if raw is not None else dict(body)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return orjson.dumps(out)


class _Choice:
    __slots__ = (
        "index",
        "role",
        "content",
        "reasoning",
        "reasoning_key",
        "tool_calls",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "has_stop_reason",
        "text",
        "extra",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning_content"
        self.tool_calls: dict[int, dict] = {}
        self.logprobs: dict[str, list] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.has_stop_reason = False
        self.text: list[str] = []


class UnaryAssembler:
    """Feed SSE bytes as they arrive; ``first_token`` turns true at the first generated output;
    ``body()`` is the OpenAI non-streaming answer; ``error`` is an error event, if the engine sent one."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._buf = b""
        self.meta: dict[str, Any] = {}
        self.choices: dict[int, _Choice] = {}
        self.usage: Any = None
        self.error: dict | None = None
        self.first_token = False
        self.done = False

    def feed(self, data: bytes) -> int:
        """Consume bytes; returns how many events carried generated output (token events)."""
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return 0
        self._buf = buf[end + 2 :]
        n = 0
        for event in buf[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict) and self._apply(obj):
                    n += 1
        if n:
            self.first_token = True
        return n

    def _apply(self, obj: dict) -> bool:
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            return False
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in obj and key not in self.meta:
                self.meta[key] = obj[key]
        if obj.get("usage"):
            self.usage = obj["usage"]
        produced = False
        for c in obj.get("choices") or []:
            if not isinstance(c, dict):
                continue
            idx = c.get("index", 0)
            ch = self.choices.get(idx)
            if ch is None:
                ch = self.choices[idx] = _Choice(idx)
            if self.chat:
                produced |= self._apply_delta(ch, c.get("delta") or {})
            else:
                text = c.get("text")
                if text:
                    ch.text.append(text)
                    produced = True
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                merged = ch.logprobs if ch.logprobs is not None else {}
                for k, v in lp.items():
                    if isinstance(v, list):
                        merged.setdefault(k, []).extend(v)
                ch.logprobs = merged
            if c.get("finish_reason") is not None:
                ch.finish_reason = c["finish_reason"]
                produced = True
            if "stop_reason" in c:
                ch.has_stop_reason = True
                if c["stop_reason"] is not None:
                    ch.stop_reason = c["stop_reason"]
        return produced

    @staticmethod
    def _apply_delta(ch: _Choice, delta: dict) -> bool:
        produced = False
        if delta.get("role"):
            ch.role = delta["role"]
        content = delta.get("content")
        if content:
            ch.content.append(content)
            produced = True
        for key in ("reasoning_content", "reasoning"):
            r = delta.get(key)
            if r:
                ch.reasoning.append(r)
                ch.reasoning_key = key
                produced = True
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            produced = True
            i = tc.get("index", len(ch.tool_calls))
            cur = ch.tool_calls.get(i)
            fn = tc.get("function") or {}
            if cur is None:
                cur = ch.tool_calls[i] = {
                    "id": tc.get("id"),
                    "type": tc.get("type") or "function",
                    "function": {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
                }
            else:
                if tc.get("id") and not cur["id"]:
                    cur["id"] = tc["id"]
                if fn.get("name") and not cur["function"]["name"]:
                    cur["function"]["name"] = fn["name"]
                if fn.get("arguments"):
                    cur["function"]["arguments"] += fn["arguments"]
        return produced

    def body(self) -> bytes:
        choices = []
        for idx in sorted(self.choices):
            ch = self.choices[idx]
            if self.chat:
                tool_calls = [ch.tool_calls[i] for i in sorted(ch.tool_calls)]
                message: dict[str, Any] = {
                    "role": ch.role,
                    "content": "".join(ch.content) if (ch.content or not tool_calls) else None,
                    "tool_calls": tool_calls,
                }
                if ch.reasoning:
                    message[ch.reasoning_key] = "".join(ch.reasoning)
                out: dict[str, Any] = {
                    "index": idx,
                    "message": message,
                    "logprobs": ch.logprobs,
                    "finish_reason": ch.finish_reason,
                }
            else:
                out = {
                    "index": idx,
                    "text": "".join(ch.text),
                    "logprobs": ch.logprobs,
                    "finish_reason": ch.finish_reason,
                }
            if ch.has_stop_reason:
                out["stop_reason"] = ch.stop_reason
            choices.append(out)
        obj: dict[str, Any] = {
            "id": self.meta.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.meta.get("created"),
            "model": self.meta.get("model"),
            "choices": choices,
        }
        if "system_fingerprint" in self.meta:
            obj["system_fingerprint"] = self.meta["system_fingerprint"]
        obj["usage"] = self.usage
        return orjson.dumps(obj)

    @property
    def completion_tokens(self) -> int | None:
        u = self.usage
        if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
            return u["completion_tokens"]
        return None
