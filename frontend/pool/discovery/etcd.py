"""``--discovery etcd``: workers and frontend replicas register under a prefix with a lease.

Layout under ``--discovery-prefix`` (default ``/kvroute/``):

- ``workers/<id>``: a worker spec as JSON (the ``--worker`` fields), put by the worker or its
  sidecar (``python -m frontend register``) with a lease it keeps alive. When the process dies the
  lease expires (``--discovery-lease-ttl``) and the key goes with it.
- ``peers/<name>``: ``{"endpoint": "tcp://host:port"}``, a frontend's replica-sync PUB endpoint, put
  the same way by every frontend started with ``--router-replica-sync``.

Frontends list the prefix, then watch it from the listed revision; a broken or compacted watch
(etcd restarted, network) relists after a bounded backoff. While etcd is unreachable the last
known workers stay (their own health checks still apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from frontend.pool.discovery.base import BACKOFF_MIN, DiscoveryBackend, DiscoveryTarget, call_safely, next_backoff
from frontend.pool.discovery.etcd_client import EtcdClient, EtcdError, WatchCompacted
from frontend.pool.workers import WorkerSpec

log = logging.getLogger("frontend.pool.discovery.etcd")

DEFAULT_PREFIX = "/kvroute/"
DEFAULT_LEASE_TTL = 10
WORKERS = "workers/"
PEERS = "peers/"


def normalize_prefix(prefix: str) -> str:
    prefix = prefix.strip()
    if not prefix:
        raise ValueError("--discovery-prefix must not be empty")
    return prefix if prefix.endswith("/") else prefix + "/"


def _start_once(task: asyncio.Task | None, run: Any) -> asyncio.Task:
    """The background loop of a registration or a watch: started once, however often asked."""
    return task if task is not None else asyncio.get_running_loop().create_task(run())


async def _cancel(task: asyncio.Task | None) -> None:
    """Stop a background loop and wait until it has stopped."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class EtcdRegistration:
    """Keep one key alive under a lease: grant, put, refresh every TTL/3; re-register when lost.

    etcd being down only delays refreshes (the lease survives a restart); a lease that expired in
    the meantime is granted again and the key put again.
    """

    def __init__(self, client: EtcdClient, key: str, value: str, ttl: int) -> None:
        if ttl < 2:
            raise ValueError("--discovery-lease-ttl must be >= 2 seconds")
        self.client, self.key, self.value, self.ttl = client, key, value, ttl
        self.lease = 0
        self.registered = asyncio.Event()
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    async def _register(self) -> None:
        self.lease = await self.client.grant(self.ttl)
        await self.client.put(self.key, self.value, lease=self.lease)
        self.registered.set()
        self.last_error = None
        log.info("registered %s (lease %x, ttl %ss)", self.key, self.lease, self.ttl)

    async def run(self) -> None:
        delay = BACKOFF_MIN
        while True:
            try:
                if not self.lease:
                    await self._register()
                await asyncio.sleep(self.ttl / 3)
                if await self.client.keepalive(self.lease) <= 0:
                    log.warning("lease of %s expired: registering again", self.key)
                    self.lease = 0
                    self.registered.clear()
                    continue
                delay = BACKOFF_MIN
            except asyncio.CancelledError:
                raise
            except (EtcdError, ValueError, KeyError) as exc:
                self.last_error = str(exc)
                log.warning("etcd registration of %s: %s (retrying in %.1fs)", self.key, exc, delay)
                await asyncio.sleep(delay)
                delay = next_backoff(delay)

    def start(self) -> None:
        self._task = _start_once(self._task, self.run)

    async def stop(self) -> None:
        """Leave at once (revoke the lease) instead of waiting for it to expire."""
        await _cancel(self._task)
        self._task = None
        if self.lease:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self.lease)
            self.lease = 0


class PrefixWatch:
    """The current ``{key: value}`` under a prefix: list, watch from that revision, relist on failure."""

    def __init__(self, client: EtcdClient, prefix: str, on_change) -> None:
        self.client, self.prefix, self.on_change = client, prefix, on_change
        self.items: dict[str, bytes] = {}
        self.relists = 0
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    async def run(self) -> None:
        delay = BACKOFF_MIN
        while True:
            try:
                revision, items = await self.client.get_prefix(self.prefix)
                self.relists += 1
                self.items = items
                self.on_change(self.items)
                self.last_error = None
                delay = BACKOFF_MIN
                async for ev in self.client.watch_prefix(self.prefix, revision + 1):
                    if ev.kind == "put":
                        self.items[ev.key] = ev.value
                    else:
                        self.items.pop(ev.key, None)
                    self.on_change(self.items)
                self.last_error = "watch closed by etcd"
            except asyncio.CancelledError:
                raise
            except WatchCompacted as exc:
                self.last_error = str(exc)
                log.info("etcd watch of %s: %s: relisting", self.prefix, exc)
                continue
            except Exception as exc:  # httpx errors, etcd errors: the store is away, keep the last view
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("etcd watch of %s broke: %s (relisting in %.1fs)", self.prefix, self.last_error, delay)
            await asyncio.sleep(delay)
            delay = next_backoff(delay)

    def start(self) -> None:
        self._task = _start_once(self._task, self.run)

    async def stop(self) -> None:
        await _cancel(self._task)
        self._task = None


