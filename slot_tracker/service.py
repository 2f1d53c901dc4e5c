"""HTTP adapter of the slot tracker: the standalone service's routes (also served by the frontend).

Field names follow the document (``tenant_id``, default ``"default"``); the 1.6.1 spelling
``routing_group`` is accepted as an input alias (query parameters too). Outputs carry
``tenant_id`` only, exactly the document's shapes. Hashes arrive as signed i64 (> i64 max is 422)
and go to the core as they are (it keys every node by the u64 value and its i64 alias).

Peers: the document's ``/register_peer`` / ``/deregister_peer`` (``{"url": ...}``) and ``/peers``,
plus the 1.6.1 spellings under ``/replica_sync/`` (``{"endpoint": ...}``); either key works on both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from kvroute_common.constants import U64_MAX
from kvroute_common.drain import Drain
from kvroute_common.fast_http import FastJsonRoutes, JsonHandler, protect
from kvroute_common.http import (
    ApiError,
    MiB,
    decode_json,
    json_response,
    json_service,
    ok,
    raw_json_response,
    read_body,
    read_json,
    route,
)
from kvroute_common.http import _is_json_content_type as is_json_content_type
from kvroute_common.openapi import openapi_route
from kvroute_common.security import AccessPolicy, service_classifier
from slot_tracker.core import SlotRegistry, SlotTrackerError
from slot_tracker.openapi import build_document
from slot_tracker.requests import (
    AddBody,
    PeerBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestBody,
    UnregisterBody,
)

if TYPE_CHECKING:
    from slot_tracker.replica_sync import ReplicaSync

BODY_LIMIT = 2 * MiB
ACCESS = service_classifier(["/potential_loads"])
"""Who may call what with tokens set: reads (GET, /potential_loads) need an API key, writes the admin token."""


def _u64(value: int, field: str) -> int:
    if value > U64_MAX:
        raise ApiError(
            422,
            f"Failed to deserialize the JSON body into the target type: invalid value: integer `{value}`, expected "
            f"u64 - at `$.{field}`",
        )
    return value


def u64_path(hashes: list[int]) -> list[int]:
    """Sequence hashes as the core keys them (u64): the API's signed i64 values mapped, in one pass
    only when one is negative."""
    if hashes and min(hashes) < 0:
        return [h & U64_MAX for h in hashes]
    return hashes


def _query_filters(request: Request) -> tuple[str | None, str | None]:
    """Optional ``model_name`` and ``tenant_id`` (alias ``routing_group``) filters; repeats are 400."""
    params = request.query_params
    found: dict[str, str] = {}
    for name in ("model_name", "tenant_id", "routing_group"):
        values = params.getlist(name)
        if len(values) > 1:
            raise ApiError(400, f"Failed to deserialize query string: duplicate field `{name}`")
        if values:
            found[name] = values[0]
    tenant = found.get("tenant_id")
    group = found.get("routing_group")
    if tenant is not None and group is not None and tenant != group:
        raise ApiError(400, "Failed to deserialize query string: tenant_id and its alias routing_group differ")
    return found.get("model_name"), tenant if tenant is not None else group


def _core(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except SlotTrackerError as exc:
        raise ApiError(exc.status, exc.message) from None


async def _body(request: Request, type_: type[Any]) -> Any:
    return await read_json(request, type_, BODY_LIMIT, allow_trailing=True)


def encode_potential_loads(loads: list[Any]) -> bytes:
    """The /potential_loads body, formatted directly (the hot read path)."""
    return (
        "["
        + ",".join(
            [
                f'{{"worker_id":{w},"dp_rank":{r},"potential_prefill_tokens":{p},"potential_decode_blocks":{d},"active_requests":{a}}}'
                for w, r, p, d, a in loads
            ]
        )
        + "]"
    ).encode()


def potential_loads_json(registry: SlotRegistry, body: bytes) -> bytes:
    """POST /potential_loads from raw body to response bytes (shared by the route and the fast path)."""
    b: PotentialLoadsBody = decode_json(body, PotentialLoadsBody, allow_trailing=True)
    isl = _u64(b.new_isl_tokens, "new_isl_tokens")
    tenant = b.tenant()
    tracker = registry.get(b.model_name, tenant)
    if tracker is None:
        tracker = _core(lambda: registry.tracker(b.model_name, tenant))
    return encode_potential_loads(tracker.potential_loads(u64_path(b.sequence_hashes), isl))


def hot_routes(registry: SlotRegistry) -> dict[str, JsonHandler]:
    """The routes ``FastJsonRoutes`` answers before Starlette: POST /potential_loads (the routing read path).

    py-spy showed Starlette's router, middleware and Request/Response objects costing about as
    much as this handler (docs/bench/slot_tracker.md).
    """

    def potential_loads(body: bytes) -> tuple[int, bytes]:
        return 200, potential_loads_json(registry, body)

    return {"/potential_loads": potential_loads}


def tracker_routes(registry: SlotRegistry, replica_sync: ReplicaSync | None = None) -> list[BaseRoute]:
    """Every slot-tracker endpoint, for the standalone service and for the frontend's own port."""

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def register(request: Request) -> Response:
        b: RegisterBody = await _body(request, RegisterBody)
        tenant = b.tenant()
        _core(
            lambda: registry.register(
                _u64(b.worker_id, "worker_id"), b.model_name, tenant, b.block_size, b.dp_start, b.dp_size
            )
        )
        return ok(201)

    async def unregister(request: Request) -> Response:
        b: UnregisterBody = await _body(request, UnregisterBody)
        tenant = b.tenant()
        _core(lambda: registry.unregister(_u64(b.worker_id, "worker_id"), b.model_name, tenant))
        return ok(200)

    async def workers(request: Request) -> Response:
        model_name, tenant = _query_filters(request)
        return json_response(registry.workers(model_name, tenant))

    async def loads(request: Request) -> Response:
        model_name, tenant = _query_filters(request)
        return json_response(registry.loads(model_name, tenant))

    async def add(request: Request) -> Response:
        b: AddBody = await _body(request, AddBody)
        tenant = b.tenant()
        worker_id = _u64(b.worker_id, "worker_id")
        isl = _u64(b.new_isl_tokens, "new_isl_tokens")
        tracker = _core(lambda: registry.tracker(b.model_name, tenant))
        _core(lambda: tracker.add(b.request_id, worker_id, b.dp_rank, u64_path(b.sequence_hashes), isl))
        return ok(201)

    async def prefill_complete(request: Request) -> Response:
        b: RequestBody = await _body(request, RequestBody)
        tenant = b.tenant()
        tracker = _core(lambda: registry.tracker(b.model_name, tenant))
        _core(lambda: tracker.prefill_complete(b.request_id))
        return ok(200)

    async def free(request: Request) -> Response:
        b: RequestBody = await _body(request, RequestBody)
        tracker = _core(lambda: registry.tracker(b.model_name, b.tenant()))
        tracker.free(b.request_id)
        return ok(200)

    async def potential_loads(request: Request) -> Response:
        if not is_json_content_type(request.headers.get("content-type")):
            raise ApiError(415, "Expected request with `Content-Type: application/json`")
        return raw_json_response(potential_loads_json(registry, await read_body(request, BODY_LIMIT)))

    def _sync() -> ReplicaSync:
        if replica_sync is None:
            raise ApiError(409, "replica sync is disabled")
        return replica_sync

    async def register_peer(request: Request) -> Response:
        b: PeerBody = await _body(request, PeerBody)
        peer = b.peer()
        sync = _sync()
        added = _core(lambda: sync.add_peer(peer))
        return ok(201 if added else 200)

    async def deregister_peer(request: Request) -> Response:
        b: PeerBody = await _body(request, PeerBody)
        peer = b.peer()
        if not _sync().remove_peer(peer):
            raise ApiError(404, "peer not found")
        return ok(200)

    async def peers(request: Request) -> Response:
        return json_response([] if replica_sync is None else replica_sync.peers())

    routes: list[BaseRoute] = [
        route("/health", health, ["GET"]),
        route("/register", register, ["POST"]),
        route("/unregister", unregister, ["POST"]),
        route("/workers", workers, ["GET"]),
        route("/add", add, ["POST"]),
        route("/prefill_complete", prefill_complete, ["POST"]),
        route("/free", free, ["POST"]),
        route("/loads", loads, ["GET"]),
        route("/potential_loads", potential_loads, ["POST"]),
    ]
    for prefix in ("", "/replica_sync"):
        routes += [
            route(f"{prefix}/register_peer", register_peer, ["POST"]),
            route(f"{prefix}/deregister_peer", deregister_peer, ["POST"]),
            route(f"{prefix}/peers", peers, ["GET"]),
        ]
    return routes


def build_app(
    registry: SlotRegistry,
    replica_sync: ReplicaSync | None = None,
    sweep_interval: float | None = None,
    policy: AccessPolicy | None = None,
    drain: Drain | None = None,
) -> FastJsonRoutes:
    """The standalone service: tracker routes (the hot one answered by ``FastJsonRoutes`` first),
    stale sweeps, and replica sync started with the app; optionally behind an access policy
    (``ACCESS``) and a SIGTERM drain."""
    interval = sweep_interval if sweep_interval is not None else min(30.0, max(registry.expiry_secs / 10.0, 0.05))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(interval)
                registry.expire_stale()

        if replica_sync is not None:
            await replica_sync.start()
        task = asyncio.get_running_loop().create_task(sweep())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if replica_sync is not None:
                await replica_sync.stop()

    app = json_service(tracker_routes(registry, replica_sync) + [openapi_route(build_document())], lifespan=lifespan)
    app.router.redirect_slashes = False  # the reference answers 404 for /register/, not a redirect
    return FastJsonRoutes(protect(app, policy, drain), hot_routes(registry), BODY_LIMIT, policy=policy)


__all__ = ["build_app", "tracker_routes", "hot_routes", "potential_loads_json", "encode_potential_loads"]
