"""The engine workers the frontend routes to: configuration, discovery and health.

A worker is an OpenAI-compatible engine (vLLM, SGLang, the mocker) at a base URL with a DP range.
Workers come from ``--worker`` flags, a ``--workers-file`` (JSON or YAML, re-read when it changes)
and the runtime registration API; each source owns its own entries, so a file reload never drops a
worker that came from the command line or the API.

Discovery reads the served models from ``/v1/models`` and the capacity (block size, KV blocks,
max batched tokens, context length) from what the engine exposes (``frontend.pool.capacity``) unless the
configuration gives them; what nothing exposes is warned about and listed in ``/admin/workers``.
A worker that fails a health check or a dispatch leaves the candidate set until a health check
passes again.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import xxhash

from frontend.dispatch.upstream import UpstreamConnectError, UpstreamError, UpstreamPool
from frontend.request.validation import PromptLimit

log = logging.getLogger("frontend.pool.workers")
T = TypeVar("T")

_INT_FIELDS = {"id", "dp_size", "dp_start", "block_size", "num_gpu_blocks", "max_num_batched_tokens"}
_STR_FIELDS = {"url", "kv_events_endpoint", "replay_endpoint", "model", "model_path", "role", "engine"}
# disaggregated serving: which phase a worker serves (names.md: role=prefill|decode|both)
WORKER_ROLES = ("prefill", "decode", "both")
SUSPECT_GAP_S = 1.0  # at most one early probe (``WorkerPool.suspect``) a worker per this many seconds
# engine=vllm|sglang overrides the detected engine kind (it decides the sign of the engine's priority)
WORKER_ENGINES = ("vllm", "sglang")
_ALIASES = {
    "worker_id": "id",
    "instance_id": "id",
    "base_url": "url",
    "data_parallel_size": "dp_size",
    "data_parallel_start_rank": "dp_start",
    "kv_cache_block_size": "block_size",
    "endpoint": "kv_events_endpoint",
    "total_kv_blocks": "num_gpu_blocks",
}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to reach one worker. Optional capacity fields override what the worker reports."""

    id: int
    url: str
    dp_size: int = 1
    dp_start: int = 0
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    model: str | None = None  # serve under this name instead of asking /v1/models
    model_path: str | None = None  # tokenizer for this worker's model (local HF directory)
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    role: str = "both"  # prefill workers only take the prefill phase of disaggregated requests
    engine: str | None = None  # vllm | sglang: overrides detection (frontend.routing.engine_polarity)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> WorkerSpec:
        """Build from a dict (file entry, API body, parsed flag); ValueError with a clear message."""
        if not isinstance(raw, dict):
            raise ValueError("a worker must be an object")
        values: dict[str, Any] = {}
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            name = _ALIASES.get(key, key)
            if name not in known:
                raise ValueError(f"unknown worker field {key!r}")
            if value is None:
                continue
            if name in _INT_FIELDS:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise ValueError(f"worker field {key!r} must be an integer")
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"worker field {key!r} must be an integer, got {value!r}") from None
                if not -(1 << 63) <= value <= (1 << 64) - 1:  # ids are u64; beyond, nothing can hold or print it
                    raise ValueError(f"worker field {key!r} is out of range: {value}")
            elif not isinstance(value, str):
                raise ValueError(f"worker field {key!r} must be a string")
            values[name] = value
        if "url" not in values:
            raise ValueError("worker needs a 'url'")
        if values.get("id", 0) < 0:
            raise ValueError("worker id must be >= 0")
        url = values["url"].rstrip("/")
        if not url.startswith("http://"):
            raise ValueError(f"worker url must start with http://, got {values['url']!r}")
        if url.endswith("/v1"):
            url = url[:-3]
        try:  # a host the HTTP client cannot use (bad IDNA, stray characters) is the spec's error, not a 500
            if not httpx.URL(url).host:
                raise ValueError("no host")
        except (httpx.InvalidURL, ValueError) as exc:
            raise ValueError(f"worker url {values['url']!r} is not a usable URL: {exc}") from None
        values["url"] = url
        if "id" not in values:
            values["id"] = url_worker_id(url)
        if values.get("dp_size", 1) < 1:
            raise ValueError("dp_size must be >= 1")
        if values.get("dp_start", 0) < 0:
            raise ValueError("dp_start must be >= 0")
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens"):
            if name in values and values[name] <= 0:
                raise ValueError(f"{name} must be > 0")
        if "role" in values:
            role = values["role"].strip().lower()
            if role not in WORKER_ROLES:
                raise ValueError(f"worker role must be one of prefill, decode, both, got {values['role']!r}")
            values["role"] = role
        if "engine" in values:
            engine = values["engine"].strip().lower()
            if engine not in WORKER_ENGINES:
                raise ValueError(f"worker engine must be one of vllm, sglang, got {values['engine']!r}")
            values["engine"] = engine
        return cls(**values)

    @property
    def is_prefill(self) -> bool:
        """A prefill-only worker: never a decode (or aggregated) target."""
        return self.role == "prefill"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_size)

    def rank_endpoint(self, endpoint: str | None, rank: int) -> str | None:
        """The ZMQ endpoint of DP rank ``rank``: the base port + (rank - dp_start), as vLLM publishes."""
        if endpoint is None:
            return None
        offset = rank - self.dp_start
        if offset == 0:
            return endpoint
        m = re.match(r"^(.*):(\d+)$", endpoint)
        if not m:
            return endpoint
        return f"{m.group(1)}:{int(m.group(2)) + offset}"


