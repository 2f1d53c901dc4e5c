"""OpenAI-shaped errors for the ``/v1/*`` routes (Anthropic-shaped under ``/v1/messages``).

The body carries both shapes clients look for: OpenAI's nested ``{"error": {"message", "type",
"param", "code"}}`` (what the ``openai`` SDK reads) and the reference frontend's flat ``message`` /
``type`` / ``code`` fields (what Dynamo clients read). The type is the HTTP reason phrase, or
``Overloaded`` for 529, as in the reference.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response

from kvroute_common import anthropic_api
from kvroute_common.openai_api import OpenAIError

__all__ = [
    "OpenAIError",
    "RequestShapeError",
    "UNKNOWN_MODEL",
    "as_anthropic",
    "openai_error_body",
    "openai_error_response",
    "model_not_found",
    "no_worker",
    "all_busy",
    "openai_exception_handlers",
]

OVERLOAD_STATUS = 529
UNKNOWN_MODEL = "unknown_model"
"""The ``model`` label of a request for a model nobody serves (the client's string is not a label value)."""


class RequestShapeError(OpenAIError):
    """A body that is not a request of its kind: a field of the wrong JSON type, a required one missing,
    an unknown role. Such a request does not deserialize into the API's request type, so it never
    enters the request metrics; a well-formed request with a value out of range does (``validation``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param)


# error_type label of dynamo_frontend_requests_total per status
_ERROR_TYPES = {
    400: "validation",
    404: "not_found",
    413: "validation",
    415: "validation",
    422: "validation",
    429: "rate_limited",
    499: "cancelled",
    501: "not_implemented",
    503: "unavailable",
    504: "response_timeout",
    529: "overload",
}


def reason_phrase(status: int) -> str:
    if status == OVERLOAD_STATUS:
        return "Overloaded"
    if status == 499:
        return "Client Closed Request"
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def error_type_label(status: int) -> str:
    return _ERROR_TYPES.get(status, "internal" if status >= 500 else "validation")


def openai_error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = reason_phrase(status)
    return orjson.dumps(
        {
            "error": {"message": message, "type": kind, "param": param, "code": status},
            "message": message,
            "type": kind,
            "code": status,
        }
    )


def openai_error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        openai_error_body(status, message, param), status_code=status, media_type="application/json", headers=headers
    )


def as_anthropic(response: Any) -> Any:
    """An OpenAI-shaped error answer in Anthropic's shape (other answers unchanged): the pipeline is
    shared, the error shape is the API's."""
    if not isinstance(response, Response) or response.status_code < 400 or not response.body:
        return response  # an answer passed through (JSON or a stream) or an empty 499
    try:
        body = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return response
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str):
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str):
        return response
    headers = {k: v for k, v in response.headers.items() if k in ("retry-after", "allow")}
    return Response(
        anthropic_api.error_body(response.status_code, message),
        status_code=response.status_code,
        media_type="application/json",
        headers=headers or None,
    )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"Model not found: {model}", "model")


def no_worker(model: str) -> OpenAIError:
    return OpenAIError(503, f"No worker available for model {model}")


def all_busy(model: str) -> OpenAIError:
    return OpenAIError(OVERLOAD_STATUS, f"All eligible workers are busy for model {model}; retry later")


def openai_exception_handlers(base: dict[Any, Any]) -> dict[Any, Any]:
    """``base`` (the services' ``{"error": "..."}`` handlers) for every path but ``/v1/*``, where
    framework errors (unknown path 404, wrong method 405, bad request 400, bugs 500) take the
    OpenAI shape clients parse."""
    from starlette.exceptions import HTTPException

    from kvroute_common.http import ApiError

    def wrap(handler: Any) -> Any:
        async def handle(request: Any, exc: Exception) -> Response:
            path = request.url.path
            if not (path == "/v1" or path.startswith("/v1/")):
                return await handler(request, exc)
            headers = None
            if isinstance(exc, HTTPException):
                status = exc.status_code
                if status == 404:
                    message = f"Route not found: {request.method} {path}"
                elif status == 405:
                    message = f"Method {request.method} not allowed on {path}"
                    headers = dict(exc.headers or {})
                else:
                    message = str(exc.detail)
            elif isinstance(exc, ApiError):
                status, message = exc.status, exc.message
            else:
                status, message = 500, f"internal error: {type(exc).__name__}: {exc}"
            resp = openai_error_response(status, message)
            if headers:
                resp.headers.update(headers)
            return as_anthropic(resp) if path.startswith("/v1/messages") else resp

        return handle

    return {key: wrap(h) for key, h in base.items()}
