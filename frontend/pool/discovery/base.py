"""The discovery interface: where a backend delivers what it found.

A backend (static flags, workers file, Kubernetes EndpointSlices, etcd) owns one *source* name and
reports the complete current set of its workers whenever it changes; the worker pool
(``frontend.pool.workers.WorkerPool``) stays the single registry, so health checks, KV-event
subscriptions and slot-tracker registration follow from it exactly as for the admin API. Backends
that can also find the other frontend replicas report their replica-sync endpoints the same way.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from frontend.pool.workers import WorkerPool, WorkerSpec

log = logging.getLogger("frontend.pool.discovery")

# reconnect / relist backoff of the watching backends: bounded, so a flapping store is not hammered
BACKOFF_MIN = 0.2
BACKOFF_MAX = 5.0


def next_backoff(delay: float) -> float:
    return min(BACKOFF_MAX, max(BACKOFF_MIN, delay * 2))


class DiscoveryTarget:
    """What backends write to: the worker pool, per-model tokenizer paths and replica-sync peers."""

    def __init__(self, pool: WorkerPool, model_paths: dict[str, str], replica_sync: Any = None) -> None:
        self.pool = pool
        self.model_paths = model_paths
        self.replica_sync = replica_sync
        self._peers: dict[str, set[str]] = {}  # source -> peers it connected

    def set_workers(self, source: str, specs: Sequence[WorkerSpec]) -> None:
        """Make the workers owned by ``source`` exactly ``specs`` (added, replaced, removed)."""
        self.pool.sync_source(source, list(specs))

    def set_model_paths(self, models: dict[str, dict[str, Any]]) -> None:
        for name, conf in models.items():
            if isinstance(conf, dict) and conf.get("model_path"):
                self.model_paths[name] = str(conf["model_path"])

    def set_peers(self, source: str, endpoints: Iterable[str]) -> None:
        """Connect replica sync to exactly these discovered peers (hand-listed peers are left alone)."""
        sync = self.replica_sync
        if sync is None:
            return
        from slot_tracker.core import SlotTrackerError

        wanted = set(endpoints)
        have = self._peers.setdefault(source, set())
        for ep in sorted(have - wanted):
            sync.remove_peer(ep)
            have.discard(ep)
            log.info("replica peer %s left (%s)", ep, source)
        for ep in sorted(wanted - have):
            try:
                added = sync.add_peer(ep)
            except SlotTrackerError as exc:  # our own endpoint, or not a usable one
                log.debug("replica peer %s skipped: %s", ep, exc)
                continue
            if added:
                have.add(ep)
                log.info("replica peer %s joined (%s)", ep, source)


class DiscoveryBackend(abc.ABC):
    """One source of workers. ``start`` returns once the backend runs (it may keep watching)."""

    name: str = "?"
    source: str = "?"

    def prepare(self) -> None:
        """Checks before the server starts (credentials, config); ValueError with a message for the CLI."""
        return None

    @abc.abstractmethod
    async def start(self, target: DiscoveryTarget) -> None: ...

    async def stop(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        """For ``GET /admin/workers``: what the backend watches and its last error."""
        return {"backend": self.name}


def call_safely(fn: Callable[[], None], what: str) -> None:
    """Apply a discovery result; a bug in one update must not stop the watcher."""
    try:
        fn()
    except Exception:
        log.exception("discovery: applying %s failed", what)
