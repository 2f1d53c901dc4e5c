"""Pieces of the OpenAI HTTP surface shared by the frontend and the simulated engine.

Each keeps its own error *body* on purpose (the frontend answers like Dynamo's frontend, the mocker
like vLLM); the exception and the request-body parsing are the same.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from kvroute_common.http import ApiError, read_body


class OpenAIError(Exception):
    """A failure reported to an OpenAI client with ``status``, ``message`` and the offending ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
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
