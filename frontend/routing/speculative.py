"""Speculative prefill (``nvext.agent_hints.speculative_prefill``): warm the next turn's KV cache.

After a turn that asked for it finishes, the next request of an agentic conversation will very
likely start with this turn's prompt + the assistant's reply. We build that prompt and send it as
a ``max_tokens=1`` request to the worker that served the turn (it already holds the prefix), in
the background, so the real next turn finds its whole history cached.

Bounded so it never delays real traffic: at most ``max_in_flight`` warm-ups at once (more are
dropped, not queued), none to a worker the frontend reports busy, none for failed/cancelled
turns, and a warm-up's failure is only counted.

The frontend supplies ``send(body, worker_id, dp_rank) -> Awaitable`` that dispatches a request
body to that worker through its normal lifecycle (book, stream/complete, free).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

log = logging.getLogger(__name__)

SendFn = Callable[[dict, int, "int | None"], Awaitable[Any]]
BusyFn = Callable[[int, "int | None"], bool]

# Reasoning blocks are dropped from a turn once it is no longer the last one (chat templates such
# as Qwen3's do the same), so the warmed prefix matches what the next request renders.
_THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)

# Request fields that do not belong in a 1-token warm-up.
_DROP_FIELDS = (
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "response_format",
    "stop",
    "nvext",
)


def strip_thinking(text: str) -> str:
    """The reply without ``<think>...</think>`` blocks (also an unterminated trailing one)."""
    if "<think>" not in text:
        return text
    text = _THINK_RE.sub("", text)
    cut = text.find("<think>")
    return text[:cut] if cut >= 0 else text


def next_turn_body(request_body: dict, assistant_text: str) -> dict | None:
    """The warm-up request for the next turn: this turn's prompt + the reply, ``max_tokens=1``.

    Chat: ``messages + [{"role": "assistant", "content": reply}]`` (the worker renders it with the
    same template the next turn will use: every full block before the next user message matches).
    Completions: ``prompt + reply`` for a text prompt; token-id prompts are not extended (the
    reply's token ids are not known here). Returns None when no warm-up can be built.
    """
    reply = strip_thinking(assistant_text or "")
    body = {k: v for k, v in request_body.items() if k not in _DROP_FIELDS}
    messages = request_body.get("messages")
    if isinstance(messages, list):
        history = []
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "assistant":
                m = dict(m)
                m.pop("reasoning_content", None)
                m.pop("reasoning", None)
                if isinstance(m.get("content"), str):
                    m["content"] = strip_thinking(m["content"])
            history.append(m)
        history.append({"role": "assistant", "content": reply})
        body["messages"] = history
    else:
        prompt = request_body.get("prompt")
        if not isinstance(prompt, str):
            return None
        body["prompt"] = prompt + reply
    body["max_tokens"] = 1
    body["stream"] = False
    return body


class TurnTextCollector:
    """Accumulates the assistant's text from a streamed (SSE) or a complete JSON response.

    Only used for requests that asked for speculative prefill, so the common path never parses
    the stream. Feed raw bytes as they pass through; partial lines are buffered."""

    __slots__ = ("_parts", "_buf", "finished")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._buf = b""
        self.finished = False  # a finish_reason was seen

    def feed_sse(self, chunk: bytes) -> None:
        data = self._buf + chunk
        lines = data.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        self._choices(obj, delta=True)

    def feed_json(self, body: bytes | dict) -> None:
        obj = orjson.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
        self._choices(obj, delta=False)

    def _choices(self, obj: Any, delta: bool) -> None:
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not choices:
            return
        c = choices[0]
        if not isinstance(c, dict) or c.get("index", 0) != 0:
            return
        part = None
        if "text" in c:
            part = c.get("text")
        else:
            msg = c.get("delta" if delta else "message")
            if isinstance(msg, dict):
                part = msg.get("content")
        if isinstance(part, str) and part:
            self._parts.append(part)
        if c.get("finish_reason"):
            self.finished = True

    def text(self) -> str:
        if self._buf:
            self._line(self._buf)
            self._buf = b""
        return "".join(self._parts)


class SpeculativePrefiller:
    """Bounded fire-and-forget scheduler for next-turn warm-ups."""

    def __init__(self, send: SendFn, *, max_in_flight: int = 4, is_busy: BusyFn | None = None) -> None:
        self._send = send
        self._is_busy = is_busy
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task] = set()
        self.scheduled = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def on_turn_finished(self, request_body: dict, assistant_text: str, worker_id: int, dp_rank: int | None) -> bool:
        """Call after a successful turn with ``speculative_prefill: true`` (not on errors/cancels).

        ``request_body`` is the turn's body as sent to the worker (nvext already removed). Returns
        True when a warm-up was started. Never raises; never blocks."""
        if len(self._tasks) >= self.max_in_flight:
            self.dropped += 1
            return False
        if self._is_busy is not None:
            try:
                if self._is_busy(worker_id, dp_rank):
                    self.dropped += 1
                    return False
            except Exception:  # a broken probe must not break the request path
                log.exception("speculative prefill busy check failed")
                self.dropped += 1
                return False
        body = next_turn_body(request_body, assistant_text)
        if body is None:
            self.dropped += 1
            return False
        task = asyncio.get_running_loop().create_task(self._run(body, worker_id, dp_rank))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.scheduled += 1
        return True

    async def _run(self, body: dict, worker_id: int, dp_rank: int | None) -> None:
        try:
            await self._send(body, worker_id, dp_rank)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed += 1
            log.debug("speculative prefill to worker %s rank %s failed: %r", worker_id, dp_rank, exc)
        else:
            self.completed += 1

    async def wait_idle(self) -> None:
        """Wait for the warm-ups in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel warm-ups in flight (shutdown)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight,
            "scheduled": self.scheduled,
            "completed": self.completed,
            "failed": self.failed,
            "dropped": self.dropped,
        }
