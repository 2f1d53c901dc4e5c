"""FrontendState: everything one frontend owns (config, models, worker pool, embedded slot tracker and
indexer, metrics) and how workers are attached to and detached from models as they come and go.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from frontend.observability.metrics import PREFILL_WORKER_TYPE, WORKER_TYPE, CallbackCollector, FrontendMetrics
from frontend.observability.parity import ParityMonitor
from frontend.observability.request_metrics import RequestMetrics
from frontend.pool.workers import Worker, WorkerPool, WorkersFileWatcher
from frontend.routing.decision_log import DecisionLog
from frontend.routing.eligibility import queue_has_capacity, warmup_target_busy
from frontend.routing.images import ImageCache
from frontend.routing.media_policy import MediaPolicy
from frontend.routing.models import TENANT, BusyThresholds, ModelEntry
from frontend.routing.request_router import RequestRouter
from kvroute_common.multimodal import ImageOptions
from router.config import RouterConfig, decode_router_config, prefill_router_config

if TYPE_CHECKING:
    from frontend.observability.loop_lag import StallLogger
    from frontend.observability.tracing import Tracing
    from frontend.pool.discovery import DiscoveryBackend
    from frontend.request.hints import RequestHints
    from frontend.routing.admission import AdmissionQueue
    from frontend.routing.rate_limits import RateLimits
    from frontend.routing.remote_index import RemoteIndexers
    from frontend.routing.speculative import SendFn, SpeculativePrefiller
    from indexer.registry import IndexerRegistry
    from router.session import SessionTable
    from slot_tracker.replica_sync import ReplicaSync

REMOTE_REGISTER_INTERVAL = 5.0  # seconds between re-assertions of the workers on their remote indexer shards
log = logging.getLogger("frontend")

DEFAULT_BLOCK_SIZE = 16


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


class FrontendState:
    """Everything one frontend owns: config, workers, models, embedded cores, metrics."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        model_path: str | None = None,
        model_paths: dict[str, str] | None = None,
        health_interval: float = 2.0,
        request_timeout: float | None = None,
        slot_registry: Any = None,
        metrics: FrontendMetrics | None = None,
        tokenize_offload_chars: int | None = None,
        image_options: ImageOptions | None = None,
        media_policy: MediaPolicy | None = None,
    ) -> None:
        from kvroute_common.tokenize_offload import DEFAULT_OFFLOAD_CHARS, TokenizeOffload

        self.config = config
        # long prompts are tokenized on a worker thread (never blocks the loop)
        self.tokenize = TokenizeOffload(
            DEFAULT_OFFLOAD_CHARS if tokenize_offload_chars is None else tokenize_offload_chars
        )
        self.model_path = model_path
        self.image_options = image_options or ImageOptions()
        # remote images by URL, fetched under the media fetch policy: a screenshot an agent sends again is fetched once
        self.image_cache = ImageCache(media_policy)
        self.model_paths: dict[str, str] = dict(model_paths or {})
        self.metrics = metrics or FrontendMetrics()
        if slot_registry is None:
            from slot_tracker.core import SlotRegistry

            slot_registry = SlotRegistry()
        self.slots = slot_registry
        self.events: IndexerRegistry | None = None  # created on first use inside the loop
        self.models: dict[str, ModelEntry] = {}
        # disaggregated serving: per model, the prefill-role workers (frontend/routing/disagg.py routes them)
        self.prefill_models: dict[str, ModelEntry] = {}
        self.thresholds: dict[str, BusyThresholds] = {}
        self.router = RequestRouter(config, self.metrics)
        # the guide's prefill router (active-block tracking off) and the load-only decode routing
        # of a request whose prompt was prefilled elsewhere
        self.prefill_router = RequestRouter(prefill_router_config(config), self.metrics)
        self.disagg_decode_router = RequestRouter(decode_router_config(config), self.metrics)
        # the request lifecycle's listener: metrics, per-worker gauges, TTFT observations, queue wake-ups
        self.lifecycle = RequestMetrics(self.metrics, self.router, self.capacity_changed)
        self.worker_gauges = self.lifecycle.worker_gauges
        self.decisions = DecisionLog()  # what the dashboard shows of the routers' choices
        for router, label in (
            (self.router, config.router_mode),
            (self.prefill_router, "prefill"),
            (self.disagg_decode_router, "disagg-decode"),
        ):
            router.decisions, router.label = self.decisions, label
        self.pool = WorkerPool(
            self._worker_changed,
            self._worker_removed,
            health_interval=health_interval,
            request_timeout=request_timeout,
            event_sources=config.kv_aware and config.uses_indexer and config.router_kv_events,
            prepare=self._load_tokenizers,
        )
        self.file_watcher: WorkersFileWatcher | None = None
        self.discovery: list[DiscoveryBackend] = []  # started with the state
        self.replica_sync: ReplicaSync | None = None
        self._ids = itertools.count(1)
        self._id_prefix = f"kvr-{self.metrics.router_id[:8]}-"
        self.shutting_down = False
        self.loop_stall_threshold = 0.0  # --log-loop-stalls, in seconds (0 = off)
        self.stall_logger: StallLogger | None = None
        # whether a transport has requests in flight (HTTP: the drain counter; the endpoint picker: its
        # streams): the loop-lag watch measures every 20 ms only then
        self.busy_probes: list[Callable[[], bool]] = []
        self.admission: AdmissionQueue | None = None
        self.rate_limits: RateLimits | None = None  # --rate-limit-*: per-key buckets, 429 before routing
        self.tracing: Tracing | None = None  # --otlp-traces-endpoint: OpenTelemetry spans per request
        self.sessions: SessionTable | None = None
        self.speculative: SpeculativePrefiller | None = None
        self._bg: set[asyncio.Task] = set()
        self._unregistering: dict[int, asyncio.Task] = {}  # worker id -> its KV-event listeners stopping
        self._render_checked: dict[int, int] = {}  # worker id -> the discovery its rendering was checked at
        self.remote_index: RemoteIndexers | None = None  # --use-remote-indexer: overlaps from there, no events here
        self.serve_indexer = False  # --serve-indexer: POST /query, /query_by_hash on the embedded index
        self.send_token_ids = "auto"  # --send-token-ids: which workers get completions prompts as token ids
        self._init_extensions()
        # hash-parity alarm + hit-rate decomposition, fed where a response's usage arrives
        self.parity = ParityMonitor(self.metrics.registry, lambda: self.events)
        self.metrics.add_collector(CallbackCollector(self._collect_gauges))

    # ---- extensions ---------------------------------------------------------------------------
    def _init_extensions(self) -> None:
        cfg = self.config
        self.nvext_enabled = not _truthy(os.environ.get("DYN_DISABLE_FRONTEND_NVEXT"))
        if cfg.router_queue_threshold is not None:
            from frontend.routing.admission import AdmissionQueue

            self.admission = AdmissionQueue(
                cfg.router_queue_policy,
                cfg.router_queue_threshold,
                self._queue_capacity,
                max_queued=cfg.router_queue_max,
                queue_timeout=cfg.router_queue_timeout_secs,
            )
        elif cfg.router_queue_max is not None or cfg.router_queue_timeout_secs is not None:
            log.warning(
                "--router-queue-max / --router-queue-timeout-secs bound the router queue, which only exists with "
                "--router-queue-threshold: they have no effect"
            )
        if cfg.router_session_affinity_ttl_secs is not None:
            from router.session import SessionTable

            self.sessions = SessionTable(cfg.router_session_affinity_ttl_secs)

    def _init_speculative(self, send_pinned: SendFn) -> None:
        from frontend.routing.speculative import SpeculativePrefiller

        self.speculative = SpeculativePrefiller(send_pinned, max_in_flight=4, is_busy=self._rank_busy)

    def _rank_busy(self, worker_id: int, dp_rank: int | None) -> bool:
        return warmup_target_busy(self.models, worker_id, dp_rank)

    def _queue_capacity(self, model: str, hints: RequestHints | None, threshold: float) -> bool:
        return queue_has_capacity(self.models.get(model), hints, threshold)

    def capacity_changed(self, model: str) -> None:
        adm = self.admission
        if adm is not None:
            adm.notify(model)

    # ---- ids and gauges -------------------------------------------------------------------------
    def next_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    def _collect_gauges(self):
        """Scrape-time gauges: per-worker loads from the tracker, model readiness and capacity."""
        decode = GaugeMetricFamily(
            "dynamo_frontend_worker_active_decode_blocks",
            "Decode blocks in flight per worker rank",
            labels=["worker_id", "dp_rank", "worker_type"],
        )
        prefill = GaugeMetricFamily(
            "dynamo_frontend_worker_active_prefill_tokens",
            "Prefill tokens in flight per worker rank",
            labels=["worker_id", "dp_rank", "worker_type"],
        )
        registered = GaugeMetricFamily(
            "dynamo_component_router_worker_registered",
            "Worker ranks known to the router",
            labels=["router_worker_id", "dp_rank", "worker_type"],
        )
        ready = GaugeMetricFamily(
            "dynamo_frontend_model_ready", "1 when the model has a healthy worker", labels=["model"]
        )
        blocks = GaugeMetricFamily(
            "dynamo_frontend_model_total_kv_blocks", "Total KV blocks of the model's workers", labels=["model"]
        )
        mbt = GaugeMetricFamily(
            "dynamo_frontend_model_max_num_batched_tokens",
            "Max batched tokens of the model's workers",
            labels=["model"],
        )
        bsz = GaugeMetricFamily(
            "dynamo_frontend_model_kv_cache_block_size", "KV block size of the model", labels=["model"]
        )
        depth = GaugeMetricFamily(
            "dynamo_frontend_router_queue_pending_requests",
            "Requests held in the router queue",
            labels=["model", "worker_type", "policy_class"],
        )
        q_labels = ["model", "worker_type", "policy_class"]
        pending_isl = GaugeMetricFamily(
            "dynamo_frontend_router_queue_pending_isl_tokens",
            "Prompt tokens of the requests held in the router queue",
            labels=q_labels,
        )
        pending_cached = GaugeMetricFamily(
            "dynamo_frontend_router_queue_pending_cached_tokens",
            "Cached prompt tokens (best eligible worker, when queued) of the requests held in the router queue",
            labels=q_labels,
        )
        seqs = GaugeMetricFamily(
            "dynamo_frontend_model_max_num_seqs", "Max concurrent sequences per worker of the model", labels=["model"]
        )
        ctx_len = GaugeMetricFamily(
            "dynamo_frontend_model_context_length", "Max context length of the model's workers", labels=["model"]
        )
        mismatch = GaugeMetricFamily(
            "dynamo_component_router_kv_event_source_mismatch_workers",
            "Healthy workers the router expects KV events from that have no kv_events_endpoint",
            labels=["model", "worker_type", "target_namespace", "target_component", "target_endpoint"],
        )
        kv_events_mode = self.config.kv_aware and self.config.router_kv_events and self.config.uses_indexer
        for entry in list(self.prefill_models.values()):
            if kv_events_mode:
                mismatch.add_metric(
                    [entry.name, PREFILL_WORKER_TYPE, "dynamo", "prefill", "generate"],
                    sum(1 for w in entry.workers.values() if w.healthy and not w.spec.kv_events_endpoint),
                )
        for entries, worker_type in ((self.prefill_models, PREFILL_WORKER_TYPE), (self.models, WORKER_TYPE)):
            for entry in list(entries.values()):
                tracker = entry.tracker
                for w in entry.workers.values():
                    for r in w.spec.ranks:
                        labels = [str(w.id), str(r), worker_type]
                        decode.add_metric(labels, tracker.active_decode_blocks(w.id, r))
                        prefill.add_metric(labels, tracker.active_prefill_tokens(w.id, r))
                        registered.add_metric(labels, 1 if w.healthy else 0)
        for entry in list(self.models.values()):
            ready.add_metric([entry.name], 1 if entry.ready else 0)
            total, maxbt = entry.capacity()
            if total is not None:
                blocks.add_metric([entry.name], total)
            if maxbt is not None:
                mbt.add_metric([entry.name], maxbt)
            bsz.add_metric([entry.name], entry.block_size)
            depth.add_metric(
                [entry.name, WORKER_TYPE, "default"], self.admission.depth(entry.name) if self.admission else 0
            )
            isl, cached = self.admission.pending_tokens(entry.name) if self.admission else (0, 0)
            pending_isl.add_metric([entry.name, WORKER_TYPE, "default"], isl)
            pending_cached.add_metric([entry.name, WORKER_TYPE, "default"], cached)
            ms = [w.max_num_seqs for w in entry.workers.values() if w.max_num_seqs]
            if ms:
                seqs.add_metric([entry.name], max(ms))
            cl = [w.max_model_len for w in entry.workers.values() if w.max_model_len]
            if cl:
                ctx_len.add_metric([entry.name], min(cl))  # what every worker accepts
            if kv_events_mode:
                mismatch.add_metric(
                    [entry.name, WORKER_TYPE, "dynamo", "backend", "generate"],
                    sum(1 for w in entry.workers.values() if w.healthy and not w.spec.kv_events_endpoint),
                )
        turns = CounterMetricFamily(
            "kvroute_turn_memo_prompts",
            "Completions prompts through the turn memo: continuing a remembered prompt (hit) or not (miss)",
            labels=["model", "result"],
        )
        turn_bytes = GaugeMetricFamily(
            "kvroute_turn_memo_bytes", "Estimated bytes of the prompts the turn memo remembers", labels=["model"]
        )
        for entry in list(self.models.values()):
            memo = entry.turns_in_use
            if memo is not None:
                turns.add_metric([entry.name, "hit"], memo.hits)
                turns.add_metric([entry.name, "miss"], memo.misses)
                turn_bytes.add_metric([entry.name], memo.bytes)
        health = self.events.health_metrics() if self.events is not None else []  # KV-event health per worker rank
        out = [
            decode,
            prefill,
            registered,
            ready,
            blocks,
            mbt,
            bsz,
            depth,
            pending_isl,
            pending_cached,
            seqs,
            ctx_len,
            mismatch,
            turns,
            turn_bytes,
            *health,
        ]
        events = self.events
        if events is not None:  # the embedded indexer's KV-event outcomes (as the standalone indexer exports them)
            applied = GaugeMetricFamily(
                "dynamo_kvrouter_kv_cache_events_applied",
                "KV events processed by type and outcome",
                labels=["event_type", "status"],
            )
            for (event_type, status), n in sorted(events.event_counters.items()):
                applied.add_metric([event_type, status], n)
            out.append(applied)
        return out

    # ---- worker attachment ------------------------------------------------------------------------
    def _events_registry(self):
        if self.remote_index is not None:  # the remote indexers ingest the events
            return None
        if self.events is None and self.config.kv_aware and self.config.router_kv_events and self.config.uses_indexer:
            from indexer.registry import IndexerRegistry

            self.events = IndexerRegistry()
            self.events.on_restart = self._engine_restarted
        return self.events

    def _engine_restarted(self, worker_id: int, dp_rank: int) -> None:
        """A worker's KV-event stream shows a new engine process (it restarted between two health checks):
        its sessions' engine state is gone, and what the old process said about itself is read again."""
        if self.sessions is not None:
            self.sessions.drop_worker(worker_id)
        self.pool.rediscover(worker_id)

    def _tokenizer_path(self, model: str, worker: Worker) -> str | None:
        base = worker.adapters.get(model)  # a LoRA adapter tokenizes as its base model
        return (
            self.model_paths.get(model)
            or (self.model_paths.get(base) if base else None)
            or worker.spec.model_path
            or self.model_path
        )

    async def _load_tokenizers(self, worker: Worker) -> None:
        """Load the tokenizers of a discovered worker's new models on a thread (hundreds of ms each:
        on the event loop every request would wait), so that attaching it finds them loaded."""
        from kvroute_common.tokenizer import load_tokenizer

        table = self.model_table(worker)
        for path in {self._tokenizer_path(m, worker) for m in worker.models if m not in table}:
            try:
                await asyncio.to_thread(load_tokenizer, path)
            except Exception as exc:  # attaching reports it for the model (and tries once more)
                log.warning("loading tokenizer %s for worker %s: %s", path, worker.id, exc)

    def _tokenizer_for(self, model: str, worker: Worker) -> Any:
        from kvroute_common.tokenizer import load_tokenizer

        return load_tokenizer(self._tokenizer_path(model, worker))

    def _check_tokenizer_fit(self, model: str, worker: Worker) -> None:
        """kv mode hashes the router's tokens: with the built-in tokenizer they match only the
        mocker's (which uses the same one); any other engine caches different tokens, so overlaps
        stay 0 and kv routing silently degrades into load balancing. Say so, once per worker."""
        if not self.config.kv_aware or self._tokenizer_path(model, worker) is not None:
            return
        engine = worker.capacity.engine if worker.capacity is not None else "unknown"
        if engine == "mocker":
            return
        msg = (
            f"kv routing for model {model} uses the built-in tokenizer but worker {worker.id} ({worker.spec.url}) is "
            f"{'a ' + engine + ' engine' if engine != 'unknown' else 'not the kvroute mocker'}: its KV blocks will "
            "not match "
            "the router's hashes (no prefix hits). Give --model-path (or model_path=) with the served model's tokenizer"
        )
        if msg not in worker.warnings:
            worker.warnings.append(msg)
            log.warning(msg)

    def _worker_changed(self, worker: Worker) -> None:
        if worker.healthy and worker.discovered:
            self._attach(worker)
        elif not worker.healthy:
            if worker.unreachable:
                # the process is gone and its KV cache with it; a merely failing worker keeps its
                # index and event stream (it may come back with its cache intact)
                self._stop_events(worker)
            if self.sessions is not None:
                self.sessions.drop_worker(worker.id)

    def _worker_removed(self, worker: Worker) -> None:
        self._render_checked.pop(worker.id, None)
        self._stop_events(worker)
        self.parity.forget(worker.id)
        self.router.forget_worker(worker.id)
        if self.sessions is not None:
            self.sessions.drop_worker(worker.id)
        for model in list(worker.attached_models):
            self._detach_model(worker, model)
        worker.attached_models = []

    def model_table(self, worker: Worker) -> dict[str, ModelEntry]:
        """Where a worker's models live: prefill-role workers form the prefill pools."""
        return self.prefill_models if worker.spec.is_prefill else self.models

    def _detach_model(self, worker: Worker, model: str) -> None:
        table = self.model_table(worker)
        entry = table.get(model)
        if entry is None:
            return
        entry.workers.pop(worker.id, None)
        if entry.lora_name is None:  # an adapter's requests are booked in its base model's tracker
            try:
                self.slots.unregister(worker.id, model, TENANT)
            except Exception as exc:
                log.debug("tracker unregister %s/%s: %s", worker.id, model, exc)
        if entry.approx is not None:
            entry.approx.remove_worker(worker.id)
        if not entry.workers:  # the model's last worker: the model is gone (404)
            del table[model]

    def _attach(self, worker: Worker) -> None:
        cfg = self.config
        attached = []
        for model in [m for m in worker.attached_models if m not in worker.models]:  # it stopped serving these
            self._detach_model(worker, model)
        worker.attached_models = [m for m in worker.attached_models if m in worker.models]
        table = self.model_table(worker)
        for model in worker.models:
            entry = table.get(model)
            bs = cfg.kv_cache_block_size or worker.block_size or DEFAULT_BLOCK_SIZE
            if cfg.kv_cache_block_size and worker.block_size and worker.block_size != cfg.kv_cache_block_size:
                log.warning(
                    "worker %s reports block size %s but --kv-cache-block-size is %s: prefix matches will be wrong",
                    worker.id,
                    worker.block_size,
                    cfg.kv_cache_block_size,
                )
            if entry is None:
                try:
                    tokenizer = self._tokenizer_for(model, worker)
                except Exception as exc:
                    worker.last_error = f"cannot load tokenizer for {model}: {exc}"
                    log.error("worker %s: %s", worker.id, worker.last_error)
                    continue
                approx = None
                if cfg.kv_aware and cfg.uses_indexer and not cfg.router_kv_events:
                    from indexer.approx import ApproxIndex

                    approx = ApproxIndex(
                        bs, cfg.router_ttl_secs, cfg.router_max_tree_size, cfg.router_prune_target_ratio
                    )
                thresholds = self.thresholds.get(model)
                if thresholds is None:
                    thresholds = self.thresholds[model] = BusyThresholds(
                        cfg.active_decode_blocks_threshold,
                        cfg.active_prefill_tokens_threshold,
                        cfg.active_prefill_tokens_threshold_frac,
                    )
                entry = table[model] = ModelEntry(
                    model,
                    bs,
                    tokenizer,
                    self.slots,
                    self._events_registry(),
                    approx,
                    thresholds,
                    base=worker.adapters.get(model),
                    image_options=self.image_options,
                )
            elif worker.block_size and cfg.kv_cache_block_size is None and worker.block_size != entry.block_size:
                worker.last_error = f"block size {worker.block_size} differs from model {model}'s {entry.block_size}"
                log.error("worker %s not attached to %s: %s", worker.id, model, worker.last_error)
                continue
            entry.workers[worker.id] = worker
            self._check_tokenizer_fit(model, worker)
            try:  # an adapter's requests load its base model's tracker: one engine, one KV cache
                self.slots.register(
                    worker.id, entry.base, TENANT, entry.block_size, worker.spec.dp_start, worker.spec.dp_size
                )
            except Exception as exc:  # already registered (health came back) or registered externally
                log.debug("tracker register %s/%s: %s", worker.id, model, exc)
            self._start_events(worker, entry)
            attached.append(model)
        for model in worker.attached_models:
            if model not in attached and model in table:
                attached.append(model)
        worker.attached_models = attached
        if attached and self.remote_index is not None and self.remote_index.register:
            self._spawn(self._register_remote(worker))
        if attached and self._render_checked.get(worker.id) != worker.discoveries:
            self._render_checked[worker.id] = worker.discoveries  # once per (re)discovery of the process
            self._spawn(self._check_rendering(worker))

    async def _register_remote(self, worker: Worker) -> None:
        """``--remote-indexer-register``: tell the worker's shard about its KV-event streams."""
        remote = self.remote_index
        spec = worker.spec
        if remote is None or not spec.kv_events_endpoint:
            return
        table = self.model_table(worker)
        entry = next((table[m] for m in worker.attached_models if m in table), None)
        if entry is None:
            return
        streams = [
            (r, spec.rank_endpoint(spec.kv_events_endpoint, r), spec.rank_endpoint(spec.replay_endpoint, r))
            for r in spec.ranks
        ]
        await remote.ensure_registered(worker.id, entry.base, entry.block_size, streams)  # type: ignore[arg-type]

    async def _remote_index_loop(self) -> None:
        """Every ``REMOTE_REGISTER_INTERVAL``: with ``--remote-indexer-register``, re-assert every worker on its
        shard (a shard that restarted empty is told its workers again); and read the engine restarts the
        shards' KV listeners saw, since with remote indexers no listener runs here: a worker whose engine
        restarted between two health checks is read again, as with an embedded index."""
        remote = self.remote_index
        assert remote is not None
        seen: dict[tuple[str, int, int], int] = {}
        first = True
        while True:
            if not first:  # the first counts at once: any restart after them is seen
                await asyncio.sleep(REMOTE_REGISTER_INTERVAL)
            first = False
            if remote.register:
                for worker in list(self.pool.workers.values()):
                    if worker.healthy and worker.attached_models:
                        try:
                            await self._register_remote(worker)
                        except Exception:  # never let the loop die
                            log.exception("registering worker %s on its remote indexer failed", worker.id)
            try:
                restarts = await remote.engine_restarts()
            except Exception:  # never let the loop die
                log.exception("reading the remote indexers' engine restarts failed")
                continue
            for (shard, worker_id, rank), n in restarts.items():
                before = seen.get((shard, worker_id, rank))
                if before is not None and n > before:  # lower: the shard restarted and counts again
                    log.info("worker %s rank %s: its engine restarted (seen by indexer %s)", worker_id, rank, shard)
                    self._engine_restarted(worker_id, rank)
            seen.update(restarts)  # a shard that did not answer keeps its last counts

    async def _check_rendering(self, worker: Worker) -> None:
        """Tokenizer parity before traffic: the engine's rendering of probe requests against ours."""
        from frontend.pool import render_parity

        table = self.model_table(worker)
        bases = [m for m in worker.attached_models if m not in worker.adapters and m in table]
        if not bases:
            return
        entry = table[bases[0]]
        adapter = next((table[a] for a in worker.attached_models if a in worker.adapters and a in table), None)
        try:
            check = await render_parity.check(worker, entry, adapter, self.pool.health_timeout)
        except Exception:  # a diagnostic never takes a worker out
            log.exception("render parity check of worker %s failed", worker.id)
            return
        if self.pool.workers.get(worker.id) is not worker:
            return  # removed meanwhile
        self.parity.render_checked(worker.id, check, entry.block_size)
        worker.prompt_ids_proven = check.prompt_ids == "match"
        if check.status == "mismatch":
            log.warning("worker %s: %s", worker.id, check.cause())
        else:
            log.info("worker %s: engine rendering %s %s", worker.id, check.status, check.probes)

    def _start_events(self, worker: Worker, entry: ModelEntry) -> None:
        events = self._events_registry()
        spec = worker.spec
        if events is None or not spec.kv_events_endpoint:
            return
        pending = self._unregistering.get(worker.id)
        if pending is not None and not pending.done():  # still stopping its old listeners: register after

            async def later() -> None:
                await asyncio.wait([pending])
                if self.pool.workers.get(worker.id) is worker and worker.healthy:
                    self._start_events(worker, entry)

            self._spawn(later())
            return
        inst = events.instances.get(worker.id)
        if inst is not None:  # one event stream per worker: it feeds the model it was registered for
            return
        for r in spec.ranks:
            try:
                events.register(
                    instance_id=worker.id,
                    endpoint=spec.rank_endpoint(spec.kv_events_endpoint, r),
                    model_name=entry.base,
                    tenant_id=TENANT,
                    block_size=entry.block_size,
                    dp_rank=r,
                    replay_endpoint=spec.rank_endpoint(spec.replay_endpoint, r),
                )
            except Exception as exc:
                log.debug("indexer register %s rank %s: %s", worker.id, r, exc)

    def _stop_events(self, worker: Worker) -> None:
        """A worker that is gone or unhealthy: forget its cached blocks (they may not survive)."""
        events = self.events
        if events is not None and worker.id in events.instances:
            registered = events.instances[worker.id].model_name

            async def unregister() -> None:
                try:
                    await events.unregister(worker.id, registered, forget_watermark=True)
                    log.info("worker %s: KV-event stream stopped, its cached blocks forgotten", worker.id)
                except Exception as exc:
                    log.warning("worker %s: could not stop its KV-event stream: %s", worker.id, exc)

            self._unregistering[worker.id] = self._spawn(unregister())
        for model in worker.attached_models:
            entry = self.model_table(worker).get(model)
            if entry is not None and entry.approx is not None:
                entry.approx.remove_worker(worker.id)

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.replica_sync is not None:
            await self.replica_sync.start()
        await self._start_discovery()
        for w in list(self.pool.workers.values()):
            self.pool._spawn(self.pool.probe(w))
        need = self.config.router_min_initial_workers
        if need > 0:  # --router-min-initial-workers: do not serve before that many workers are healthy
            log.info("waiting for %d healthy worker(s)", need)
            while sum(1 for w in self.pool.workers.values() if w.healthy) < need:
                await asyncio.sleep(0.2)
                await self.pool.check_all()
        self.pool.start()
        self._spawn(self._expiry_loop())
        from frontend.observability.loop_lag import StallLogger, watch_loop_lag

        self._spawn(watch_loop_lag(self.metrics.loop_lag.observe, busy=self.serving_requests))
        if self.loop_stall_threshold > 0:
            self.stall_logger = StallLogger(asyncio.get_running_loop(), self.loop_stall_threshold).start()
        if self.remote_index is not None:
            self._spawn(self._remote_index_loop())
        if self.sessions is not None:
            self._spawn(self._session_reaper())

    def serving_requests(self) -> bool:
        """Whether any transport has a request in flight (``busy_probes``)."""
        return any(probe() for probe in self.busy_probes)

    async def _start_discovery(self) -> None:
        """Start the discovery backends: they all write to this frontend's worker pool."""
        from frontend.pool.discovery import DiscoveryTarget

        target = DiscoveryTarget(self.pool, self.model_paths, self.replica_sync)
        for backend in self.discovery:
            await backend.start(target)

    @property
    def serving(self) -> bool:
        """Ready for requests: some model has a healthy worker, and not shutting down (``/health``, and
        the endpoint picker's readiness)."""
        return not self.shutting_down and any(e.ready for e in self.models.values())

    async def stop(self) -> None:
        self.shutting_down = True
        if self.stall_logger is not None:
            self.stall_logger.stop()
        for backend in self.discovery:
            await backend.stop()
        for t in list(self._bg):
            t.cancel()
        if self.admission is not None:
            self.admission.close()
        if self.speculative is not None:
            await self.speculative.aclose()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        await self.pool.stop()
        await self.image_cache.aclose()
        self.tokenize.close()
        if self.remote_index is not None:
            await self.remote_index.close()
        events = self.events
        if events is not None:
            await events.close()
        if self.tracing is not None:  # export the spans still buffered
            await asyncio.to_thread(self.tracing.shutdown)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(60.0)
            try:
                self.slots.expire_stale()
            except Exception:
                log.exception("tracker expiry failed")

    async def _session_reaper(self) -> None:
        sessions = self.sessions
        assert sessions is not None  # started only with session affinity on
        while True:
            await asyncio.sleep(sessions.reap_interval_secs)
            sessions.expire()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task