def url_worker_id(url: str) -> int:
    """The id of a worker given without one: a hash of its normalised URL, so the same URL keeps its id
    across restarts. 53 bits: a JSON number that JavaScript (the dashboard) reads exactly."""
    return xxhash.xxh3_64_intdigest(url.encode()) & ((1 << 53) - 1)


def parse_worker_arg(text: str) -> WorkerSpec:
    """``http://gpu1:8001`` or ``id=1,url=http://127.0.0.1:8001,dp_size=2,kv_events_endpoint=tcp://...``
    -> WorkerSpec. A leading part without ``=`` is the URL (``http://gpu1:8001,dp_size=2``)."""
    raw: dict[str, Any] = {}
    for n, part in enumerate(text.split(",")):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or "://" in key:
            if n == 0:
                raw["url"] = part
                continue
            raise ValueError(f"--worker expects a URL or key=value pairs separated by commas, got {part!r}")
        raw[key.strip()] = value.strip()
    return WorkerSpec.from_mapping(raw)


def parse_workers_document(text: str) -> tuple[list[WorkerSpec], dict[str, dict[str, Any]]]:
    """A workers file: ``{"workers": [...], "models": {name: {"model_path": ...}}}`` (JSON or YAML).

    A bare list is accepted as the workers list; an entry is an object or a bare URL string.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        doc = yaml.safe_load(text)
    if doc is None:
        doc = {}
    if isinstance(doc, list):
        doc = {"workers": doc}
    if not isinstance(doc, dict):
        raise ValueError("workers file must be an object with a 'workers' list")
    items = doc.get("workers") or []
    if not isinstance(items, list):
        raise ValueError("'workers' must be a list")
    specs = [WorkerSpec.from_mapping({"url": item} if isinstance(item, str) else item) for item in items]
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate worker id in workers file (the same URL twice, or an id given twice)")
    models = doc.get("models") or {}
    if not isinstance(models, dict):
        raise ValueError("'models' must be an object")
    return specs, models


def parse_cache_config_info(metrics_text: str) -> dict[str, int]:
    """Integer labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...) from /metrics text."""
    from frontend.pool.capacity import metric_labels

    out: dict[str, int] = {}
    for key, value in (metric_labels(metrics_text, "vllm:cache_config_info") or {}).items():
        try:
            out[key] = int(float(value))
        except ValueError:
            continue
    return out


def event_sources_spec(spec: WorkerSpec, sources: Any) -> tuple[WorkerSpec, str | None]:
    """``spec`` completed from the engine's ``GET /kv_event_sources`` (vLLM: its KV-event publisher
    config per DP rank), and a warning when the engine publishes no KV events.

    What the spec states takes precedence; an endpoint bound to ``*`` or ``0.0.0.0`` is reached at the
    worker's own host; the ranks are the keys (rank r publishes on the base port + r)."""
    if spec.kv_events_endpoint:
        return spec, None
    ranks = {}
    if isinstance(sources, dict):
        for key, cfg in sources.items():
            if str(key).isdigit() and isinstance(cfg, dict):
                ranks[int(key)] = cfg
    first = ranks.get(min(ranks)) if ranks else None
    if (
        first is None
        or not first.get("enable_kv_cache_events")
        or first.get("publisher") != "zmq"
        or not isinstance(first.get("endpoint"), str)
    ):
        return spec, (
            f"worker {spec.id} ({spec.url}) publishes no KV events (no zmq publisher in /kv_event_sources): it is "
            "served, but kv routing sees no cached blocks on it (start the engine with --kv-events-config, or give "
            "kv_events_endpoint)"
        )
    host = urlsplit(spec.url).hostname or "127.0.0.1"

    def reachable(endpoint: Any) -> str | None:
        if not isinstance(endpoint, str) or not endpoint:
            return None
        return re.sub(r"^(\w+://)(\*|0\.0\.0\.0|\[::\])(?=:\d+$)", lambda m: m.group(1) + host, endpoint)

    changes: dict[str, Any] = {
        "kv_events_endpoint": reachable(first["endpoint"]),
        "replay_endpoint": spec.replay_endpoint or reachable(first.get("replay_endpoint")),
    }
    if spec.dp_size == 1 and spec.dp_start == 0 and len(ranks) > 1:  # the defaults: the engine's ranks
        changes["dp_start"], changes["dp_size"] = min(ranks), len(ranks)
    return replace(spec, **changes), None


