"""Request migration (``--migration-limit``, Dynamo's name and semantics): a request whose worker
fails is sent again to another worker, carrying what was already generated, so the client sees one
uninterrupted response.

Two failure points, counted in ``dynamo_frontend_model_migration_total{model, migration_type}``:

- ``new_request``: the worker accepted the connection, then failed before its response head (or,
  for a non-streaming request, before its whole body): nothing reached the client, the same body is
  sent elsewhere.
- ``ongoing_request``: a stream broke (connection lost, or silent for ``--stream-idle-timeout``)
  after some events reached the client. The request continues on another worker from the text
  generated so far (:func:`continuation_body`), and its events are rewritten
  (:class:`SseTracker`) so the client sees the original id, one role chunk, one final usage and
  one ``[DONE]``.

Why text continuation rather than token ids: it works with any OpenAI-compatible engine (vLLM,
SGLang, the mocker) on both endpoints. Chat requests continue the generated text as a partial
assistant message (``continue_final_message``, vLLM's and the chat template's way of resuming a
turn); completions append it to the prompt (a token-id prompt gets the text's token ids). The router tokenizes the
continued body exactly as the
engine will, so the new booking and the prefix lookup are for the tokens the new worker computes
(the prompt plus the generated tokens, mostly cached where the prompt was). ``max_tokens`` (and
``min_tokens``) are reduced by the tokens already produced.

Each request may migrate ``--migration-limit`` times in all (both kinds). Not migrated: pinned
requests (a pin names one worker), ``n > 1`` (one continuation per choice would be needed), and a
request whose budget is spent (the client gets the error it would get without migration).
Only the first choice's ``content``/``text`` is carried over; reasoning or tool-call deltas are not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

NEW_REQUEST = "new_request"
ONGOING_REQUEST = "ongoing_request"

_DONE = b"[DONE]"


def migratable(body: dict[str, Any]) -> bool:
    """Whether the request's response can be continued elsewhere (one choice)."""
    n = body.get("n")
    return n is None or n == 1


def continuation_body(
    body: dict[str, Any], chat: bool, text: str, generated: int, encode: Callable[[str], list[int]] | None = None
) -> dict[str, Any] | None:
    """The request that continues ``body`` after ``text`` (``generated`` tokens) was produced.

    ``encode`` (text -> token ids, no special tokens) extends a token-id prompt; without it such a
    prompt cannot be continued (None)."""
    out = dict(body)
    if text:
        if chat:
            messages = list(out.get("messages") or [])
            messages.append({"role": "assistant", "content": text})
            out["messages"] = messages
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
        else:
            prompt = out.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one, as the tokenizer unwraps it
            if isinstance(prompt, str):
                out["prompt"] = prompt + text
            elif isinstance(prompt, list) and encode is not None:
                out["prompt"] = list(prompt) + encode(text)  # the engine continues the same text
            else:
                return None
    for key in ("max_tokens", "max_completion_tokens"):
        v = out.get(key)
        if type(v) is int:
            out[key] = max(1, v - generated)
    v = out.get("min_tokens")
    if type(v) is int and v > 0:
        out["min_tokens"] = max(0, v - generated)
    return out


class SseTracker:
    """Follows a migratable stream event by event.

    Only whole events are passed on (a partial event is held until its end arrives), so a stream
    that breaks mid-event leaves nothing half-written at the client. While following the first
    worker it records the response's identity and the generated text, passing events through
    unchanged; after a migration (:meth:`switch`) it rewrites the new worker's events to look like
    the same response: same id and created, no second role chunk, usage counted over both workers.
    """

    __slots__ = (
        "chat",
        "prompt_tokens",
        "id",
        "created",
        "text",
        "generated",
        "finished",
        "done",
        "continued",
        "_base_completion",
        "_buf",
    )

    def __init__(self, chat: bool, prompt_tokens: int) -> None:
        self.chat = chat
        self.prompt_tokens = prompt_tokens  # the original request's, for the final usage
        self.id: Any = None
        self.created: Any = None
        self.text: list[str] = []
        self.generated = 0  # output events with content seen (one per token from vLLM-style engines)
        self.finished = False  # a finish_reason was seen
        self.done = False  # data: [DONE] was seen
        self.continued = False
        self._base_completion = 0
        self._buf = b""

    def generated_text(self) -> str:
        return "".join(self.text)

    def switch(self) -> None:
        """The stream continues on another worker: drop any partial event, rewrite from now on."""
        self._buf = b""
        self.continued = True
        self._base_completion = self.generated

    def feed(self, data: bytes) -> bytes:
        """Whole events of ``data`` (plus what was held) to send on; the rest is held."""
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        whole = buf[: end + 2]
        if not self.continued:
            for ev in whole.split(b"\n\n"):
                if ev:
                    self._observe(ev)
            return whole
        out = []
        for ev in whole.split(b"\n\n"):
            if ev:
                ev = self._rewrite(ev)
                if ev:
                    out.append(ev + b"\n\n")
        return b"".join(out)

    def _payload(self, ev: bytes) -> Any:
        if not ev.startswith(b"data:"):
            return None
        raw = ev[5:].strip()
        if raw == _DONE:
            self.done = True
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None

    def _observe(self, ev: bytes) -> dict | None:
        obj = self._payload(ev)
        if not isinstance(obj, dict):
            return None
        if self.id is None and "id" in obj:
            self.id, self.created = obj.get("id"), obj.get("created")
        for c in obj.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            piece = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if isinstance(piece, str) and piece:
                self.text.append(piece)
                self.generated += 1
            if c.get("finish_reason"):
                self.finished = True
        return obj

    def _rewrite(self, ev: bytes) -> bytes:
        obj = self._observe(ev)
        if obj is None:
            return ev  # [DONE], comments, non-JSON: as they are
        if self.chat:
            for c in obj.get("choices") or ():
                delta = c.get("delta") if isinstance(c, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    if not delta.get("content") and not c.get("finish_reason") and len(delta) <= 2:
                        return b""  # the new worker's role chunk: the client already has one
                    del delta["role"]
        if self.id is not None:
            obj["id"] = self.id
            if self.created is not None:
                obj["created"] = self.created
        usage = obj.get("usage")
        if isinstance(usage, dict):
            done = self._base_completion + int(usage.get("completion_tokens") or 0)
            usage["completion_tokens"] = done
            usage["prompt_tokens"] = self.prompt_tokens
            usage["total_tokens"] = self.prompt_tokens + done
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], self.prompt_tokens)
        return b"data: " + orjson.dumps(obj)
