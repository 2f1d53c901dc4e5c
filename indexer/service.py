"""HTTP API of the indexer (the document's routes and the reference's statuses), JSON errors everywhere.

``indexer_routes(registry, peers)`` gives the routes so the frontend can serve them on its own
port; ``build_app`` wraps them into the standalone service's Starlette app with /metrics, behind
``kvroute_common.fast_http.FastJsonRoutes`` answering the two query routes (``hot_routes``)
first. ``overlap_payload`` is the /query answer, shared by whoever serves it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import orjson
import xxhash
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from indexer.core import KvIndex
from indexer.openapi import build_document
from indexer.registry import DEFAULT_TENANT, IndexerRegistry, RegistryError
from indexer.requests import PeerRequest, QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest
from kvroute_common.constants import U64_MAX
from kvroute_common.drain import Drain
from kvroute_common.fast_http import FastJsonRoutes, JsonHandler, protect
from kvroute_common.hashing import hash_seed, pack_tokens
from kvroute_common.http import (
    ApiError,
    MiB,
    decode_json,
    error_response,
    json_response,
    json_service,
    ok,
    raw_json_response,
    read_json,
)
from kvroute_common.openapi import openapi_route
from kvroute_common.security import AccessPolicy, service_classifier

_xxh3 = xxhash.xxh3_64_intdigest

QUERY_BODY_LIMIT = 8 * MiB
BODY_LIMIT = 2 * MiB
ACCESS = service_classifier(["/query", "/query_by_hash"])
"""Who may call what with tokens set: reads (GET, the queries) need an API key, writes the admin token."""


def tenant_of(tenant_id: str | None, routing_group: str | None) -> str:
    """The document's ``tenant_id``; 1.6.1's ``routing_group`` is accepted as an alias."""
    if tenant_id is not None:
        return tenant_id
    if routing_group is not None:
        return routing_group
    return DEFAULT_TENANT


def overlap_payload(index: KvIndex, local_hashes: list[int]) -> dict[str, Any]:
    """The /query answer: device scores per instance and DP rank, plus the per-tier breakdown (tokens)."""
    if not index.has_lower_tiers():
        return _device_payload(index.find_matches(local_hashes), index.block_size)
    return _tier_payload(index.tier_matches(local_hashes), index.block_size)


def _device_payload(matches: dict[tuple[int, int], int], bs: int) -> dict[str, Any]:
    """overlap_payload's answer when no worker holds lower-tier blocks (every tier figure is the device one),
    built in one pass: with few workers, building the answer was a sixth of the query's own work."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for (worker_id, dp_rank), device in matches.items():
        wid, rank, tokens = str(worker_id), str(dp_rank), device * bs
        if device:
            ranks = scores.get(wid)
            if ranks is None:
                scores[wid] = {rank: tokens}
            else:
                ranks[rank] = tokens
        inst = instances.get(wid)
        if inst is None:
            instances[wid] = {
                "longest_matched": tokens,
                "gpu": tokens,
                "dp": {rank: tokens},
                "cpu": tokens,
                "disk": tokens,
            }
        else:
            inst["dp"][rank] = tokens
            if tokens > inst["gpu"]:
                inst["longest_matched"] = inst["gpu"] = inst["cpu"] = inst["disk"] = tokens
    return {"scores": scores, "frequencies": [], "instances": instances}