@dataclass(slots=True)
class Worker:
    """Runtime state of one worker."""

    spec: WorkerSpec  # as configured, completed from what the engine exposes (kv_event_sources)
    source: str  # "cli" | "file" | "api"
    client: httpx.AsyncClient  # control plane: health checks and discovery
    upstream: UpstreamPool  # request path
    # health checks: the request path's cheap client, on a connection of its own (a request never
    # finds a probe's kept-alive connection, so how it fails when the engine dies is unchanged)
    health: UpstreamPool | None = None
    models: list[str] = field(default_factory=list)
    # LoRA adapters among the models: adapter -> the base model it applies to (/v1/models' parent)
    adapters: dict[str, str] = field(default_factory=dict)
    # each model's root in /v1/models: the path or name the engine loaded (vLLM hashes images with it)
    model_roots: dict[str, str] = field(default_factory=dict)
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # from the engine's /v1/models (vLLM and SGLang report it)
    capacity: Any = None  # frontend.pool.capacity.EngineCapacity: what the engine exposed, and from where
    capacity_warned: bool = False
    warnings: list[str] = field(default_factory=list)  # configuration problems found at attach time
    max_num_seqs: int | None = None  # when the engine exposes it (model_max_num_seqs gauge)
    healthy: bool = False
    discovered: bool = False
    discoveries: int = 0  # times its models and capacity were read (a restarted process is read again)
    failures: int = 0  # consecutive failed health checks while healthy
    unreachable: bool = False  # connection refused / lost: the process is gone, so is its KV cache
    last_error: str | None = None
    # set once the frontend has attached the worker to its models (tracker/indexer registration)
    attached_models: list[str] = field(default_factory=list)
    configured: WorkerSpec | None = None  # the spec as given (flags, file, API, discovery)
    # the engine turned the probe completion into the router's ids (render_parity): it may get prompts as ids
    prompt_ids_proven: bool = False

    def __post_init__(self) -> None:
        if self.configured is None:
            self.configured = self.spec

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def prompt_limit(self) -> PromptLimit:
        """Its context length and the tokens one rank's KV cache holds (one block is the engine's null block)."""
        kv = (self.num_gpu_blocks - 1) * self.block_size if self.num_gpu_blocks and self.block_size else None
        return PromptLimit(self.max_model_len, kv)

    def describe(self) -> dict[str, Any]:
        return {
            **self.spec.to_dict(),
            "source": self.source,
            "healthy": self.healthy,
            "models": list(self.models),
            "adapters": dict(self.adapters),
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "engine": self.spec.engine or (self.capacity.engine if self.capacity is not None else None),
            "engine_detected": self.capacity.engine if self.capacity is not None else None,
            "capacity_sources": dict(self.capacity.sources) if self.capacity is not None else {},
            # capacity values the engine does not expose (thresholds use the reference's stand-ins)
            "capacity_unknown": self.capacity.unknown if self.capacity is not None else None,
            "warnings": list(self.warnings),
            "last_error": self.last_error,
            "prompt_ids_proven": self.prompt_ids_proven,
        }


