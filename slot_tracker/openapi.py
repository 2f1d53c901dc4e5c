"""The slot tracker's OpenAPI document (``GET /openapi.json``): the standalone service's routes.

``tracker_paths`` / ``tracker_schemas`` are the same routes as served on the frontend's port
(``frontend/api/openapi.py`` includes them), so the two documents cannot disagree. Request bodies come
from the Structs in ``slot_tracker.service``; statuses from its handlers and the core.
"""

from __future__ import annotations

from typing import Any

from kvroute_common import openapi as oa
from slot_tracker.core import MAX_DP_SIZE
from slot_tracker.requests import AddBody, PeerBody, PotentialLoadsBody, RegisterBody, RequestBody, UnregisterBody

_U64 = {"type": "integer", "minimum": 0, "maximum": oa.U64_MAX}

# examples in the shapes Dynamo's slot-tracker documentation uses
_EXAMPLE_MODEL = {"model_name": "llama-3-8b", "tenant_id": "default"}
EXAMPLES: dict[str, Any] = {
    "register": {"worker_id": 7, **_EXAMPLE_MODEL, "block_size": 16, "dp_start": 0, "dp_size": 2},
    "unregister": {"worker_id": 7, **_EXAMPLE_MODEL},
    "add": {
        **_EXAMPLE_MODEL,
        "request_id": "req-123",
        "worker_id": 7,
        "dp_rank": 0,
        "sequence_hashes": [101, -22, 303],
        "new_isl_tokens": 48,
    },
    "request": {**_EXAMPLE_MODEL, "request_id": "req-123"},
    "potential_loads": {**_EXAMPLE_MODEL, "sequence_hashes": [101, -22, 303, 404], "new_isl_tokens": 48},
}
_U32 = {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}

_RESPONSE_SCHEMAS: dict[str, Any] = {
    "TrackerWorker": {
        "type": "object",
        "required": ["worker_id", "model_name", "tenant_id", "block_size", "dp_start", "dp_size"],
        "properties": {
            "worker_id": _U64,
            "model_name": {"type": "string"},
            "tenant_id": {"type": "string"},
            "block_size": _U32,
            "dp_start": _U32,
            "dp_size": _U32,
        },
        "additionalProperties": False,
    },
    "Load": {
        "type": "object",
        "required": [
            "model_name",
            "tenant_id",
            "worker_id",
            "dp_rank",
            "active_prefill_tokens",
            "active_decode_blocks",
        ],
        "properties": {
            "model_name": {"type": "string"},
            "tenant_id": {"type": "string"},
            "worker_id": _U64,
            "dp_rank": _U32,
            "active_prefill_tokens": {"type": "integer", "minimum": 0},
            "active_decode_blocks": {"type": "integer", "minimum": 0},
        },
        "additionalProperties": False,
    },
    "PotentialLoad": {
        "type": "object",
        "required": ["worker_id", "dp_rank", "potential_prefill_tokens", "potential_decode_blocks", "active_requests"],
        "properties": {
            "worker_id": _U64,
            "dp_rank": _U32,
            "potential_prefill_tokens": {"type": "integer", "minimum": 0},
            "potential_decode_blocks": {"type": "integer", "minimum": 0},
            "active_requests": {"type": "integer", "minimum": 0},
        },
        "additionalProperties": False,
    },
}

_FILTERS = [
    oa.query_param("model_name", "only this model"),
    oa.query_param("tenant_id", "only this tenant"),
    oa.query_param("routing_group", "1.6.1 alias of tenant_id (must agree with it)"),
]
_FILTER_ERRORS = {400: "a filter given twice, or tenant_id and routing_group differ"}
_ALIAS = "tenant_id and its alias routing_group differ"


def _peer_paths() -> dict[str, Any]:
    body = oa.ref("PeerBody")
    return {
        "/register_peer": {
            "post": oa.json_post(
                "add a replica-sync peer (its PUB endpoint, as `url` or `endpoint`)",
                body,
                {201: oa.status_ok("peer added"), 200: oa.status_ok("already a peer")},
                {
                    400: "not a usable ZMQ endpoint",
                    409: "replica sync is disabled",
                    422: "no `url` / `endpoint`, or the two differ",
                },
            )
        },
        "/deregister_peer": {
            "post": oa.json_post(
                "remove a replica-sync peer",
                body,
                {200: oa.status_ok("peer removed")},
                {404: "not a peer", 409: "replica sync is disabled", 422: "no `url` / `endpoint`, or the two differ"},
            )
        },
        "/peers": {
            "get": oa.get(
                "replica-sync peers",
                {200: oa.json_ok("peer endpoints", {"type": "array", "items": {"type": "string"}})},
            )
        },
    }


