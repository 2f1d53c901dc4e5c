"""The standalone indexer's request bodies (msgspec types): decoded by the service, described by its
OpenAPI document."""

from __future__ import annotations

import msgspec

from kvroute_common.constants import I64, U32, U64


class RegisterRequest(msgspec.Struct, forbid_unknown_fields=False):
    instance_id: U64
    endpoint: str
    model_name: str
    block_size: U32
    tenant_id: str | None = None
    routing_group: str | None = None
    dp_rank: U32 = 0
    replay_endpoint: str | None = None
    additional_salt: str | None = None
    additionalsalt: str | None = None


class UnregisterRequest(msgspec.Struct):
    instance_id: U64
    model_name: str
    tenant_id: str | None = None
    routing_group: str | None = None
    dp_rank: U32 | None = None


class QueryRequest(msgspec.Struct):
    token_ids: list[int]  # range (u32) checked by the hashing: cheaper than a per-item constraint
    model_name: str
    tenant_id: str | None = None
    routing_group: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class QueryByHashRequest(msgspec.Struct):
    block_hashes: list[I64]
    model_name: str
    tenant_id: str | None = None
    routing_group: str | None = None
    cache_salt: str | None = None


class PeerRequest(msgspec.Struct):
    url: str
