"""The frontend's OpenAPI document (``GET /openapi.json``): ``/v1/*``, admin, busy thresholds, health,
metrics, and the embedded slot tracker's routes (``slot_tracker.openapi``, shared with the standalone
service).

``/v1/*`` errors are OpenAI-shaped (``frontend/request/errors.py``), every other route's are
``{"error": "..."}``. The OpenAI bodies list the fields the frontend reads (model, messages /
prompt, stream, nvext) and the generation fields the engine validates; any other field is passed
to the engine. ``nvext`` is ``frontend.request.hints``'s strict schema, derived from its Structs.
"""

from __future__ import annotations

from typing import Any

from frontend.pool.workers import _ALIASES, _INT_FIELDS, _STR_FIELDS
from frontend.request.hints import _NvExt
from kvroute_common import openapi as oa
from slot_tracker.openapi import tracker_paths, tracker_schemas

_INT_STR = {"type": "string", "description": "an integer; unparsable values are ignored"}

# statuses of the /v1 generation routes (frontend/api/openai_routes.py, frontend/routing/request_router.py);
# a worker's 4xx passes through
_V1_ERRORS = {
    400: "invalid request: not a JSON object, no model, bad messages / prompt, bad nvext, or the engine refused a "
    "field",
    404: "model not served",
    413: "body over the limit",
    422: "the engine refused the request's shape",
    500: "the worker failed (its 5xx, or a lost connection)",
    503: "no worker available, or the chosen worker is unreachable",
    504: "the worker did not answer in time",
    529: "every eligible worker (or the pinned one) is busy",
}

