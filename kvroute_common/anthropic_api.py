"""The Anthropic Messages API as the engine sees it: a Messages request is the chat request vLLM
renders it as, and Anthropic's error and usage shapes.

Shared by the frontend (to hash the tokens the engine will cache, and to answer errors in the shape
Anthropic clients parse) and the mocker (to answer like vLLM 0.32's ``/v1/messages``). The
conversion follows vLLM's: the ``system`` field (a string or text blocks; Claude Code's
``x-anthropic-billing-header`` block, whose per-request hash would defeat prefix caching, is
dropped) becomes the leading system message; text blocks become text parts (one part: a plain
string); ``tool_use`` blocks become the assistant's ``tool_calls`` (arguments as ``json.dumps`` of the
input); a user's ``tool_result`` blocks become ``tool`` messages ahead of the user's own; ``thinking``
blocks become the message's ``reasoning``; tools become OpenAI function tools (``tool_choice``
``auto`` when tools are given without one). Templates that require the system message first (they
fail on ``[system, user, system, user]``) get inline system messages merged into the leading one.
"""

from __future__ import annotations

import json
import re
import time
from functools import lru_cache
from typing import Any

import orjson

from kvroute_common.openai_api import OpenAIError

BILLING_HEADER = "x-anthropic-billing-header"
ROLES = ("user", "assistant", "system")

# Anthropic's error types per status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}``: what the ``anthropic`` SDK parses."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_event(status: int, message: str) -> bytes:
    """A stream's ``error`` event (a failure after the response started)."""
    return b"event: error\ndata: " + error_body(status, message) + b"\n\n"


# ---------------------------------------------------------------------------------------------
# request validation and conversion


def validate_request(body: dict[str, Any], require_max_tokens: bool = True) -> None:
    """The checks the engine's request model makes, answered before routing (OpenAIError 400).
    ``require_max_tokens``: False for count_tokens, whose request has none."""
    max_tokens = body.get("max_tokens")
    if (require_max_tokens or max_tokens is not None) and (type(max_tokens) is not int or max_tokens < 1):
        raise OpenAIError(400, "max_tokens: an integer >= 1 is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages: a non-empty list is required", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise OpenAIError(400, f"messages.{i}: an object with role user, assistant or system", "messages")
        _check_content(msg.get("content"), f"messages.{i}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_content(system, "system")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise OpenAIError(400, "tools: a list is required", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise OpenAIError(400, f"tools.{i}: an object with a name is required", "tools")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "none", "tool")):
        raise OpenAIError(400, "tool_choice: an object with type auto, any, none or tool", "tool_choice")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError(400, "stream: a boolean is required", "stream")


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in content
    ):
        raise OpenAIError(400, f"{where}: a string or a list of content blocks is required", where.split(".")[0])


def to_chat(body: dict[str, Any], merge_inline_system: bool = False) -> dict[str, Any]:
    """The chat request the engine renders for this Messages request (``body`` validated)."""
    messages: list[dict[str, Any]] = []
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif isinstance(system, list):
        parts += [t for b in system if b.get("type") == "text" and (t := _text(b)) and not t.startswith(BILLING_HEADER)]
    if merge_inline_system:
        for m in body["messages"]:
            text = _system_text(m["content"]) if m["role"] == "system" else None
            if text:
                parts.append(text)
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for msg in body["messages"]:
        role, content = msg["role"], msg["content"]
        if role == "system":
            text = None if merge_inline_system else _system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        out: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            out["content"] = content
        else:
            _convert_blocks(content, role, out, messages)
        if not (role == "user" and "content" not in out):
            messages.append(out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": body.get("max_tokens")}
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        named = {"auto": "auto", "any": "required", "none": "none"}.get(str(choice.get("type")))
        chat["tool_choice"] = named or {"type": "function", "function": {"name": choice.get("name")}}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_tool(t) for t in tools]
        chat.setdefault("tool_choice", "auto")
    return chat


def _text(block: dict[str, Any]) -> str:
    text = block.get("text")
    return text if isinstance(text, str) else ""


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = [t for b in content if b.get("type") == "text" and (t := _text(b)) and not t.startswith(BILLING_HEADER)]
    return "".join(texts) if texts else None


def _convert_blocks(blocks: list[dict[str, Any]], role: str, out: dict[str, Any], messages: list[dict]) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and _text(block):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, messages)
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if tool_calls:
        out["tool_calls"] = tool_calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _user_tool_result(block: dict[str, Any], messages: list[dict]) -> None:
    content = block.get("content")
    text, images, refs = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := _image_url(item.get("source") or {})):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    messages.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as the function tool the template receives (unset optional fields omitted)."""
    function: dict[str, Any] = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


@lru_cache(maxsize=16)
def requires_system_first(template: str | None) -> bool:
    """Whether a chat template fails on a system message after the first turn (then inline system
    messages are merged into the leading one, as the engine does). Rendered as the engine probes it:
    a plain sandboxed Jinja environment, ``[system, user, system, user]``."""
    if not template:
        return True
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def tokenizer_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------
# usage on the wire

_INPUT = re.compile(rb'"input_tokens"\s*:\s*(\d+)')
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d+)')
_CACHE_CREATION = re.compile(rb'"cache_creation_input_tokens"\s*:\s*(\d+)')
_OUTPUT = re.compile(rb'"output_tokens"\s*:\s*(\d+)')
USAGE_KEY = b'"input_tokens"'


def parse_usage(data: bytes) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from a Messages body or stream event: the prompt is
    ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``, the cached part the
    cache reads."""
    i = data.rfind(b'"usage"')
    if i < 0:
        return None, None
    tail = data[i:]
    inp, read, created = _INPUT.search(tail), _CACHE_READ.search(tail), _CACHE_CREATION.search(tail)
    if inp is None:
        return None, None
    cached = int(read.group(1)) if read else None
    prompt = int(inp.group(1)) + (cached or 0) + (int(created.group(1)) if created else 0)
    return prompt, cached


def output_tokens(body: bytes) -> int:
    m = _OUTPUT.search(body)
    return int(m.group(1)) if m else 0