def tracker_paths() -> dict[str, Any]:
    """Every tracker route but ``/health`` (whose meaning differs between the service and the frontend)."""
    paths: dict[str, Any] = {
        "/register": {
            "post": oa.json_post(
                "register a worker's DP ranks for (model_name, tenant_id)",
                oa.ref("RegisterBody"),
                {201: oa.status_ok("registered")},
                {
                    400: "block_size or dp_size 0, dp_size over 4096, or a rank range beyond u32",
                    409: "worker already registered, or another block size for this model and tenant",
                    422: _ALIAS,
                },
                example=EXAMPLES["register"],
            )
        },
        "/unregister": {
            "post": oa.json_post(
                "drop a worker, its ranks and its requests",
                oa.ref("UnregisterBody"),
                {200: oa.status_ok("unregistered")},
                {404: "worker not registered for this model and tenant", 422: _ALIAS},
                example=EXAMPLES["unregister"],
            )
        },
        "/workers": {
            "get": oa.get(
                "registered workers",
                {200: oa.json_ok("workers", {"type": "array", "items": oa.ref("TrackerWorker")})},
                _FILTER_ERRORS,
                parameters=_FILTERS,
            )
        },
        "/add": {
            "post": oa.json_post(
                "book a request's prompt path on a (worker, rank)",
                oa.ref("AddBody"),
                {201: oa.status_ok("booked")},
                {
                    404: "no tracker for the model, or no such (worker, rank)",
                    409: "request id already active",
                    422: _ALIAS,
                },
                example=EXAMPLES["add"],
            )
        },
        "/prefill_complete": {
            "post": oa.json_post(
                "the request's prefill is done (repeats are no-ops)",
                oa.ref("RequestBody"),
                {200: oa.status_ok("done")},
                {404: "no tracker, or no such request", 422: _ALIAS},
                example=EXAMPLES["request"],
            )
        },
        "/free": {
            "post": oa.json_post(
                "release a request (idempotent)",
                oa.ref("RequestBody"),
                {200: oa.status_ok("freed, or was not active")},
                {404: "no tracker for the model", 422: _ALIAS},
                example=EXAMPLES["request"],
            )
        },
        "/loads": {
            "get": oa.get(
                "active load of every (worker, rank)",
                {200: oa.json_ok("loads", {"type": "array", "items": oa.ref("Load")})},
                _FILTER_ERRORS,
                parameters=_FILTERS,
            )
        },
        "/potential_loads": {
            "post": oa.json_post(
                "every (worker, rank)'s load if this request were added there",
                oa.ref("PotentialLoadsBody"),
                {200: oa.json_ok("potential loads", {"type": "array", "items": oa.ref("PotentialLoad")})},
                {404: "no tracker for the model", 422: _ALIAS},
                example=EXAMPLES["potential_loads"],
            )
        },
    }
    peers = _peer_paths()
    paths.update(peers)
    paths.update({f"/replica_sync{p}": item for p, item in peers.items()})  # the 1.6.1 spellings
    return paths


def tracker_schemas() -> dict[str, Any]:
    schemas = oa.struct_schemas(
        [RegisterBody, UnregisterBody, AddBody, RequestBody, PotentialLoadsBody, PeerBody],
        {
            "RegisterBody": ["worker_id"],
            "UnregisterBody": ["worker_id"],
            "AddBody": ["worker_id", "new_isl_tokens"],
            "PotentialLoadsBody": ["new_isl_tokens"],
        },
        minimums={"RegisterBody": {"block_size": 1, "dp_size": 1}},  # 0 is a 400 from the core
    )
    schemas["RegisterBody"]["properties"]["dp_size"]["maximum"] = MAX_DP_SIZE
    schemas.update(_RESPONSE_SCHEMAS)
    return schemas


def build_document() -> dict[str, Any]:
    paths = {"/health": {"get": {"summary": "liveness", "responses": {"200": {"description": "alive (empty body)"}}}}}
    paths.update(tracker_paths())
    return oa.document(
        "kvroute slot tracker",
        'Standalone active-load accounting (python -m slot_tracker). Errors are {"error": "..."}.',
        paths,
        tracker_schemas(),
    )