_GENERATION = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "n": {"type": ["integer", "null"], "minimum": 1},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
    "ignore_eos": {"type": ["boolean", "null"]},
    "seed": {"type": ["integer", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "nvext": oa.ref("NvExt"),
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}


def _worker_spec() -> dict[str, Any]:
    """``WorkerSpec.from_mapping``'s rules: known fields (and their aliases) only, integers also as
    decimal strings, null = unset, http:// URLs."""
    minimum = {"id": 0, "dp_start": 0, "dp_size": 1}
    props: dict[str, Any] = {}
    for name in sorted(_INT_FIELDS):
        low = minimum.get(name, 1)
        forms = [{"type": "integer", "minimum": low}, {"type": "string", "pattern": "^\\s*[+-]?[0-9]+\\s*$"}]
        props[name] = {"anyOf": forms if name == "id" else [*forms, {"type": "null"}]}
    for name in sorted(_STR_FIELDS):
        props[name] = {"type": "string", "pattern": "^http://"} if name == "url" else {"type": ["string", "null"]}
    for alias, name in _ALIASES.items():
        props[alias] = {**props[name], "description": f"alias of `{name}`"}
    spec = {"type": "object", "required": ["url"], "properties": props, "additionalProperties": False}
    bare_url = {"type": "string", "pattern": "^http://", "description": "a bare URL: the id is derived from it"}
    return {"anyOf": [spec, bare_url]}


_SCHEMAS: dict[str, Any] = {
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": oa.ref("ChatMessage")},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
            **_GENERATION,
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "prompt": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                ]
            },
            **_GENERATION,
        },
    },
    "ResponsesRequest": {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "instructions": {"type": ["string", "null"]},
            "input": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "anyOf": [
                                {"type": "string"},
                                {
                                    "type": "object",
                                    "required": ["role", "content"],
                                    "properties": {
                                        "type": {"const": "message"},
                                        "role": {"type": "string", "minLength": 1},
                                        "content": {
                                            "anyOf": [
                                                {"type": "string"},
                                                {
                                                    "type": "array",
                                                    "items": {
                                                        "type": "object",
                                                        "required": ["type", "text"],
                                                        "properties": {
                                                            "type": {"enum": ["input_text", "output_text", "text"]},
                                                            "text": {"type": "string"},
                                                        },
                                                    },
                                                },
                                            ]
                                        },
                                    },
                                },
                            ]
                        },
                    },
                ]
            },
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "stream": {"type": ["boolean", "null"]},
            "nvext": oa.ref("NvExt"),
        },
    },
    "ResponsesAnswer": {
        "type": "object",
        "required": ["id", "object", "model"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "model": {"type": "string"},
            "output": {"type": "array"},
            "usage": {"type": "object"},
            "nvext": {"type": "object"},
        },
    },
    "MessagesRequest": {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": oa.ref("AnthropicBlock")}]},
            "messages": {"type": "array", "minItems": 1, "items": oa.ref("AnthropicMessage")},
            "tools": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "input_schema": {"type": "object"},
                    },
                },
            },
            "tool_choice": {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["auto", "any", "none", "tool"]}, "name": {"type": "string"}},
            },
            "stream": {"type": ["boolean", "null"]},
            "temperature": {"type": "number", "minimum": 0},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "nvext": oa.ref("NvExt"),
        },
    },
    "CountTokensRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": oa.ref("AnthropicBlock")}]},
            "messages": {"type": "array", "minItems": 1, "items": oa.ref("AnthropicMessage")},
        },
    },
    "AnthropicMessage": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant", "system"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": oa.ref("AnthropicBlock")}]},
        },
    },
    "AnthropicBlock": {
        "type": "object",
        "required": ["type"],
        "description": "text, tool_use, tool_result or thinking (images are refused: text-only tokenizer)",
        "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
    },
    "Message": {
        "type": "object",
        "required": ["id", "type", "role", "content", "usage"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {"type": "array"},
            "stop_reason": {"type": ["string", "null"]},
            "usage": {"type": "object"},
            "nvext": {"type": "object"},
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
    "EmbeddingsRequest": {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    },
                ]
            },
            "nvext": oa.ref("NvExt"),
        },
    },
    "Embeddings": {
        "type": "object",
        "required": ["object", "data", "model"],
        "properties": {
            "object": {"const": "list"},
            "model": {"type": "string"},
            "usage": {"type": "object"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "index", "embedding"],
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": {"type": "integer"},
                        "embedding": {"type": "array", "items": {"type": "number"}},
                    },
                },
            },
        },
    },
    "ChatMessage": _MESSAGE,
    "StreamEvent": {
        "type": "object",
        "description": "one server-sent event: a JSON chunk (or an OpenAI-shaped error event), then `[DONE]`",
        "required": ["data"],
        "properties": {"data": {"type": "string", "pattern": "^(\\[DONE\\]|\\{.*\\})$"}},
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "message": _MESSAGE},
                },
            },
            "usage": _USAGE,
            "nvext": {"type": "object"},
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}},
                },
            },
            "usage": _USAGE,
            "nvext": {"type": "object"},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "message"],
        "properties": {
            "status": {"enum": ["healthy", "not_ready", "shutting_down", "live"]},
            "message": {"type": "string"},
            "endpoints": {"type": "array", "items": {"type": "string"}},
            "instances": {"type": "array"},
            "models": {"type": "array", "items": {"type": "string"}},
        },
    },
    "BusyThresholdUpdate": {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": {"type": "string"},
            "active_decode_blocks_threshold": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "active_prefill_tokens_threshold": {"type": ["integer", "null"], "minimum": 0},
            "active_prefill_tokens_threshold_frac": {"type": ["number", "null"], "minimum": 0},
        },
    },
    "BusyThreshold": {
        "type": "object",
        "required": ["model", "active_decode_blocks_threshold", "active_prefill_tokens_threshold"],
        "properties": {
            "model": {"type": "string"},
            "active_decode_blocks_threshold": {"type": ["number", "null"]},
            "active_prefill_tokens_threshold": {"type": ["integer", "null"]},
            "active_prefill_tokens_threshold_frac": {"type": ["number", "null"]},
        },
    },
    "WorkerSpec": _worker_spec(),
    "Worker": {
        "type": "object",
        "required": ["id", "url", "source", "healthy", "models"],
        "properties": {
            "id": {"type": "integer"},
            "url": {"type": "string"},
            "source": {"type": "string"},
            "healthy": {"type": "boolean"},
            "models": {"type": "array", "items": {"type": "string"}},
            "last_error": {"type": ["string", "null"]},
            "prompt_ids_proven": {
                "type": "boolean",
                "description": "the engine turned the probe text into the router's ids when it joined: with "
                "--send-token-ids auto it gets completions prompts as ids",
            },
        },
    },
    "RouteDecision": {
        "type": "object",
        "required": [
            "model",
            "isl",
            "block_size",
            "router_mode",
            "worker_id",
            "dp_rank",
            "overlap_blocks",
            "candidates",
        ],
        "properties": {
            "model": {"type": "string"},
            "lora_name": {
                "type": ["string", "null"],
                "description": "the LoRA adapter the model is (blocks hashed with its name), null for a base model",
            },
            "isl": {"type": "integer"},
            "block_size": {"type": "integer"},
            "router_mode": {"type": "string"},
            "worker_id": {"type": "integer"},
            "dp_rank": {"type": "integer"},
            "overlap_blocks": {"type": "integer"},
            "overlap_source": {
                "enum": ["embedded", "remote", "remote_unavailable"],
                "description": "where the overlaps came from: the embedded index, remote indexers "
                "(--use-remote-indexer), or none because a remote indexer did not answer (load-only)",
            },
            "candidates": {"type": "array", "items": {"type": "object", "required": ["worker_id", "dp_rank", "cost"]}},
        },
    },
}