def _tier_payload(matches: dict[tuple[int, int], tuple[int, int, int]], bs: int) -> dict[str, Any]:
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for (worker_id, dp_rank), (device, cpu, disk) in matches.items():
        wid, rank = str(worker_id), str(dp_rank)
        if device:
            scores.setdefault(wid, {})[rank] = device * bs
        inst = instances.get(wid)
        if inst is None:
            inst = instances[wid] = {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
        inst["dp"][rank] = device * bs
        if device * bs > inst["gpu"]:
            inst["gpu"] = device * bs
        if cpu * bs > inst["cpu"]:
            inst["cpu"] = cpu * bs
        if disk * bs > inst["disk"]:
            inst["disk"] = disk * bs
    for inst in instances.values():
        inst["longest_matched"] = max(inst["gpu"], inst["cpu"], inst["disk"])
    return {"scores": scores, "frequencies": [], "instances": instances}


class QueryHashes:
    """A /query's local block hashes (``local_block_hashes`` of its tokens), computed as the match
    walk asks for them (``KvIndex.find_matches_lazy``).

    Why: the walk stops at the first block nobody holds; on short shared prefixes that is a
    quarter of a 1024-token prompt, and hashing the rest was a sixth of the query's CPU. Every
    token is still packed and range-checked up front, so a bad token fails the whole query.
    """

    __slots__ = ("hashes", "total", "_view", "_step", "_seed")

    def __init__(self, tokens: list[int], block_size: int, lora_name: str | None, cache_salt: str | None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be greater than 0")
        data = pack_tokens(tokens)  # ValueError for an id outside u32, as local_block_hashes
        self._view = memoryview(data)
        self._step = block_size * 4
        self._seed = hash_seed(lora_name, cache_salt)
        self.total = len(data) // self._step
        self.hashes: list[int] = []

    def fill(self, k: int) -> None:
        hashes = self.hashes
        have = len(hashes)
        if k <= have:
            return
        if k > self.total:
            k = self.total
        step, view, seed = self._step, self._view, self._seed
        hashes.extend([_xxh3(view[i : i + step], seed) for i in range(have * step, k * step, step)])


def answer_query(registry: IndexerRegistry, req: QueryRequest) -> bytes:
    """/query: hash the tokens with the partition's block size (and LoRA / cache salt), then match."""
    part = registry.partition(req.model_name, tenant_of(req.tenant_id, req.routing_group))
    try:
        query = QueryHashes(req.token_ids, part.block_size, req.lora_name, req.cache_salt or None)
    except ValueError as exc:
        raise ApiError(422, f"Failed to deserialize the JSON body into the target type: {exc}") from None
    index = part.index
    if not index.has_lower_tiers():
        return orjson.dumps(_device_payload(index.find_matches_lazy(query), index.block_size))
    query.fill(query.total)
    return orjson.dumps(overlap_payload(index, query.hashes))


def answer_query_by_hash(registry: IndexerRegistry, req: QueryByHashRequest) -> bytes:
    """/query_by_hash: local hashes as signed i64 (the engines' u64 reinterpreted)."""
    if req.cache_salt is not None:
        raise ApiError(
            400,
            "cache_salt is not accepted by /query_by_hash; block_hashes must already include the intended cache salt",
        )
    part = registry.partition(req.model_name, tenant_of(req.tenant_id, req.routing_group))
    local = [h & U64_MAX for h in req.block_hashes]
    return orjson.dumps(overlap_payload(part.index, local))


def query_handlers(registry: Callable[[], IndexerRegistry | None]) -> dict[str, Handler]:
    """``POST /query`` and ``/query_by_hash`` over ``registry()``: the standalone indexer's, and what a
    frontend with ``--serve-indexer`` serves over its embedded index (None: nothing indexed yet, 404)."""

    def current() -> IndexerRegistry:
        reg = registry()
        if reg is None:
            raise ApiError(404, "no index here yet: no worker with KV events has been attached")
        return reg

    async def query(request: Request) -> Response:
        req = await read_json(request, QueryRequest, QUERY_BODY_LIMIT)
        return raw_json_response(answer_query(current(), req))

    async def query_by_hash(request: Request) -> Response:
        req = await read_json(request, QueryByHashRequest, QUERY_BODY_LIMIT)
        return raw_json_response(answer_query_by_hash(current(), req))

    return {"/query": query, "/query_by_hash": query_by_hash}


class PeerList:
    """Peer indexers (used for start-up recovery only, as in the reference)."""

    def __init__(self, urls: Iterable[str] = ()) -> None:
        self.urls: list[str] = []
        for u in urls:
            self.add(u)

    def add(self, url: str) -> None:
        if url not in self.urls:
            self.urls.append(url)

    def remove(self, url: str) -> bool:
        if url in self.urls:
            self.urls.remove(url)
            return True
        return False


class Metrics:
    """The document's ``dynamo_kvindexer_*`` metrics in a private prometheus registry."""

    def __init__(self, registry: IndexerRegistry) -> None:
        self.prom = CollectorRegistry(auto_describe=True)
        buckets = [0.0001 * 2**i for i in range(20)]
        self.duration = Histogram(
            "dynamo_kvindexer_request_duration_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=buckets,
            registry=self.prom,
        )
        self.requests = Counter(
            "dynamo_kvindexer_requests", "Total HTTP requests", ["endpoint", "method"], registry=self.prom
        )
        self.errors = Counter(
            "dynamo_kvindexer_errors", "HTTP error responses", ["endpoint", "status_class"], registry=self.prom
        )
        self.prom.register(_StateCollector(registry))
        self._bound: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        bound = self._bound.get((endpoint, method))
        if bound is None:  # labels() is a locked dict lookup: bind once per route
            bound = self._bound[(endpoint, method)] = (
                self.duration.labels(endpoint),
                self.requests.labels(endpoint, method),
            )
        bound[0].observe(seconds)
        bound[1].inc()
        if status >= 400:
            self.errors.labels(endpoint, f"{status // 100}xx").inc()

    def render(self) -> Response:
        return Response(generate_latest(self.prom), media_type=CONTENT_TYPE_LATEST)


class _StateCollector:
    """Gauges read from the registry at scrape time."""

    def __init__(self, registry: IndexerRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        reg = self.registry
        yield GaugeMetricFamily(
            "dynamo_kvindexer_models", "Number of active model+tenant indexers", value=len(reg.partitions)
        )
        yield GaugeMetricFamily(
            "dynamo_kvindexer_workers", "Number of registered worker instances", value=len(reg.instances)
        )
        listeners = GaugeMetricFamily("dynamo_kvindexer_listeners", "ZMQ listeners by status", labels=["status"])
        for status, n in reg.listener_status_counts().items():
            listeners.add_metric([status], n)
        yield listeners
        applied = GaugeMetricFamily(
            "dynamo_kvrouter_kv_cache_events_applied",
            "KV events processed by type and outcome",
            labels=["event_type", "status"],
        )
        for (event_type, status), n in sorted(reg.event_counters.items()):
            applied.add_metric([event_type, status], n)
        yield applied
        blocks = GaugeMetricFamily(
            "dynamo_kvindexer_blocks", "Device (worker, block) entries per partition", labels=["model", "tenant_id"]
        )
        for (model, tenant), part in reg.partitions.items():
            blocks.add_metric([model, tenant], part.index.size)
        yield blocks
        yield from reg.health_metrics()


Handler = Callable[[Request], Awaitable[Response]]


def indexer_routes(registry: IndexerRegistry, peers: PeerList, metrics: Metrics | None = None) -> list[BaseRoute]:
    """The indexer's HTTP routes (without /metrics and /health, which the embedding app owns)."""

    def route(path: str, handler: Handler, method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            try:
                response = await handler(request)
            except ApiError as exc:
                response = error_response(exc.status, exc.message)
            except RegistryError as exc:
                response = error_response(exc.status, exc.message)
            if metrics is not None:
                metrics.observe(path, method, response.status_code, time.perf_counter() - start)
            return response

        return Route(path, endpoint, methods=[method])

    async def register(request: Request) -> Response:
        req = await read_json(request, RegisterRequest, BODY_LIMIT)
        registry.register(
            req.instance_id,
            req.endpoint,
            req.model_name,
            tenant_of(req.tenant_id, req.routing_group),
            req.block_size,
            req.dp_rank,
            req.replay_endpoint,
        )
        return ok(201)

    async def unregister(request: Request) -> Response:
        req = await read_json(request, UnregisterRequest, BODY_LIMIT)
        tenant = req.tenant_id if req.tenant_id is not None else req.routing_group
        await registry.unregister(req.instance_id, req.model_name, tenant, req.dp_rank)
        return ok(200)

    async def workers(request: Request) -> Response:
        q = request.query_params
        tenant = q.get("tenant_id") or q.get("routing_group")
        return json_response(registry.workers(q.get("model_name"), tenant))

    async def dump(request: Request) -> Response:
        return raw_json_response(orjson.dumps(registry.dump()))

    async def register_peer(request: Request) -> Response:
        req = await read_json(request, PeerRequest, BODY_LIMIT)
        peers.add(req.url.rstrip("/"))
        return ok(201)

    async def deregister_peer(request: Request) -> Response:
        req = await read_json(request, PeerRequest, BODY_LIMIT)
        if not peers.remove(req.url.rstrip("/")):
            raise ApiError(404, "peer not found")
        return ok(200)

    async def list_peers(request: Request) -> Response:
        return json_response(peers.urls)

    async def reopen_logs(request: Request) -> Response:
        return ok(200)

    return [
        route("/register", register, "POST"),
        route("/unregister", unregister, "POST"),
        route("/workers", workers, "GET"),
        *(route(path, handler, "POST") for path, handler in query_handlers(lambda: registry).items()),
        route("/dump", dump, "GET"),
        route("/register_peer", register_peer, "POST"),
        route("/deregister_peer", deregister_peer, "POST"),
        route("/peers", list_peers, "GET"),
        route("/reopen_logs", reopen_logs, "POST"),
    ]


def hot_routes(registry: IndexerRegistry) -> dict[str, JsonHandler]:
    """The two query routes, answered by ``kvroute_common.fast_http.FastJsonRoutes`` before Starlette.

    Same validation, statuses and bodies as the Starlette routes, without the Request, the route
    table and the exception middleware: that framework work was most of a query's cost
    (docs/bench/indexer.md).
    """

    def query(body: bytes) -> tuple[int, bytes]:
        return 200, answer_query(registry, decode_json(body, QueryRequest))

    def query_by_hash(body: bytes) -> tuple[int, bytes]:
        return 200, answer_query_by_hash(registry, decode_json(body, QueryByHashRequest))

    return {"/query": query, "/query_by_hash": query_by_hash}


def build_app(
    registry: IndexerRegistry,
    peers: PeerList | None = None,
    policy: AccessPolicy | None = None,
    drain: Drain | None = None,
) -> FastJsonRoutes:
    """The standalone service's ASGI app: the indexer routes plus /health and /metrics, the query
    routes answered first by ``FastJsonRoutes``; the registry's listeners stop with the app.
    Optionally behind an access policy (``ACCESS``) and a SIGTERM drain."""
    peers = peers if peers is not None else PeerList()
    metrics = Metrics(registry)

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def metrics_route(request: Request) -> Response:
        return metrics.render()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await registry.close()

    def observe(path: str, status: int, seconds: float) -> None:
        metrics.observe(path, "POST", status, seconds)

    routes = indexer_routes(registry, peers, metrics)

    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        openapi_route(build_document()),
    ]
    app = json_service(routes, lifespan=lifespan)
    app.state.registry = registry
    app.state.peers = peers
    app.state.metrics = metrics
    return FastJsonRoutes(protect(app, policy, drain), hot_routes(registry), QUERY_BODY_LIMIT, observe, policy=policy)
