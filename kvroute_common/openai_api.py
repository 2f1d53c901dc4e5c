"""Pieces of the OpenAI HTTP surface shared by the frontend and the simulated engine.

Each keeps its own error *body* on purpose (the frontend answers like Dynamo's frontend, the mocker
like vLLM); the exception and the request-body parsing are the same.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from kvroute_common.errors import ServiceError
from kvroute_common.http import ApiError, read_body


class OpenAIError(ServiceError):
    """A failure reported to an OpenAI client with ``status``, ``message`` and the offending ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


async def read_openai_body(request: Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """The raw request body and its JSON object: 413 over ``limit``, 400 if not a JSON object.

    The raw bytes are returned too so a proxy can forward them unchanged.
    """
    try:
        raw = await read_body(request, limit)
    except ApiError as exc:
        raise OpenAIError(exc.status, exc.message) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return raw, body


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Responses request as the chat request it is tokenized like (vLLM renders it the
    same way): ``instructions`` becomes a system message, ``input`` (a string, or message items
    whose content is a string or ``input_text`` / ``output_text`` parts) the conversation.

    Raises OpenAIError 400 for input the conversion does not understand. Shared by the frontend
    (to hash what the engine will cache) and the mocker (to answer), so both see the same tokens.
    """
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError(400, "'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            if isinstance(item, str):
                messages.append({"role": "user", "content": item})
                continue
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise OpenAIError(400, f"input[{i}]: only message items are supported", "input")
            role = item.get("role")
            if not isinstance(role, str) or not role:
                raise OpenAIError(400, f"input[{i}].role is required", "input")
            content = item.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if (
                        not isinstance(part, dict)
                        or part.get("type") not in ("input_text", "output_text", "text")
                        or not isinstance(part.get("text"), str)
                    ):
                        raise OpenAIError(400, f"input[{i}].content[{j}]: only text parts are supported", "input")
                    texts.append(part["text"])
                content = "\n".join(texts)
            elif not isinstance(content, str):
                raise OpenAIError(400, f"input[{i}].content must be a string or a list of text parts", "input")
            messages.append({"role": role, "content": content})
    else:
        raise OpenAIError(400, "'input' must be a non-empty string or list", "input")
    chat: dict[str, Any] = {"messages": messages}
    if "chat_template_kwargs" in body:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