_ROUTING_HEADERS = [
    {
        "name": "x-dynamo-worker-instance-id",
        "in": "header",
        "required": False,
        "schema": _INT_STR,
        "description": "pin to this worker",
    },
    {
        "name": "x-dynamo-dp-rank",
        "in": "header",
        "required": False,
        "schema": _INT_STR,
        "description": "pin to this DP rank",
    },
    {
        "name": "x-dynamo-request-priority",
        "in": "header",
        "required": False,
        "schema": _INT_STR,
        "description": "queue priority jump",
    },
    {
        "name": "x-dynamo-session-id",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "session identity",
    },
]


def _generation(
    summary: str, request: str, answer: str, streams: bool = True, error: str = "OpenAIError"
) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": oa.ref(answer)}}
    if streams:
        content["text/event-stream"] = {"schema": oa.ref("StreamEvent")}
    ok = {
        "description": "the answer (JSON)" + (", or its SSE stream with `stream: true`" if streams else ""),
        "content": content,
    }
    responses = {"200": ok}
    responses.update(oa.errors(_V1_ERRORS, error))
    return {
        "summary": summary,
        "parameters": _ROUTING_HEADERS,
        "requestBody": {"required": True, "content": oa.json_content(oa.ref(request))},
        "responses": responses,
    }


