"""HTTP plumbing shared by the standalone services and the frontend's service routes.

Every failure becomes ``{"error": "..."}`` with the status the reference services use:
malformed JSON 400, wrong types or missing fields 422, wrong content type 415, body over the
route's limit 413, unknown route 404, wrong method 405 (with ``allow``).

Request bodies are decoded straight into msgspec Structs: one pass that both parses and
validates, which keeps the hot handlers cheap.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import msgspec
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvroute_common.errors import ServiceError

T = TypeVar("T")

MiB = 1024 * 1024
DEFAULT_BODY_LIMIT = 2 * MiB

_OK_BODY = b'{"status":"ok"}'
_JSON = "application/json"


class ApiError(ServiceError):
    """An error a handler reports to its client as ``{"error": message}`` with ``status``."""


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type=_JSON)


def raw_json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type=_JSON)


def ok(status: int = 200) -> Response:
    """The services' ``{"status":"ok"}`` answer."""
    return Response(_OK_BODY, status_code=status, media_type=_JSON)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type=_JSON, headers=headers)


def _is_json_content_type(value: str | None) -> bool:
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    return mime == _JSON or (mime.startswith("application/") and mime.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without buffering it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise ApiError(413, "Failed to buffer the request body: length limit exceeded")
        except ValueError:
            raise ApiError(400, "invalid content-length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "Failed to buffer the request body: length limit exceeded")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _trailing_offset(exc: msgspec.DecodeError) -> int | None:
    """Offset of the first trailing character, if that is all msgspec complained about.

    msgspec reports the position just past that character (``{"a":1}x`` -> byte 8).
    """
    text = str(exc)
    marker = "trailing characters (byte "
    at = text.find(marker)
    if at < 0:
        return None
    digits = text[at + len(marker) :].split(")", 1)[0]
    return int(digits) - 1 if digits.isdigit() and int(digits) > 0 else None


def decode_json(body: bytes, type_: type[T], allow_trailing: bool = False) -> T:
    """Parse and validate a JSON body: 400 for malformed JSON, 422 for a wrong shape.

    ``allow_trailing`` mimics axum's ``Json`` extractor, which decodes the first JSON value and
    ignores whatever follows it (the reference slot tracker answers 200 to ``{...} x``).
    """
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(422, f"Failed to deserialize the JSON body into the target type: {exc}") from None
    except msgspec.DecodeError as exc:
        offset = _trailing_offset(exc) if allow_trailing else None
        if offset is None:
            raise ApiError(400, f"Failed to parse the request body as JSON: {exc}") from None
    return decode_json(body[:offset], type_)


async def read_json(
    request: Request, type_: type[T], limit: int = DEFAULT_BODY_LIMIT, allow_trailing: bool = False
) -> T:
    """Content type (415), then size (413), then parse (400) and validate (422): axum's order."""
    if not _is_json_content_type(request.headers.get("content-type")):
        raise ApiError(415, "Expected request with `Content-Type: application/json`")
    return decode_json(await read_body(request, limit), type_, allow_trailing)


Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """Turn ApiError raised by ``handler`` into its JSON error response."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message)

    endpoint.__name__ = getattr(handler, "__name__", "endpoint")
    endpoint.__doc__ = handler.__doc__
    return endpoint


def route(path: str, handler: Handler, methods: Iterable[str]) -> Route:
    return Route(path, guarded(handler), methods=list(methods))


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, "route not found")


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, "route not found")
    if exc.status_code == 405:
        return error_response(405, "method not allowed", headers=dict(exc.headers or {}))
    return error_response(exc.status_code, str(exc.detail))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return error_response(exc.status, exc.message)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def exception_handlers() -> dict[Any, Any]:
    """Starlette exception handlers that keep every framework error in the JSON shape."""
    return {404: _not_found, HTTPException: _http_exception, ServiceError: _api_error, Exception: _internal_error}


def json_service(routes: list[BaseRoute], **kwargs: Any) -> Starlette:
    """A Starlette app whose every error (including 404/405) is ``{"error": ...}``."""
    return Starlette(routes=routes, exception_handlers=exception_handlers(), **kwargs)


def is_json_content_type(value: str | None) -> bool:
    """Whether a Content-Type header value is JSON (public name for servers outside Starlette)."""
    return _is_json_content_type(value)