def lora_adapters(models: list[Any]) -> dict[str, str]:
    """LoRA adapters in an OpenAI ``/v1/models`` list: entries whose ``parent`` is another served model
    (vLLM lists ``--lora-modules`` and adapters loaded at runtime this way)."""
    ids = {m.get("id") for m in models if isinstance(m, dict)}
    return {
        m["id"]: m["parent"]
        for m in models
        if isinstance(m, dict)
        and isinstance(m.get("id"), str)
        and isinstance(m.get("parent"), str)
        and m["parent"] in ids
        and m["parent"] != m["id"]
    }


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every worker client: httpx builds one per client otherwise, loading the CA
    bundle each time (~40 ms on the event loop for every worker that joins)."""
    return httpx.create_ssl_context(trust_env=False)


def make_client(url: str, timeout: float | None = None) -> httpx.AsyncClient:
    """One pooled keep-alive client per worker (TCP_NODELAY is set by the asyncio transport)."""
    return httpx.AsyncClient(
        base_url=url,
        verify=_tls_context(),
        timeout=httpx.Timeout(timeout, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=60.0),
        trust_env=False,
    )


class WorkerPool:
    """All configured workers, their discovery and health.

    ``on_change(worker)`` is called whenever a worker's attachment-relevant state changes (became
    healthy, unhealthy, discovered models); ``on_removed(worker)`` when it leaves the pool;
    ``prepare(worker)``, when given, is awaited after a worker's models are discovered and before
    ``on_change`` sees them (slow set-up such as loading a tokenizer, kept off the event loop).
    """

    def __init__(
        self,
        on_change: Callable[[Worker], None],
        on_removed: Callable[[Worker], None],
        health_interval: float = 2.0,
        health_timeout: float = 5.0,
        failures_to_unhealthy: int = 2,
        request_timeout: float | None = None,
        event_sources: bool = False,
        prepare: Callable[[Worker], Awaitable[None]] | None = None,
    ) -> None:
        self.workers: dict[int, Worker] = {}
        # kv mode with KV events: a worker given without its endpoints gets them from the engine
        self.event_sources = event_sources
        self._on_change = on_change
        self._on_removed = on_removed
        self._prepare = prepare
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.failures_to_unhealthy = failures_to_unhealthy
        self.request_timeout = request_timeout
        self._tasks: set[asyncio.Task] = set()
        self._health_task: asyncio.Task | None = None
        self._probe_locks: dict[int, asyncio.Lock] = {}
        # worker id -> (monotonic start time, task) of its last early probe (a start in the future: scheduled)
        self._suspected: dict[int, tuple[float, asyncio.Task[bool]]] = {}

    # ---- membership -------------------------------------------------------------------------
    def add(self, spec: WorkerSpec, source: str) -> Worker:
        """Add or replace a worker; discovery runs in the background."""
        old = self.workers.get(spec.id)
        if old is not None:
            if old.configured == spec:
                old.source = source
                return old
            self.remove(spec.id)
        worker = Worker(
            spec=spec,
            source=source,
            client=make_client(spec.url, self.request_timeout),
            upstream=UpstreamPool(spec.url, timeout=self.request_timeout),
            health=UpstreamPool(spec.url, max_idle=1),
        )
        self.workers[spec.id] = worker
        self._spawn(self.probe(worker))
        return worker

    def remove(self, worker_id: int) -> Worker | None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return None
        worker.healthy = False
        self._on_removed(worker)
        self._spawn(worker.client.aclose())
        self._spawn(worker.upstream.aclose())
        if worker.health is not None:
            self._spawn(worker.health.aclose())
        return worker

    def sync_source(self, source: str, specs: list[WorkerSpec]) -> None:
        """Make the workers of ``source`` exactly ``specs`` (file reloads)."""
        wanted = {s.id: s for s in specs}
        for wid, w in list(self.workers.items()):
            if w.source == source and wid not in wanted:
                self.remove(wid)
        for spec in specs:
            existing = self.workers.get(spec.id)
            if existing is not None and existing.source != source and existing.configured != spec:
                log.warning(
                    "worker %s from %s shadows the %s entry; keeping %s",
                    spec.id,
                    source,
                    existing.source,
                    existing.source,
                )
                continue
            self.add(spec, source)

    # ---- discovery and health ---------------------------------------------------------------
    async def _health_status(self, worker: Worker) -> int:
        """``GET /health`` with the request path's keep-alive client (its own connection): an httpx
        request costs ~1 ms of CPU, and the probes of 4 workers every 2 s were ~2 ms of CPU per second on
        an idle frontend, which ``bench peers`` charges to every request of a run (issue 28). A probe that
        times out closes its connection (TimeoutError)."""
        client = worker.health if worker.health is not None else worker.upstream
        resp = await asyncio.wait_for(client.request("GET", "/health", b""), self.health_timeout)
        return resp.status

    async def probe(self, worker: Worker) -> bool:
        """Discover models and capacity and check health; updates state and notifies."""
        lock = self._probe_locks.setdefault(worker.id, asyncio.Lock())
        async with lock:
            if self.workers.get(worker.id) is not worker:
                return False
            refused = False
            rediscovered = worker.healthy and not worker.discovered  # a new process behind a healthy worker
            try:
                if not worker.discovered:
                    await self._discover(worker)
                    if self._prepare is not None:
                        await self._prepare(worker)
                status = await self._health_status(worker)
                ok = status == 200
                error = None if ok else f"health check returned {status}"
            except (httpx.HTTPError, UpstreamError, OSError, ValueError) as exc:
                ok, error = False, f"{type(exc).__name__}: {str(exc) or 'no answer within the health timeout'}"
                refused = isinstance(exc, (httpx.ConnectError, UpstreamConnectError, ConnectionRefusedError))
            if self.workers.get(worker.id) is not worker:
                return False
            if ok:
                worker.failures = 0
                worker.unreachable = False
            elif worker.healthy and not refused:
                # a slow or failing answer once is not enough to drop a live worker (and its index)
                worker.failures += 1
                if worker.failures < self.failures_to_unhealthy:
                    worker.last_error = error
                    return True
            was_unreachable = worker.unreachable
            if not ok and refused:
                worker.unreachable = True
            changed = ok != worker.healthy or (worker.unreachable and not was_unreachable) or (ok and rediscovered)
            worker.healthy = ok
            worker.last_error = error
            if not ok:
                worker.discovered = False  # when it comes back, read its models and capacity again
            if changed:
                state = "read again after a restart" if ok and rediscovered else "healthy" if ok else "unhealthy"
                log.info("worker %s is %s%s", worker.id, state, f" ({error})" if error else "")
                self._on_change(worker)
            return ok

    def rediscover(self, worker_id: int) -> None:
        """A new process behind a healthy worker's address (its KV-event stream started again between two
        health checks): read its models, capacity and event sources again, and prove its tokenizer again,
        instead of going on with what the old process said."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.discovered:  # gone, or being read already
            return
        worker.discovered = False
        worker.prompt_ids_proven = False
        self._spawn(self.probe(worker))

    async def _discover(self, worker: Worker) -> None:
        spec = worker.spec
        worker.prompt_ids_proven = False  # a new process may load another tokenizer: text until probed again
        models_json: Any = None
        try:
            resp = await worker.client.get("/v1/models", timeout=self.health_timeout)
            resp.raise_for_status()
            models_json = resp.json()
        except (httpx.HTTPError, ValueError):
            if not spec.model:
                raise
        if spec.model:
            models = [spec.model]
        else:
            data = (models_json.get("data") if isinstance(models_json, dict) else None) or []
            models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            if not models:
                raise ValueError("worker serves no model")
            worker.adapters = lora_adapters(data)
        data = (models_json.get("data") if isinstance(models_json, dict) else None) or []
        worker.model_roots = {
            m["id"]: m["root"]
            for m in data
            if isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("root"), str)
        }
        from frontend.pool.capacity import read_capacity, unknown_capacity_message

        cap = await read_capacity(
            worker.client,
            {
                "block_size": spec.block_size,
                "num_gpu_blocks": spec.num_gpu_blocks,
                "max_num_batched_tokens": spec.max_num_batched_tokens,
            },
            models_json,
            self.health_timeout,
        )
        worker.models = models
        worker.capacity = cap
        worker.block_size = cap.get("block_size")
        worker.num_gpu_blocks = cap.get("num_gpu_blocks")
        worker.max_num_batched_tokens = cap.get("max_num_batched_tokens")
        worker.max_model_len = cap.get("max_model_len")
        if cap.unknown and not worker.capacity_warned:
            worker.capacity_warned = True
            log.warning(unknown_capacity_message(worker.id, cap))
        worker.max_num_seqs = cap.get("max_num_seqs")
        await self._read_event_sources(worker)
        worker.discovered = True
        worker.discoveries += 1

    async def _read_event_sources(self, worker: Worker) -> None:
        """A worker given without its KV-event endpoints gets them from the engine (re-read on every
        rediscovery: an engine restarted with another configuration is followed)."""
        configured = worker.configured or worker.spec
        if configured.kv_events_endpoint or not self.event_sources:
            worker.spec = configured
            return
        sources: Any = None
        try:
            resp = await worker.client.get("/kv_event_sources", timeout=self.health_timeout)
            if resp.status_code == 200:
                sources = resp.json()
        except (httpx.HTTPError, ValueError):
            sources = None
        spec, warning = event_sources_spec(configured, sources)
        if spec != worker.spec:
            log.info(
                "worker %s: KV events from the engine: %s (replay %s), %d DP rank(s)",
                worker.id,
                spec.kv_events_endpoint,
                spec.replay_endpoint,
                spec.dp_size,
            )
        worker.spec = spec
        if warning is not None and warning not in worker.warnings:
            worker.warnings.append(warning)
            log.warning(warning)
        elif warning is None:
            worker.warnings = [w for w in worker.warnings if "publishes no KV events" not in w]

    def mark_failed(self, worker: Worker, error: str, unreachable: bool = True) -> None:
        """A dispatch could not reach the worker (or lost it): take it out until a health check passes."""
        if self.workers.get(worker.id) is not worker:
            return
        worker.last_error = error
        newly_unreachable = unreachable and not worker.unreachable
        worker.unreachable = worker.unreachable or unreachable
        worker.discovered = False
        if worker.healthy or newly_unreachable:
            if worker.healthy:
                log.warning("worker %s marked unhealthy: %s", worker.id, error)
            worker.healthy = False
            self._on_change(worker)

    def suspect(self, worker: Worker) -> asyncio.Task[bool] | None:
        """Something another component saw says the worker may be gone (a stream it served was cut, the
        gateway could not reach it): probe it now instead of at the next round, so new requests stop going
        there within a round trip. At most one early probe starts a worker per ``SUSPECT_GAP_S``: clients
        that leave mid-stream look the same and must not turn into a probe each.

        Returns the task of a probe that answers after this suspicion: one not answered yet (running, or
        scheduled), else a new one, at once or, when the last started less than a gap ago, when the gap ends
        (an answer from before the suspicion says nothing about what happened since). None when the worker
        is gone or already unhealthy (or no loop runs yet)."""
        if self.workers.get(worker.id) is not worker or not worker.healthy:
            return None
        now = time.monotonic()
        last = self._suspected.get(worker.id)
        if last is not None and not last[1].done():
            return last[1]
        if last is not None and now - last[0] < SUSPECT_GAP_S:
            start = last[0] + SUSPECT_GAP_S
            task = self._spawn(self._probe_at(worker, start))
        else:
            start = now
            task = self._spawn(self.probe(worker))
        if task is not None:
            self._suspected[worker.id] = (start, task)
        return task

    async def _probe_at(self, worker: Worker, start: float) -> bool:
        """``probe(worker)`` once the monotonic clock reaches ``start``."""
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        return await self.probe(worker)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())), return_exceptions=True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health check round failed")

    def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        for t in list(self._tasks):
            t.cancel()
        for w in list(self.workers.values()):
            await w.client.aclose()
            await w.upstream.aclose()
            if w.health is not None:
                await w.health.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop yet (CLI setup): the start-up check probes everyone
            coro.close()
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class WorkersFileWatcher:
    """Re-reads a workers file when its modification time or size changes."""

    def __init__(
        self, path: str, apply: Callable[[list[WorkerSpec], dict[str, dict[str, Any]]], None], interval: float = 1.0
    ) -> None:
        self.path = path
        self.apply = apply
        self.interval = interval
        self._stamp: tuple[float, int] | None = None
        self._task: asyncio.Task | None = None
        self.last_error: str | None = None

    def load_now(self) -> None:
        """Read the file if it changed; a bad file keeps the previous workers and logs why."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self.last_error = f"cannot stat {self.path}: {exc}"
            return
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            with open(self.path, encoding="utf-8") as f:
                specs, models = parse_workers_document(f.read())
        except (OSError, ValueError) as exc:
            self.last_error = f"{self.path}: {exc}"
            log.error("ignoring workers file: %s", self.last_error)
            return
        except Exception as exc:  # yaml errors
            self.last_error = f"{self.path}: {exc}"
            log.error("ignoring workers file: %s", self.last_error)
            return
        self.last_error = None
        self.apply(specs, models)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.load_now()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
