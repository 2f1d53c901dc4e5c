"""The standalone slot tracker's request bodies (msgspec types): decoded by the service, described by
its OpenAPI document. Absent optional fields stay UNSET; an explicit null is refused (422), as the
reference does."""

from __future__ import annotations

import msgspec

from kvroute_common.constants import DEFAULT_TENANT, I64, U32, U64
from kvroute_common.http import ApiError

_UNSET = msgspec.UNSET
OptStr = str | msgspec.UnsetType  # absent allowed, null refused (422) as in the reference


class _Tenanted(msgspec.Struct):
    def tenant(self) -> str:
        tenant_id = self.tenant_id  # type: ignore[attr-defined]
        group = self.routing_group  # type: ignore[attr-defined]
        if tenant_id is _UNSET:
            return DEFAULT_TENANT if group is _UNSET else group
        if group is not _UNSET and group != tenant_id:
            raise ApiError(
                422,
                f"Failed to deserialize the JSON body into the target type: tenant_id {tenant_id!r} and its alias "
                f"routing_group {group!r} differ",
            )
        return tenant_id


class RegisterBody(_Tenanted):
    worker_id: U64
    model_name: str
    block_size: U32
    dp_start: U32
    dp_size: U32
    tenant_id: OptStr = _UNSET
    routing_group: OptStr = _UNSET


class UnregisterBody(_Tenanted):
    worker_id: U64
    model_name: str
    tenant_id: OptStr = _UNSET
    routing_group: OptStr = _UNSET


class AddBody(_Tenanted):
    model_name: str
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: list[I64]
    new_isl_tokens: U64 = 0
    tenant_id: OptStr = _UNSET
    routing_group: OptStr = _UNSET


class RequestBody(_Tenanted):
    model_name: str
    request_id: str
    tenant_id: OptStr = _UNSET
    routing_group: OptStr = _UNSET


class PotentialLoadsBody(_Tenanted):
    model_name: str
    sequence_hashes: list[I64]
    new_isl_tokens: U64 = 0
    tenant_id: OptStr = _UNSET
    routing_group: OptStr = _UNSET


class PeerBody(msgspec.Struct):
    url: OptStr = _UNSET
    endpoint: OptStr = _UNSET

    def peer(self) -> str:
        if self.url is not _UNSET:
            if self.endpoint is not _UNSET and self.endpoint != self.url:
                raise ApiError(
                    422, "Failed to deserialize the JSON body into the target type: url and its alias endpoint differ"
                )
            return self.url
        if self.endpoint is not _UNSET:
            return self.endpoint
        raise ApiError(422, "Failed to deserialize the JSON body into the target type: missing field `url`")