def frontend_paths() -> dict[str, Any]:
    health = oa.json_ok("ready / live", oa.ref("Health"))
    not_ready = {"description": "no healthy worker yet, or shutting down", "content": oa.json_content(oa.ref("Health"))}
    return {
        "/v1/chat/completions": {
            "post": _generation("chat completion, routed to the best worker", "ChatCompletionRequest", "ChatCompletion")
        },
        "/v1/completions": {
            "post": _generation("text completion, routed to the best worker", "CompletionRequest", "Completion")
        },
        "/v1/responses": {
            "post": _generation(
                "OpenAI Responses request (text), tokenized like chat and routed", "ResponsesRequest", "ResponsesAnswer"
            )
        },
        "/v1/messages": {
            "post": _generation(
                "Anthropic Messages request, tokenized as the engine renders it and routed; Anthropic-shaped errors",
                "MessagesRequest",
                "Message",
                error="AnthropicError",
            )
        },
        "/v1/messages/count_tokens": {
            "post": oa.json_post(
                "the prompt's token count (counted by the router, nothing is sent to a worker)",
                oa.ref("CountTokensRequest"),
                {
                    200: oa.json_ok(
                        "the count",
                        {
                            "type": "object",
                            "required": ["input_tokens"],
                            "properties": {"input_tokens": {"type": "integer"}},
                        },
                    )
                },
                {400: "bad messages", 404: "model not served", 413: "body over the limit"},
                "AnthropicError",
            )
        },
        "/v1/embeddings": {
            "post": _generation("embeddings, routed by load", "EmbeddingsRequest", "Embeddings", streams=False)
        },
        "/v1/models": {
            "get": oa.get(
                "served models",
                {
                    200: oa.json_ok(
                        "models",
                        {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {
                                "object": {"const": "list"},
                                "data": {"type": "array", "items": oa.ref("Model")},
                            },
                        },
                    )
                },
            )
        },
        "/v1/models/{model}": {
            "get": oa.get(
                "one served model",
                {200: oa.json_ok("the model", oa.ref("Model"))},
                {404: "model not served"},
                "OpenAIError",
                parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            )
        },
        "/health": {"get": {"summary": "readiness", "responses": {"200": health, "503": not_ready}}},
        "/live": {"get": {"summary": "liveness", "responses": {"200": health, "503": not_ready}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (dynamo_frontend_*, dynamo_component_router_*, "
                "dynamo_router_overhead_*)",
                "responses": {
                    "200": {"description": "text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
        "/busy_threshold": {
            "get": oa.get(
                "busy thresholds of every model that has some",
                {
                    200: oa.json_ok(
                        "thresholds",
                        {
                            "type": "object",
                            "required": ["thresholds"],
                            "properties": {"thresholds": {"type": "array", "items": oa.ref("BusyThreshold")}},
                        },
                    )
                },
            ),
            "post": oa.json_post(
                "read (only `model`) or set a model's busy thresholds",
                oa.ref("BusyThresholdUpdate"),
                {200: oa.json_ok("the model's thresholds", oa.ref("BusyThreshold"))},
                {400: "a threshold out of range", 404: "model not discovered"},
            ),
        },
        "/admin/workers": {
            "get": oa.get(
                "registered workers",
                {
                    200: oa.json_ok(
                        "workers",
                        {
                            "type": "object",
                            "required": ["workers"],
                            "properties": {"workers": {"type": "array", "items": oa.ref("Worker")}},
                        },
                    )
                },
            ),
            "post": oa.json_post(
                "add or replace a worker (probed first unless ?wait=false)",
                oa.ref("WorkerSpec"),
                {201: oa.json_ok("added", oa.ref("Worker")), 200: oa.json_ok("replaced", oa.ref("Worker"))},
                {400: "invalid worker spec"},
                parameters=[oa.query_param("wait", "false: do not wait for the first health check")],
            ),
        },
        "/admin/workers/{worker_id}": {
            "delete": {
                "summary": "remove a worker",
                "parameters": [{"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": oa.status_ok("removed"),
                    **oa.errors({400: "not an integer id", 404: "no such worker"}),
                },
            }
        },
        "/dashboard": {
            "get": {
                "summary": "the live dashboard page (HTML; polls /dashboard/data)",
                "responses": {"200": {"description": "page", "content": {"text/html": {"schema": {"type": "string"}}}}},
            }
        },
        "/dashboard/data": {
            "get": oa.get(
                "the dashboard's snapshot: per-rank loads, blocks indexed, health and busy state; decisions by mode; "
                "hit-rate decomposition and its time series; recent decisions with their cost terms",
                {
                    200: oa.json_ok(
                        "snapshot",
                        {
                            "type": "object",
                            "required": ["seq", "time", "ranks", "decisions", "decomposition", "history", "recent"],
                        },
                    )
                },
                {400: "seq is not an integer", 404: "that snapshot is no longer kept"},
                parameters=[oa.query_param("seq", "a snapshot served earlier (the last 16 are kept)")],
            )
        },
        "/admin/route": {
            "post": oa.json_post(
                "the decision an OpenAI body would get now, with every candidate's cost terms (nothing booked or sent)",
                {"anyOf": [oa.ref("ChatCompletionRequest"), oa.ref("CompletionRequest")]},
                {200: oa.json_ok("the decision", oa.ref("RouteDecision"))},
                {
                    400: "bad messages / prompt",
                    404: "model not served",
                    503: "no worker available",
                    529: "every eligible worker is busy",
                },
            )
        },
    }


def build_document() -> dict[str, Any]:
    paths = frontend_paths()
    paths.update(tracker_paths())
    schemas = tracker_schemas()
    nvext = oa.struct_schemas([_NvExt], prefix="NvExt")  # components NvExt_NvExt, NvExt_AgentHints, ...
    nvext["NvExt"] = nvext.pop("NvExt_NvExt")
    schemas.update(nvext)
    schemas.update(_SCHEMAS)
    return oa.document(
        "kvroute frontend",
        "KV-aware OpenAI-compatible proxy (python -m frontend). /v1 errors are OpenAI-shaped; every other error is "
        '{"error": "..."}.',
        paths,
        schemas,
    )
