"""The standalone indexer's OpenAPI document (``GET /openapi.json``).

Request bodies come from the Structs in ``indexer.service`` (what the handlers decode into),
statuses from its handlers and ``indexer.registry``; the /query answer is ``overlap_payload``'s.
"""

from __future__ import annotations

from typing import Any

from indexer.requests import PeerRequest, QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest
from kvroute_common import openapi as oa

_U64 = {"type": "integer", "minimum": 0, "maximum": oa.U64_MAX}
_COUNT = {"type": "integer", "minimum": 0}
_TIERS = ["device", "host_pinned", "disk", "external"]
_BLOCK = {
    "type": "object",
    "required": ["block_hash", "tokens_hash"],
    "properties": {"block_hash": _U64, "tokens_hash": _U64, "mm_extra_info": {}},
}

_RESPONSE_SCHEMAS: dict[str, Any] = {
    "Overlap": {
        "type": "object",
        "description": "matched tokens per instance and DP rank (device tier), and per tier",
        "required": ["scores", "frequencies", "instances"],
        "properties": {
            "scores": {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": _COUNT}},
            "frequencies": {"type": "array"},
            "instances": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["longest_matched", "gpu", "dp", "cpu", "disk"],
                    "properties": {
                        "longest_matched": _COUNT,
                        "gpu": _COUNT,
                        "cpu": _COUNT,
                        "disk": _COUNT,
                        "dp": {"type": "object", "additionalProperties": _COUNT},
                    },
                },
            },
        },
    },
    "IndexerWorker": {
        "type": "object",
        "required": [
            "instance_id",
            "source",
            "status",
            "model_name",
            "tenant_id",
            "routing_group",
            "block_size",
            "endpoints",
            "listeners",
        ],
        "properties": {
            "instance_id": _U64,
            "source": {"type": "string"},
            "status": {"enum": ["failed", "pending", "active", "paused"]},
            "model_name": {"type": "string"},
            "tenant_id": {"type": "string"},
            "routing_group": {"type": "string"},
            "block_size": {"type": ["integer", "null"]},
            "endpoints": {"type": "object", "additionalProperties": {"type": "string"}},
            "listeners": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["endpoint", "status", "engine_restarts"],
                    "properties": {
                        "endpoint": {"type": "string"},
                        "status": {"type": "string"},
                        # new engine processes the listener saw on its endpoint (a frontend reads them)
                        "engine_restarts": {"type": "integer", "minimum": 0},
                        "replay_endpoint": {"type": "string"},
                        "last_error": {"type": "string"},
                    },
                },
            },
        },
    },
    "RouterEvent": {
        "type": "object",
        "required": ["worker_id", "storage_tier", "event"],
        "properties": {
            "worker_id": _U64,
            "storage_tier": {"enum": _TIERS},
            "residency_domain": {"type": "string"},
            "event": {
                "type": "object",
                "required": ["event_id", "data", "dp_rank"],
                "properties": {
                    "event_id": _COUNT,
                    "dp_rank": _COUNT,
                    "data": {
                        "type": "object",
                        "required": ["stored"],
                        "properties": {
                            "stored": {
                                "type": "object",
                                "required": ["parent_hash", "blocks"],
                                "properties": {
                                    "parent_hash": {"anyOf": [_U64, {"type": "null"}]},
                                    "start_position": {},
                                    "blocks": {"type": "array", "items": _BLOCK},
                                },
                            }
                        },
                    },
                },
            },
        },
    },
    "Dump": {
        "type": "object",
        "description": "every partition, keyed `model:tenant`, as RouterEvents (a peer restores from this)",
        "additionalProperties": {
            "type": "object",
            "required": ["block_size", "events"],
            "properties": {"block_size": _COUNT, "events": {"type": "array", "items": oa.ref("RouterEvent")}},
        },
    },
}

