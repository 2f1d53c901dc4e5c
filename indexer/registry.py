"""IndexerRegistry: partitions (model_name, tenant_id) -> KvIndex, plus the ZMQ listeners feeding them.

Shared by the standalone service (``python -m indexer``) and the frontend, which embeds it. All
methods run on one asyncio loop (register starts a listener task on the running loop).

Rules follow the reference indexer's registry: the first registration of a partition fixes its
block size; an instance lives in one partition; unregistering without a tenant removes the whole
instance (every DP rank, every tier); the partition disappears with its last instance.
Sequence watermarks survive unregister/register (the document: a re-registered worker replays
the batches it missed on its first batch).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from indexer.core import KvIndex, apply_router_event
from indexer.lag import LagHistogram
from indexer.listener import ACTIVE, FAILED, PAUSED, PENDING, Listener, SequenceState, validate_endpoint
from indexer.normalize import EventApplier
from kvroute_common.constants import DEFAULT_TENANT
from kvroute_common.errors import ServiceError

log = logging.getLogger("indexer.registry")

_STATUS_PRIORITY = (FAILED, PENDING, ACTIVE, PAUSED)


class RegistryError(ServiceError):
    """A refused registry operation: ``status`` is the HTTP status the services answer with."""


@dataclass
class Partition:
    model_name: str
    tenant_id: str
    index: KvIndex

    @property
    def block_size(self) -> int:
        return self.index.block_size


@dataclass
class Instance:
    instance_id: int
    model_name: str
    tenant_id: str
    listeners: dict[int, Listener] = field(default_factory=dict)

    def status(self) -> str:
        statuses = {lst.status for lst in self.listeners.values()}
        for s in _STATUS_PRIORITY:
            if s in statuses:
                return s
        return ACTIVE


def _where(model_name: str, tenant_id: str) -> str:
    return f"model={model_name} tenant_id={tenant_id}"


class IndexerRegistry:
    """The indexer's state: partitions, registered instances, listeners and sequence watermarks."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        ready: asyncio.Event | None = None,
    ) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.replay_timeout = replay_timeout
        self.ready = ready  # None = listeners drain immediately
        self.partitions: dict[tuple[str, str], Partition] = {}
        self.instances: dict[int, Instance] = {}
        self._seq_states: dict[tuple[int, int], SequenceState] = {}
        self.event_counters: dict[tuple[str, str], int] = {}
        self.on_change: Callable[[], None] | None = None
        # (instance_id, dp_rank) whose listener saw a restarted engine (a new process on the same endpoint)
        self.on_restart: Callable[[int, int], None] | None = None
        self.apply_lag = LagHistogram()  # every listener's batches

    # -- partitions

    def index(self, model_name: str, tenant_id: str = DEFAULT_TENANT) -> KvIndex | None:
        part = self.partitions.get((model_name, tenant_id))
        return part.index if part is not None else None

    def partition(self, model_name: str, tenant_id: str = DEFAULT_TENANT) -> Partition:
        """The partition or RegistryError(404) in the reference's words."""
        part = self.partitions.get((model_name, tenant_id))
        if part is None:
            raise RegistryError(404, f"no indexer for {_where(model_name, tenant_id)}")
        return part

    def _ensure_partition(self, model_name: str, tenant_id: str, block_size: int) -> Partition:
        part = self.partitions.get((model_name, tenant_id))
        if part is None:
            part = self.partitions[(model_name, tenant_id)] = Partition(model_name, tenant_id, KvIndex(block_size))
        return part

    # -- registration

    def register(
        self,
        instance_id: int,
        endpoint: str,
        model_name: str,
        tenant_id: str = DEFAULT_TENANT,
        block_size: int = 16,
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
    ) -> Listener:
        """Register one (instance, dp_rank) stream and start its listener on the running loop."""
        try:
            validate_endpoint(endpoint)
        except ValueError as exc:
            raise RegistryError(400, str(exc)) from None
        if replay_endpoint is not None:
            try:
                validate_endpoint(replay_endpoint)
            except ValueError as exc:
                raise RegistryError(400, f"invalid replay endpoint `{replay_endpoint}`: {exc}") from None
        if block_size <= 0:
            raise RegistryError(400, "block_size must be greater than 0")
        inst = self.instances.get(instance_id)
        if inst is not None:
            if (inst.model_name, inst.tenant_id) != (model_name, tenant_id):
                raise RegistryError(
                    409, f"instance {instance_id} is already registered for {_where(inst.model_name, inst.tenant_id)}"
                )
            if dp_rank in inst.listeners:
                raise RegistryError(409, f"instance {instance_id} dp_rank {dp_rank} already registered")
        part = self.partitions.get((model_name, tenant_id))
        if part is not None and part.block_size != block_size:
            raise RegistryError(
                409,
                f"block_size mismatch for {_where(model_name, tenant_id)}: existing={part.block_size}, "
                f"requested={block_size}",
            )
        part = self._ensure_partition(model_name, tenant_id, block_size)
        if inst is None:
            inst = self.instances[instance_id] = Instance(instance_id, model_name, tenant_id)
        seq_state = self._seq_states.setdefault((instance_id, dp_rank), SequenceState())
        applier = EventApplier(part.index, instance_id, dp_rank, self.event_counters)
        listener = Listener(
            self.ctx,
            endpoint,
            applier,
            replay_endpoint=replay_endpoint,
            seq_state=seq_state,
            ready=self.ready,
            replay_timeout=self.replay_timeout,
            on_change=self.on_change,
            lag_histogram=self.apply_lag,
            on_restart=lambda: self._engine_restarted(instance_id, dp_rank),
        )
        inst.listeners[dp_rank] = listener
        listener.start()
        return listener

    def _engine_restarted(self, instance_id: int, dp_rank: int) -> None:
        if self.on_restart is not None:
            self.on_restart(instance_id, dp_rank)

    async def unregister(
        self,
        instance_id: int,
        model_name: str,
        tenant_id: str | None = None,
        dp_rank: int | None = None,
        forget_watermark: bool = False,
    ) -> None:
        """Remove an instance (tenant omitted: the whole instance) or one of its DP ranks. The
        sequence watermark outlives this (the standalone service's documented behaviour) unless
        ``forget_watermark``: the frontend's choice, whose unregistered worker is registered again
        only as a new reading of the engine (its blocks were dropped here, so the next stream must
        start with no watermark: its first batch then shows a gap from 0 and the replay gives back
        what the engine still holds)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            raise RegistryError(404, f"instance {instance_id} not found")
        if inst.model_name != model_name or (tenant_id is not None and inst.tenant_id != tenant_id):
            raise RegistryError(
                404, f"instance {instance_id} is registered for {_where(inst.model_name, inst.tenant_id)}"
            )
        part = self.partitions.get((inst.model_name, inst.tenant_id))
        if tenant_id is not None and dp_rank is not None:
            listener = inst.listeners.pop(dp_rank, None)
            if listener is None:
                raise RegistryError(404, f"instance {instance_id} dp_rank {dp_rank} not found")
            await listener.stop()
            if forget_watermark:
                self._seq_states.pop((instance_id, dp_rank), None)
            if part is not None:
                part.index.remove_worker(instance_id, dp_rank)
            if inst.listeners:
                return
        else:
            listeners = list(inst.listeners.items())
            inst.listeners.clear()
            for rank, listener in listeners:
                await listener.stop()
                if forget_watermark:
                    self._seq_states.pop((instance_id, rank), None)
        del self.instances[instance_id]
        if part is not None:
            part.index.remove_worker(instance_id)
            if not any(
                (i.model_name, i.tenant_id) == (part.model_name, part.tenant_id) for i in self.instances.values()
            ):
                del self.partitions[(part.model_name, part.tenant_id)]

    async def close(self) -> None:
        for inst in list(self.instances.values()):
            for listener in list(inst.listeners.values()):
                await listener.stop()

    # -- views

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for inst in self.instances.values():
            if model_name is not None and inst.model_name != model_name:
                continue
            if tenant_id is not None and inst.tenant_id != tenant_id:
                continue
            part = self.partitions.get((inst.model_name, inst.tenant_id))
            ranks = sorted(inst.listeners)
            out.append(
                {
                    "instance_id": inst.instance_id,
                    "source": "zmq",
                    "status": inst.status(),
                    "model_name": inst.model_name,
                    "tenant_id": inst.tenant_id,
                    "routing_group": inst.tenant_id,
                    "block_size": part.block_size if part is not None else None,
                    "endpoints": {str(r): inst.listeners[r].endpoint for r in ranks},
                    "listeners": {str(r): inst.listeners[r].info() for r in ranks},
                }
            )
        return out

    def health(self, instance_id: int) -> dict[str, dict[str, Any]]:
        """KV-event health of one instance's listeners, keyed by dp rank (``{}`` when unknown)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return {}
        return {str(r): inst.listeners[r].health() for r in sorted(inst.listeners)}

    def health_metrics(self) -> list[Any]:
        """Per-listener KV-event health as Prometheus families (the same names in the frontend and
        the standalone indexer): events, batches, gaps, replays, last event time."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["worker_id", "dp_rank"]
        fams = {
            "events_received": CounterMetricFamily(
                "kvroute_kv_events_received", "KV events received in applied batches", labels=labels
            ),
            "batches_applied": CounterMetricFamily(
                "kvroute_kv_event_batches_applied", "KV-event batches applied", labels=labels
            ),
            "batches_dropped": CounterMetricFamily(
                "kvroute_kv_event_batches_dropped", "KV-event batches dropped (undecodable)", labels=labels
            ),
            "gaps": CounterMetricFamily(
                "kvroute_kv_event_gaps", "Sequence gaps detected in the KV-event stream", labels=labels
            ),
            "batches_missed": CounterMetricFamily(
                "kvroute_kv_event_batches_missed", "Batches skipped over by sequence gaps", labels=labels
            ),
            "replays": CounterMetricFamily(
                "kvroute_kv_event_replays", "Replays requested from the engine's replay endpoint", labels=labels
            ),
            "replay_timeouts": CounterMetricFamily(
                "kvroute_kv_event_replay_timeouts", "Replays abandoned without an answer", labels=labels
            ),
            "engine_restarts": CounterMetricFamily(
                "kvroute_kv_event_engine_restarts",
                "Engine restarts detected (the live sequence went back)",
                labels=labels,
            ),
            "blocks_rejected_block_size": CounterMetricFamily(
                "kvroute_kv_event_blocks_rejected_block_size",
                "Stored blocks dropped: the engine's block size is not the router's",
                labels=labels,
            ),
        }
        last = GaugeMetricFamily(
            "kvroute_kv_event_last_timestamp_seconds", "Unix time of the last applied KV-event batch", labels=labels
        )
        lag = GaugeMetricFamily(
            "kvroute_kv_index_lag_seconds",
            "Seconds from the engine publishing the newest applied KV-event batch to its being applied (index lag)",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "kvroute_kv_index_newest_event_age_seconds",
            "Seconds since the engine published the newest applied KV-event batch",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "kvroute_kv_event_batches_waiting",
            "KV-event batches found queued behind the first when the listener last read the worker's socket "
            "(0: the index keeps up with this worker)",
            labels=labels,
        )
        for inst in self.instances.values():
            for r, lst in inst.listeners.items():
                lv = [str(inst.instance_id), str(r)]
                h = lst.health()
                waiting.add_metric(lv, lst.batches_waiting)
                for key, fam in fams.items():
                    value = h[key]
                    assert isinstance(value, int | float)
                    fam.add_metric(lv, value)
                if lst.last_event_wall is not None:
                    last.add_metric(lv, lst.last_event_wall)
                if h["index_lag_seconds"] is not None:
                    lag.add_metric(lv, h["index_lag_seconds"])  # type: ignore[arg-type]
                if h["newest_event_age_seconds"] is not None:
                    age.add_metric(lv, h["newest_event_age_seconds"])  # type: ignore[arg-type]
        return [*fams.values(), last, lag, age, waiting, self.apply_lag.metric()]

    def listener_status_counts(self) -> dict[str, int]:
        counts = {s: 0 for s in _STATUS_PRIORITY}
        for inst in self.instances.values():
            for listener in inst.listeners.values():
                counts[listener.status] = counts.get(listener.status, 0) + 1
        return counts

    def known_worker_count(self) -> int:
        """Registered instances plus workers known only from a recovered dump."""
        ids = set(self.instances)
        for part in self.partitions.values():
            ids.update(w for w, _ in part.index.workers())
        return len(ids)

    # -- dump / restore

    def dump(self) -> dict[str, Any]:
        """Every partition as ``{"model:tenant": {"block_size": n, "events": [...]}}`` (the reference's ``/dump``
        shape)."""
        return {
            f"{p.model_name}:{p.tenant_id}": {"block_size": p.block_size, "events": p.index.dump_events()}
            for p in self.partitions.values()
        }

    def restore(self, dump: Any) -> int:
        """Apply a peer's /dump; returns the number of events applied. ValueError on a bad shape."""
        if not isinstance(dump, dict):
            raise ValueError("dump must be an object keyed by model_name:tenant_id")
        applied = 0
        for key, value in dump.items():
            model_name, sep, tenant_id = str(key).partition(":")
            if not sep:
                tenant_id = DEFAULT_TENANT
            if not isinstance(value, dict) or not isinstance(value.get("events"), list):
                raise ValueError(f"dump entry {key!r} needs block_size and events")
            block_size = value.get("block_size")
            if not isinstance(block_size, int) or block_size <= 0:
                raise ValueError(f"dump entry {key!r} has no valid block_size")
            part = self.partitions.get((model_name, tenant_id))
            if part is None:
                part = self._ensure_partition(model_name, tenant_id, block_size)
            elif part.block_size != block_size:
                log.warning("recovery: %s has block_size %d here, %d in the dump", key, part.block_size, block_size)
            for ev in value["events"]:
                applied += apply_router_event(part.index, ev)
        return applied


def parse_workers_arg(spec: str) -> list[tuple[int, int, str]]:
    """``"id[:dp]=endpoint,..."`` -> [(instance_id, dp_rank, endpoint)]; ValueError when malformed."""
    out: list[tuple[int, int, str]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        ident, sep, endpoint = item.partition("=")
        if not sep or not endpoint:
            raise ValueError(f"invalid worker spec {item!r}: expected id[:dp_rank]=endpoint")
        inst, _, dp = ident.partition(":")
        try:
            out.append((int(inst), int(dp) if dp else 0, endpoint.strip()))
        except ValueError:
            raise ValueError(f"invalid worker spec {item!r}: ids must be integers") from None
    return out


def split_urls(spec: str | None) -> Sequence[str]:
    return [u.strip().rstrip("/") for u in (spec or "").split(",") if u.strip()]
