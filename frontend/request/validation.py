"""Request validation before routing: the checks vLLM makes, with its ranges and messages.

Why here: a request the engine will refuse should not be tokenized into the router's load, booked,
and sent; and the client gets one clear 400 whatever engine is behind the frontend. The ranges and
messages follow vLLM's ``SamplingParams._verify_args`` and its OpenAI protocol validators
(``validate_stream_options``, ``check_logprobs``, the context-length check).

Deliberately not vLLM's: vLLM accepts any role string (its custom-role message type); the frontend
accepts OpenAI's roles (plus ``ipython``, used by Llama 3 tool templates) and refuses others, since
an unknown role is almost always a client bug that the chat template would drop or mangle.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from frontend.request.errors import OpenAIError, RequestShapeError
from kvroute_common.tokenizer import PromptError, engine_tool_dicts

_SAMPLING_EPS = 1e-5
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
# roles whose content may be null (assistant turns that only call tools, legacy function results)
_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})


def _bad(message: str, param: str) -> OpenAIError:
    """A value the request type allows but the engine refuses."""
    return OpenAIError(400, message, param)


def _shape(message: str, param: str) -> RequestShapeError:
    """A field of a type the request type does not allow."""
    return RequestShapeError(message, param)


def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _shape(f"{name} must be a number, got {type(v).__name__}.", name)
    if not math.isfinite(v):
        raise _bad(f"{name} must be a finite number, got {v}.", name)
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _shape(f"{name} must be an integer, got {type(v).__name__}.", name)
    return v


def validate_sampling(body: dict, chat: bool) -> None:
    """vLLM's sampling-parameter checks (ranges and messages); raises OpenAIError 400."""
    n = _integer(body, "n")
    if n is not None and n < 1:
        raise _bad(f"n must be at least 1, got {n}.", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {body[name]}.", name)
    rp = _number(body, "repetition_penalty")
    if rp is not None and rp <= 0.0:
        raise _bad(
            f"repetition_penalty must be greater than zero, got {body['repetition_penalty']}.", "repetition_penalty"
        )
    temperature = _number(body, "temperature")
    if temperature is not None:
        if temperature < 0.0:
            raise _bad(f"temperature must be non-negative, got {body['temperature']}.", "temperature")
        if temperature > 2.0:
            raise _bad(f"temperature must be in [0, 2], got {body['temperature']}.", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {body['top_p']}.", "top_p")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise _bad(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = _number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {body['min_p']}.", "min_p")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        v = _integer(body, name)
        if v is not None and v < 1:
            raise _bad(f"max_tokens must be at least 1, got {v}.", name)
        if max_tokens is None:
            max_tokens = v
    min_tokens = _integer(body, "min_tokens")
    if min_tokens is not None:
        if min_tokens < 0:
            raise _bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise _bad(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.", "min_tokens"
            )
    _integer(body, "seed")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _shape("stop must be a string or a list of strings.", "stop")
        if any(not s for s in stops):
            raise _bad("stop cannot contain an empty string.", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None and (
        not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids)
    ):
        raise _bad(f"stop_token_ids must contain only integers, got {ids}.", "stop_token_ids")
    if temperature is not None and temperature < _SAMPLING_EPS and n is not None and n > 1:
        raise _bad(f"n must be 1 when using greedy sampling, got {n}.", "n")
    stream = body.get("stream")
    if body.get("stream_options") and not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    prompt_logprobs = _integer(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        if stream and prompt_logprobs > 0:
            raise _bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise _bad("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    if chat:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _shape("logprobs must be a boolean.", "logprobs")
        top = _integer(body, "top_logprobs")
        if top is not None:
            if top < 0 and top != -1:
                raise _bad("`top_logprobs` must be a positive value.", "top_logprobs")
            if top > 0 and not logprobs:
                raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    else:
        logprobs = _integer(body, "logprobs")
        if logprobs is not None and logprobs < 0 and logprobs != -1:
            raise _bad("`logprobs` must be a positive value.", "logprobs")


def validate_tools(body: dict) -> None:
    """vLLM's chat request model refuses an empty ``tools`` list (as OpenAI does) and tools that are not
    function tools with a name; raises OpenAIError 400. (Anthropic requests may carry an empty list:
    vLLM converts them past that check.)"""
    tools = body.get("tools")
    if tools == []:
        raise _bad(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    if tools is not None:
        try:
            engine_tool_dicts(tools)  # the shape checks, with the parameter named
        except PromptError as exc:
            raise _shape(str(exc), "tools") from None


def validate_messages(messages: Any) -> None:
    """Chat messages: a non-empty list of objects with a known role; content null only where OpenAI allows it."""
    if not isinstance(messages, list):
        raise _shape("'messages' must be a non-empty list", "messages")
    if not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _shape(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _shape(f"messages[{i}].role is required", "messages")
        if role not in ROLES:
            raise _shape(f"messages[{i}].role {role!r} is not one of {', '.join(sorted(ROLES))}", "messages")
        content = m.get("content")
        if content is None and role not in _NULL_CONTENT_ROLES:
            raise _shape(f"messages[{i}].content must not be null for role {role!r}", "messages")


class PromptLimit(NamedTuple):
    """What one engine takes: its context length and the tokens its KV cache holds (None: unknown)."""

    context: int | None
    kv_tokens: int | None

    @property
    def tokens(self) -> int | None:
        """A prompt of this many tokens or more is refused (None: no known bound)."""
        known = [n for n in (self.context, self.kv_tokens) if n]
        return min(known) if known else None


def check_prompt_fits(n_prompt: int, body: dict, limit: PromptLimit | None, chat: bool, exact: bool = True) -> None:
    """The engine's own refusals (its messages), before routing: no hashing or booking for a request no
    engine takes. The context length is checked as vLLM checks it; a prompt over the KV capacity gets
    the engine's capacity message (vLLM keeps one block aside, as the mocker does). ``exact=False``:
    ``n_prompt`` is a lower bound (counting stopped once the answer was known)."""
    if limit is None:
        return
    check_context_length(n_prompt, body, limit.context, chat, exact)
    if limit.kv_tokens and n_prompt >= limit.kv_tokens:
        raise _bad(
            f"the prompt has {'' if exact else 'at least '}{n_prompt} tokens but the KV cache holds only "
            f"{limit.kv_tokens} tokens",
            "messages" if chat else "prompt",
        )


def check_context_length(n_prompt: int, body: dict, max_model_len: int | None, chat: bool, exact: bool = True) -> None:
    """vLLM's context-length check (same messages), before routing: no booking for a request the engine refuses."""
    if not max_model_len:
        return
    if n_prompt >= max_model_len:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{'' if exact else 'at least '}{n_prompt} input tokens. Please reduce the length of the input messages.",
            "messages" if chat else "prompt",
        )
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and n_prompt + max_tokens > max_model_len:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens",
        )