# examples in the shapes Dynamo's indexer documentation uses
EXAMPLES: dict[str, Any] = {
    "register": {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": "llama-3-8b", "block_size": 16},
    "unregister": {"instance_id": 1, "model_name": "llama-3-8b"},
    "query": {"token_ids": list(range(1, 17)), "model_name": "llama-3-8b"},
    "query_by_hash": {"block_hashes": [123456, 789012], "model_name": "llama-3-8b"},
}

_FILTERS = [
    oa.query_param("model_name", "only this model"),
    oa.query_param("tenant_id", "only this tenant"),
    oa.query_param("routing_group", "1.6.1 alias of tenant_id"),
]


def indexer_paths() -> dict[str, Any]:
    peer = oa.ref("PeerRequest")
    return {
        "/register": {
            "post": oa.json_post(
                "subscribe to a worker's (DP rank's) ZMQ KV events",
                oa.ref("RegisterRequest"),
                {201: oa.status_ok("registered")},
                {
                    400: "not a usable ZMQ endpoint, or block_size 0",
                    409: "instance registered for another model/tenant, rank already registered, or another block size",
                },
                example=EXAMPLES["register"],
            )
        },
        "/unregister": {
            "post": oa.json_post(
                "drop an instance (or one DP rank) and its blocks",
                oa.ref("UnregisterRequest"),
                {200: oa.status_ok("unregistered")},
                {404: "instance (or rank) not registered for this model and tenant"},
                example=EXAMPLES["unregister"],
            )
        },
        "/workers": {
            "get": oa.get(
                "registered instances and their listeners",
                {200: oa.json_ok("instances", {"type": "array", "items": oa.ref("IndexerWorker")})},
                parameters=_FILTERS,
            )
        },
        "/query": {
            "post": oa.json_post(
                "overlap of a token sequence (hashed with the partition's block size, LoRA and cache salt)",
                oa.ref("QueryRequest"),
                {200: oa.json_ok("overlap scores", oa.ref("Overlap"))},
                {404: "no indexer for this model and tenant", 422: "wrong shape, or a token id beyond u32"},
                example=EXAMPLES["query"],
            )
        },
        "/query_by_hash": {
            "post": oa.json_post(
                "overlap of local block hashes (signed i64)",
                oa.ref("QueryByHashRequest"),
                {200: oa.json_ok("overlap scores", oa.ref("Overlap"))},
                {
                    400: "malformed JSON, or cache_salt given (hashes must already include it)",
                    404: "no indexer for this model and tenant",
                },
                example=EXAMPLES["query_by_hash"],
            )
        },
        "/dump": {"get": oa.get("the whole index as RouterEvents", {200: oa.json_ok("dump", oa.ref("Dump"))})},
        "/register_peer": {
            "post": oa.json_post("add a peer indexer (start-up recovery)", peer, {201: oa.status_ok("added")})
        },
        "/deregister_peer": {
            "post": oa.json_post("remove a peer indexer", peer, {200: oa.status_ok("removed")}, {404: "not a peer"})
        },
        "/peers": {
            "get": oa.get(
                "peer indexers", {200: oa.json_ok("peer URLs", {"type": "array", "items": {"type": "string"}})}
            )
        },
        "/reopen_logs": {
            "post": {
                "summary": "accepted for compatibility (logs go to stderr)",
                "responses": {"200": oa.status_ok("done")},
            }
        },
    }


def build_document() -> dict[str, Any]:
    paths = {
        "/health": {"get": {"summary": "liveness", "responses": {"200": {"description": "alive (empty body)"}}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (dynamo_kvindexer_*)",
                "responses": {
                    "200": {"description": "text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
    }
    paths.update(indexer_paths())
    schemas = oa.struct_schemas(
        [RegisterRequest, UnregisterRequest, QueryRequest, QueryByHashRequest, PeerRequest],
        {"RegisterRequest": ["instance_id"], "UnregisterRequest": ["instance_id"]},
        minimums={"RegisterRequest": {"block_size": 1}},  # 0 is a 400 from the registry
    )
    schemas["QueryRequest"]["properties"]["token_ids"]["items"] = {
        "type": "integer",
        "minimum": 0,
        "maximum": (1 << 32) - 1,
    }
    schemas.update(_RESPONSE_SCHEMAS)
    return oa.document(
        "kvroute indexer",
        'Standalone KV indexer fed by ZMQ KV events (python -m indexer). Errors are {"error": "..."}.',
        paths,
        schemas,
    )
