"""Overlaps from remote indexers instead of an embedded index (``--use-remote-indexer URL[,URL...]``).

A fleet's frontends need not each ingest every worker's KV events: one or more indexer processes
(``python -m indexer``, or frontends started with ``--serve-indexer``) do, and a frontend asks them
for each routing decision. Several URLs are *shards*: each indexes a subset of the workers
(partitioned by worker id), so the answers are merged, per (worker, DP rank), into what one index
over all the events would say (a worker indexed by two shards counts its longer match).

With ``--remote-indexer-register`` the frontends are the shards' control plane: every worker they
discover (with its KV-event endpoints, read from the engine for workers given by URL) is registered
on shard ``worker_id % shards``, and registrations are re-asserted every few seconds, so a shard that
restarts empty is told its workers again (and recovers their blocks from ``--peers`` or new events).

One round trip per decision and shard, on a persistent connection, all shards at once: the prompt's
local block hashes are sent (``POST /query_by_hash``, signed i64 as the indexer's API takes them)
through the request path's own HTTP client (``frontend.dispatch.upstream``: one socket write per query, the
answer parsed in C); httpx, whose Python per request cost as much as the rest of a decision, is
kept for the control plane (registrations).
A shard that does not answer in time, or fails, makes this decision load-only (no overlaps at all:
partial overlaps would favour the shards that answered); the failure is counted per indexer and the
routing record says which source its overlaps came from.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import numpy as np
import orjson
from prometheus_client import CollectorRegistry, Counter

from frontend.dispatch.upstream import UpstreamError, UpstreamPool
from kvroute_common.constants import DEFAULT_TENANT

log = logging.getLogger("frontend.routing.remote_index")

DEFAULT_TIMEOUT = 0.25  # seconds: a decision waits at most this long for the slowest shard
REMOTE = "remote"
REMOTE_UNAVAILABLE = "remote_unavailable"


class RemoteIndexers:
    """The shards a frontend routes on; ``overlaps`` is its one call per decision."""

    def __init__(
        self,
        urls: list[str],
        registry: CollectorRegistry,
        timeout: float = DEFAULT_TIMEOUT,
        register: bool = False,
        token: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("--use-remote-indexer needs at least one URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.register = register  # --remote-indexer-register: assign workers to shards by id
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        # the deployment's token (the frontend's admin token, else its API key), as the indexers check it
        headers = {"authorization": f"Bearer {token}"} if token else None
        self._clients = [
            httpx.AsyncClient(base_url=u, timeout=timeout, limits=limits, headers=headers) for u in self.urls
        ]
        # the per-decision queries: the whole query is bounded by ``timeout`` (connecting included)
        self._pools = [UpstreamPool(u) for u in self.urls]
        self._query_headers = [("content-type", "application/json"), *(headers or {}).items()]
        self.queries = Counter(
            "kvroute_remote_indexer_queries",
            "Overlap queries sent to each remote indexer",
            ("indexer",),
            registry=registry,
        )
        self.failures = Counter(
            "dynamo_component_router_remote_indexer_query_failures",
            "Overlap queries to a remote indexer that failed or timed out (the decision was routed by load alone)",
            ("indexer",),
            registry=registry,
        )
        self.load_only = Counter(
            "kvroute_remote_indexer_load_only_decisions",
            "Routing decisions made without overlaps because a remote indexer did not answer",
            registry=registry,
        )

    async def overlaps(
        self, model: str, local_hashes: list[int] | np.ndarray, block_size: int, tenant: str = DEFAULT_TENANT
    ) -> dict[tuple[int, int], int] | None:
        """Matched blocks per (worker, DP rank) over every shard; None when a shard did not answer.
        ``local_hashes``: u64 values (a long prompt's come as an array built off the event loop)."""
        if len(local_hashes) == 0:
            return {}
        # u64 -> the i64 the API takes, in C (a long prompt's hashes are never looped over here)
        hashes = np.asarray(local_hashes, dtype=np.uint64).view(np.int64)
        body = orjson.dumps(
            {"block_hashes": hashes, "model_name": model, "tenant_id": tenant}, option=orjson.OPT_SERIALIZE_NUMPY
        )
        if len(self._pools) == 1:
            answers = [await self._query(0, body)]
        else:
            answers = await asyncio.gather(*(self._query(i, body) for i in range(len(self._pools))))
        if any(a is None for a in answers):
            self.load_only.inc()
            return None
        merged: dict[tuple[int, int], int] = {}
        for scores in answers:
            assert scores is not None
            for wid, ranks in scores.items():
                for rank, tokens in ranks.items():
                    key = (int(wid), int(rank))
                    blocks = int(tokens) // block_size
                    if blocks > merged.get(key, 0):
                        merged[key] = blocks
        return merged

    async def _query(self, i: int, body: bytes) -> dict[str, Any] | None:
        url = self.urls[i]
        self.queries.labels(url).inc()
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self._pools[i].request("POST", "/query_by_hash", body, self._query_headers)
            if resp.status == 404:  # the model is not (yet) known there: nothing cached
                return {}
            if resp.status != 200:
                raise ValueError(f"status {resp.status}: {resp.content[:200]!r}")
            scores = orjson.loads(resp.content).get("scores")
            if not isinstance(scores, dict):
                raise ValueError("no scores in the answer")
            return scores
        except TimeoutError:
            self.failures.labels(url).inc()
            log.warning(
                "remote indexer %s: no answer within %s s (this decision is routed by load alone)", url, self.timeout
            )
            return None
        except (UpstreamError, ValueError, orjson.JSONDecodeError) as exc:
            self.failures.labels(url).inc()
            log.warning(
                "remote indexer %s: %s: %s (this decision is routed by load alone)", url, type(exc).__name__, exc
            )
            return None

    async def engine_restarts(self) -> dict[tuple[str, int, int], int]:
        """Engine restarts each shard's KV listeners have seen: (shard URL, worker, DP rank) -> count (a count
        is the listener's: a shard that restarts counts from 0 again). A shard that does not answer, or
        does not report restarts (the reference indexer), adds nothing."""
        results = await asyncio.gather(*(self._restarts(i) for i in range(len(self.urls))))
        return {key: n for rows in results for key, n in rows}

    async def _restarts(self, i: int) -> list[tuple[tuple[str, int, int], int]]:
        url = self.urls[i]
        try:
            resp = await self._clients[i].get("/workers", timeout=max(self.timeout, 2.0))
            rows = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("remote indexer %s: reading its workers: %s", url, exc)
            return []
        out = []
        for row in rows if isinstance(rows, list) else ():
            listeners = row.get("listeners") if isinstance(row, dict) else None
            if not isinstance(listeners, dict) or not isinstance(row.get("instance_id"), int):
                continue
            for rank, info in listeners.items():
                n = info.get("engine_restarts") if isinstance(info, dict) else None
                if isinstance(n, int) and str(rank).isdigit():
                    out.append(((url, row["instance_id"], int(rank)), n))
        return out

    def shard_of(self, worker_id: int) -> str:
        return self.urls[worker_id % len(self.urls)]

    async def ensure_registered(
        self, worker_id: int, model: str, block_size: int, streams: list[tuple[int, str, str | None]]
    ) -> bool:
        """Register ``streams`` = [(dp_rank, endpoint, replay endpoint)] of a worker on its shard; a
        stream already registered there is fine. False when the shard could not be told."""
        i = worker_id % len(self.urls)
        ok = True
        for rank, endpoint, replay in streams:
            body = {
                "instance_id": worker_id,
                "endpoint": endpoint,
                "model_name": model,
                "block_size": block_size,
                "dp_rank": rank,
                "replay_endpoint": replay,
            }
            try:
                resp = await self._clients[i].post("/register", json=body, timeout=max(self.timeout, 2.0))
            except httpx.HTTPError as exc:
                log.warning("remote indexer %s: registering worker %s: %s", self.urls[i], worker_id, exc)
                ok = False
                continue
            if resp.status_code not in (200, 201, 409):  # 409: already registered there
                log.warning(
                    "remote indexer %s refused worker %s rank %s: %s %s",
                    self.urls[i],
                    worker_id,
                    rank,
                    resp.status_code,
                    resp.text[:200],
                )
                ok = False
        return ok

    async def unregister(self, worker_id: int, model: str) -> None:
        i = worker_id % len(self.urls)
        body = {"instance_id": worker_id, "model_name": model}
        try:
            await self._clients[i].post("/unregister", json=body, timeout=max(self.timeout, 2.0))
        except httpx.HTTPError as exc:
            log.warning("remote indexer %s: unregistering worker %s: %s", self.urls[i], worker_id, exc)

    async def close(self) -> None:
        await asyncio.gather(
            *(c.aclose() for c in self._clients), *(p.aclose() for p in self._pools), return_exceptions=True
        )