def parse_worker_entries(items: dict[str, bytes], prefix: str) -> list[WorkerSpec]:
    """Worker specs of the ``workers/`` keys; a bad entry is logged and skipped, never fatal."""
    specs: dict[int, WorkerSpec] = {}
    for key, raw in sorted(items.items()):
        try:
            doc = json.loads(raw)
            spec = WorkerSpec.from_mapping(doc)
        except (ValueError, TypeError) as exc:
            log.warning("etcd: ignoring %s: %s", key, exc)
            continue
        if spec.id in specs:
            log.warning("etcd: ignoring %s: worker id %s registered twice", key, spec.id)
            continue
        specs[spec.id] = spec
    return list(specs.values())


def parse_peer_entries(items: dict[str, bytes]) -> list[str]:
    out = []
    for key, raw in items.items():
        try:
            endpoint = json.loads(raw)["endpoint"]
        except (ValueError, TypeError, KeyError):
            log.warning("etcd: ignoring peer entry %s", key)
            continue
        if isinstance(endpoint, str):
            out.append(endpoint)
    return out


class EtcdDiscovery(DiscoveryBackend):
    """Workers from ``<prefix>workers/``; with replica sync, peers from ``<prefix>peers/`` and our own entry there."""

    name = "etcd"
    source = "etcd"

    def __init__(
        self,
        endpoints: list[str],
        prefix: str = DEFAULT_PREFIX,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        peer_endpoint: str | None = None,
        peer_name: str | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.prefix = normalize_prefix(prefix)
        self.lease_ttl = lease_ttl
        self.peer_endpoint = peer_endpoint
        self.peer_name = peer_name
        self.client: EtcdClient | None = None
        self.workers: PrefixWatch | None = None
        self.peers: PrefixWatch | None = None
        self.registration: EtcdRegistration | None = None

    async def start(self, target: DiscoveryTarget) -> None:
        self.client = EtcdClient(self.endpoints)
        wp = self.prefix + WORKERS

        def workers_changed(items: dict[str, bytes]) -> None:
            call_safely(lambda: target.set_workers(self.source, parse_worker_entries(items, wp)), "etcd workers")

        self.workers = PrefixWatch(self.client, wp, workers_changed)
        self.workers.start()
        if self.peer_endpoint and target.replica_sync is not None:
            pp = self.prefix + PEERS
            self.peers = PrefixWatch(
                self.client,
                pp,
                lambda items: call_safely(
                    lambda: target.set_peers(self.source, parse_peer_entries(items)), "etcd peers"
                ),
            )
            self.peers.start()
            name = self.peer_name or f"{target.replica_sync.router_id:016x}"
            self.registration = EtcdRegistration(
                self.client, pp + name, json.dumps({"endpoint": self.peer_endpoint}), self.lease_ttl
            )
            self.registration.start()

    async def stop(self) -> None:
        for part in (self.registration, self.peers, self.workers):
            if part is not None:
                await part.stop()
        if self.client is not None:
            await self.client.aclose()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "endpoints": self.endpoints, "prefix": self.prefix}
        if self.workers is not None:
            out["watch"] = {
                "keys": len(self.workers.items),
                "relists": self.workers.relists,
                "last_error": self.workers.last_error,
            }
        if self.registration is not None:
            out["peer_registration"] = {
                "key": self.registration.key,
                "endpoint": self.peer_endpoint,
                "registered": self.registration.registered.is_set(),
                "last_error": self.registration.last_error,
            }
        return out


async def register_worker(endpoints: list[str], prefix: str, ttl: int, spec: WorkerSpec, stop: asyncio.Event) -> None:
    """``python -m frontend register``: keep ``spec`` under ``<prefix>workers/<id>`` until ``stop`` is set."""
    client = EtcdClient(endpoints)
    reg = EtcdRegistration(client, normalize_prefix(prefix) + WORKERS + str(spec.id), json.dumps(spec.to_dict()), ttl)
    reg.start()
    try:
        await stop.wait()
    finally:
        await reg.stop()
        await client.aclose()
