"""OpenAPI 3.1 building blocks shared by the three HTTP services' documents (served at ``/openapi.json``).

Each service keeps its document in one module (``slot_tracker/openapi.py``, ``indexer/openapi.py``,
``frontend/api/openapi.py``); what they share lives here: the two error shapes (the services'
``{"error": "..."}`` and the ``/v1`` routes' OpenAI-style body), the ``{"status":"ok"}`` answer,
the statuses every JSON POST route can give (``kvroute_common.http.read_json``: 400, 413, 415,
422), request-body schemas derived from the msgspec Structs the handlers decode into (so a
document cannot drift from what a handler accepts), and the route that serves a document.

The documents are for clients and for the schemathesis run in tests/test_openapi_fuzz.py, which
checks every answer against them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvroute_common.constants import U64_MAX

OPENAPI_PATH = "/openapi.json"
OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"

JSON = "application/json"

SERVICE_ERROR: dict[str, Any] = {
    "type": "object",
    "description": "Every error of the standalone services and of the frontend's non-/v1 routes.",
    "required": ["error"],
    "properties": {"error": {"type": "string", "minLength": 1}},
    "additionalProperties": False,
}

OPENAI_ERROR: dict[str, Any] = {
    "type": "object",
    "description": "Errors of the /v1 routes: OpenAI's nested object plus the reference frontend's flat fields.",
    "required": ["error", "message", "type", "code"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        },
        "message": {"type": "string"},
        "type": {"type": "string"},
        "code": {"type": "integer"},
    },
}

STATUS_OK: dict[str, Any] = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"const": "ok"}},
}

SHARED_SCHEMAS: dict[str, Any] = {"ServiceError": SERVICE_ERROR, "OpenAIError": OPENAI_ERROR, "StatusOk": STATUS_OK}

# what kvroute_common.http.read_json refuses, in its order
JSON_BODY_ERRORS: dict[int, str] = {
    400: "malformed JSON (or a bad content-length)",
    413: "body over the route's limit",
    415: "content type is not JSON",
    422: "JSON of the wrong shape: missing field, wrong type, value out of range",
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def json_content(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": dict(schema)}}


def error(description: str, schema: str = "ServiceError") -> dict[str, Any]:
    """A response whose body is one of the shared error shapes."""
    return {"description": description, "content": json_content(ref(schema))}


def errors(codes: Mapping[int, str], schema: str = "ServiceError") -> dict[str, Any]:
    return {str(code): error(text, schema) for code, text in sorted(codes.items())}


def json_ok(description: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": json_content(schema)}


def status_ok(description: str) -> dict[str, Any]:
    return json_ok(description, ref("StatusOk"))


def json_post(
    summary: str,
    body: Mapping[str, Any],
    ok: Mapping[int, Mapping[str, Any]],
    refusals: Mapping[int, str] | None = None,
    error_schema: str = "ServiceError",
    body_errors: Mapping[int, str] = JSON_BODY_ERRORS,
    example: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    """A POST operation with a required JSON body: its successes, the body errors, the route's own refusals."""
    codes = dict(body_errors)
    codes.update(refusals or {})
    responses = {str(code): dict(resp) for code, resp in ok.items()}
    responses.update(errors(codes, error_schema))
    content = json_content(body)
    if example is not None:
        content[JSON]["example"] = example
    op = {"summary": summary, "requestBody": {"required": True, "content": content}, "responses": responses}
    op.update(extra)
    return op


def get(
    summary: str,
    ok: Mapping[int, Mapping[str, Any]],
    refusals: Mapping[int, str] | None = None,
    error_schema: str = "ServiceError",
    **extra: Any,
) -> dict[str, Any]:
    responses = {str(code): dict(resp) for code, resp in ok.items()}
    responses.update(errors(refusals or {}, error_schema))
    op = {"summary": summary, "responses": responses}
    op.update(extra)
    return op


def query_param(
    name: str, description: str, schema: Mapping[str, Any] | None = None, required: bool = False
) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": required,
        "description": description,
        "schema": dict(schema or {"type": "string"}),
    }


def struct_schemas(
    types: Iterable[type],
    u64_fields: Mapping[str, Iterable[str]] | None = None,
    prefix: str = "",
    minimums: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """Component schemas of the msgspec Structs a service decodes its bodies into.

    ``u64_fields`` names, per Struct, the fields whose upper bound (2**64-1) the handler checks
    after decoding (msgspec cannot express it); the document states it. ``prefix`` is put before
    every component name (private Structs such as ``_NvExt`` become ``{prefix}_NvExt``).
    ``minimums`` tightens lower bounds the handler (not the Struct) enforces, with its own status.
    """
    _, components = msgspec.json.schema_components(list(types), ref_template=_REF.replace("{name}", prefix + "{name}"))
    components = {prefix + name: schema for name, schema in components.items()}
    for name, fields in (u64_fields or {}).items():
        props = components[name]["properties"]
        for field in fields:
            props[field]["maximum"] = U64_MAX
    for name, bounds in (minimums or {}).items():
        props = components[name]["properties"]
        for field, low in bounds.items():
            props[field]["minimum"] = low
    for schema in components.values():
        schema.pop("title", None)
    return components


def document(title: str, description: str, paths: Mapping[str, Any], schemas: Mapping[str, Any]) -> dict[str, Any]:
    """A complete OpenAPI 3.1 document with the shared components and ``/openapi.json`` itself."""
    all_paths = dict(paths)
    all_paths[OPENAPI_PATH] = {
        "get": get(
            "this document",
            {200: json_ok("the OpenAPI document", {"type": "object", "required": ["openapi", "paths"]})},
        )
    }
    components = copy.deepcopy(SHARED_SCHEMAS)
    components.update(copy.deepcopy(dict(schemas)))
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": "0.1.0", "description": description},
        "paths": all_paths,
        "components": {"schemas": components},
    }


def openapi_route(doc: Mapping[str, Any]) -> Route:
    """``GET /openapi.json`` answering ``doc`` (encoded once), on the app's ordinary ASGI path."""
    body = orjson.dumps(doc)

    async def openapi(request: Request) -> Response:
        return Response(body, media_type=JSON)

    return Route(OPENAPI_PATH, openapi, methods=["GET"])
