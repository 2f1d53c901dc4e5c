"""The frontend application: shared state, the OpenAI routes and the admin routes.

Request path (one place, in order): parse -> hints (nvext + headers) -> tokenize -> admission
(router queue) -> route (indexer overlaps + tracker loads + cost) -> book -> dispatch -> stream ->
first token = prefill complete -> end / error / disconnect = free.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvroute_common.http import ApiError, exception_handlers, json_response, read_json, route
from router.config import RouterConfig

from .busy import BusyThresholds, validate_update
from kvroute_common.openai_api import read_openai_body

from .errors import OpenAIError, model_not_found, openai_error_response
from .metrics import WORKER_TYPE, CallbackCollector, FrontendMetrics
from .models import TENANT, ModelEntry
from .proxy import Lease, StreamProxy, count_completion_tokens, upstream_headers
from .upstream import UpstreamConnectError, UpstreamError, UpstreamTimeout
from .routing import Router
from .workers import Worker, WorkerPool, WorkerSpec, WorkersFileWatcher

log = logging.getLogger("frontend")
_perf = time.perf_counter

try:  # extension modules (owned by the extensions engineer)
    from .admission import ClientDisconnected
    from .hints import RequestTiming, engine_priority, parse_request_hints
except ImportError:  # pragma: no cover
    class ClientDisconnected(Exception):  # type: ignore[no-redef]
        pass

    RequestTiming = None  # type: ignore[assignment]
    parse_request_hints = None  # type: ignore[assignment]
    engine_priority = None  # type: ignore[assignment]

DEFAULT_BLOCK_SIZE = 16


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")
BODY_LIMIT = 45 * 1024 * 1024  # DYN_HTTP_BODY_LIMIT_MB default


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
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.model_paths: dict[str, str] = dict(model_paths or {})
        self.metrics = metrics or FrontendMetrics()
        if slot_registry is None:
            from slot_tracker.core import SlotRegistry

            slot_registry = SlotRegistry()
        self.slots = slot_registry
        self.events = None  # IndexerRegistry, created on first use inside the loop
        self.models: dict[str, ModelEntry] = {}
        self.thresholds: dict[str, BusyThresholds] = {}
        self.router = Router(config, self.metrics)
        self.pool = WorkerPool(self._worker_changed, self._worker_removed, health_interval=health_interval, request_timeout=request_timeout)
        self.file_watcher: WorkersFileWatcher | None = None
        self.replica_sync = None
        self._ids = itertools.count(1)
        self._id_prefix = f"kvr-{self.metrics.router_id[:8]}-"
        self._worker_gauges: dict[tuple[int, int], tuple] = {}
        self.shutting_down = False
        self.admission = None
        self.sessions = None
        self.speculative = None
        self._bg: set[asyncio.Task] = set()
        self._unregistering: dict[int, asyncio.Task] = {}  # worker id -> its KV-event listeners stopping
        self._init_extensions()
        self.metrics.add_collector(CallbackCollector(self._collect_gauges))

    # ---- extensions ---------------------------------------------------------------------------
    def _init_extensions(self) -> None:
        cfg = self.config
        self.nvext_enabled = not _truthy(os.environ.get("DYN_DISABLE_FRONTEND_NVEXT"))
        if cfg.router_queue_threshold is not None:
            from .admission import AdmissionQueue

            self.admission = AdmissionQueue(cfg.router_queue_policy, cfg.router_queue_threshold, self._queue_capacity)
        if cfg.router_session_affinity_ttl_secs is not None:
            from router.session import SessionTable

            self.sessions = SessionTable(cfg.router_session_affinity_ttl_secs)

    def _init_speculative(self, routes: "OpenAIRoutes") -> None:
        from .speculative import SpeculativePrefiller

        self.speculative = SpeculativePrefiller(routes.send_pinned, max_in_flight=4, is_busy=self._rank_busy)

    def _rank_busy(self, worker_id: int, dp_rank: int | None) -> bool:
        """For speculative prefill: skip warm-ups to a worker that is busy or has a backlog of prefill."""
        for entry in self.models.values():
            w = entry.workers.get(worker_id)
            if w is None:
                continue
            if not w.healthy:
                return True
            t = entry.tracker
            ranks = [dp_rank] if dp_rank is not None else list(w.spec.ranks)
            th = entry.thresholds
            for r in ranks:
                prefill = t.active_prefill_tokens(worker_id, r)
                if th.enabled and th.rank_overloaded(prefill, t.active_decode_blocks(worker_id, r), w.num_gpu_blocks, w.max_num_batched_tokens):
                    return True
                if w.max_num_batched_tokens and prefill > w.max_num_batched_tokens:
                    return True
        return False

    def _queue_capacity(self, model: str, hints: Any, threshold: float) -> bool:
        from .admission import any_rank_free

        entry = self.models.get(model)
        if entry is None:
            return True
        tracker = entry.tracker
        pinned = hints.pinned_worker_id if hints is not None else None
        prank = hints.pinned_dp_rank if hints is not None else None
        ranks = [
            (tracker.active_prefill_tokens(w.id, r), w.max_num_batched_tokens)
            for w in entry.workers.values() if w.healthy and (pinned is None or w.id == pinned)
            for r in w.spec.ranks if pinned is None or prank is None or r == prank
        ]
        return any_rank_free(ranks, threshold)

    def capacity_changed(self, model: str) -> None:
        adm = self.admission
        if adm is not None:
            adm.notify(model)

    # ---- ids and gauges -------------------------------------------------------------------------
    def next_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    def worker_gauges(self, worker_id: int, dp_rank: int) -> tuple:
        g = self._worker_gauges.get((worker_id, dp_rank))
        if g is None:
            labels = (str(worker_id), str(dp_rank), WORKER_TYPE)
            m = self.metrics
            g = self._worker_gauges[(worker_id, dp_rank)] = (
                m.worker_last_ttft.labels(*labels), m.worker_last_isl.labels(*labels), m.worker_last_itl.labels(*labels))
        return g

    def _collect_gauges(self):
        """Scrape-time gauges: per-worker loads from the tracker, model readiness and capacity."""
        decode = GaugeMetricFamily("dynamo_frontend_worker_active_decode_blocks", "Decode blocks in flight per worker rank", labels=["worker_id", "dp_rank", "worker_type"])
        prefill = GaugeMetricFamily("dynamo_frontend_worker_active_prefill_tokens", "Prefill tokens in flight per worker rank", labels=["worker_id", "dp_rank", "worker_type"])
        registered = GaugeMetricFamily("dynamo_component_router_worker_registered", "Worker ranks known to the router", labels=["router_worker_id", "dp_rank", "worker_type"])
        ready = GaugeMetricFamily("dynamo_frontend_model_ready", "1 when the model has a healthy worker", labels=["model"])
        blocks = GaugeMetricFamily("dynamo_frontend_model_total_kv_blocks", "Total KV blocks of the model's workers", labels=["model"])
        mbt = GaugeMetricFamily("dynamo_frontend_model_max_num_batched_tokens", "Max batched tokens of the model's workers", labels=["model"])
        bsz = GaugeMetricFamily("dynamo_frontend_model_kv_cache_block_size", "KV block size of the model", labels=["model"])
        depth = GaugeMetricFamily("dynamo_frontend_router_queue_pending_requests", "Requests held in the router queue", labels=["model", "worker_type", "policy_class"])
        for entry in list(self.models.values()):
            tracker = entry.tracker
            for w in entry.workers.values():
                for r in w.spec.ranks:
                    labels = [str(w.id), str(r), WORKER_TYPE]
                    decode.add_metric(labels, tracker.active_decode_blocks(w.id, r))
                    prefill.add_metric(labels, tracker.active_prefill_tokens(w.id, r))
                    registered.add_metric(labels, 1 if w.healthy else 0)
            ready.add_metric([entry.name], 1 if entry.ready else 0)
            total, maxbt = entry.capacity()
            if total is not None:
                blocks.add_metric([entry.name], total)
            if maxbt is not None:
                mbt.add_metric([entry.name], maxbt)
            bsz.add_metric([entry.name], entry.block_size)
            depth.add_metric([entry.name, WORKER_TYPE, "default"], self.admission.depth(entry.name) if self.admission else 0)
        return [decode, prefill, registered, ready, blocks, mbt, bsz, depth]

    # ---- worker attachment ------------------------------------------------------------------------
    def _events_registry(self):
        if self.events is None and self.config.router_mode == "kv" and self.config.router_kv_events and self.config.uses_indexer:
            from indexer.registry import IndexerRegistry

            self.events = IndexerRegistry()
        return self.events

    def _tokenizer_for(self, model: str, worker: Worker) -> Any:
        from kvroute_common.tokenizer import load_tokenizer

        path = self.model_paths.get(model) or worker.spec.model_path or self.model_path
        return load_tokenizer(path)

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
        self._stop_events(worker)
        if self.sessions is not None:
            self.sessions.drop_worker(worker.id)
        for model in list(worker.attached_models):
            self._detach_model(worker, model)
        worker.attached_models = []

    def _detach_model(self, worker: Worker, model: str) -> None:
        entry = self.models.get(model)
        if entry is None:
            return
        entry.workers.pop(worker.id, None)
        try:
            self.slots.unregister(worker.id, model, TENANT)
        except Exception as exc:
            log.debug("tracker unregister %s/%s: %s", worker.id, model, exc)
        if entry.approx is not None:
            entry.approx.remove_worker(worker.id)
        if not entry.workers:  # the model's last worker: the model is gone (404)
            del self.models[model]

    def _attach(self, worker: Worker) -> None:
        cfg = self.config
        attached = []
        for model in [m for m in worker.attached_models if m not in worker.models]:  # it stopped serving these
            self._detach_model(worker, model)
        worker.attached_models = [m for m in worker.attached_models if m in worker.models]
        for model in worker.models:
            entry = self.models.get(model)
            bs = cfg.kv_cache_block_size or worker.block_size or DEFAULT_BLOCK_SIZE
            if cfg.kv_cache_block_size and worker.block_size and worker.block_size != cfg.kv_cache_block_size:
                log.warning("worker %s reports block size %s but --kv-cache-block-size is %s: prefix matches will be wrong",
                            worker.id, worker.block_size, cfg.kv_cache_block_size)
            if entry is None:
                try:
                    tokenizer = self._tokenizer_for(model, worker)
                except Exception as exc:
                    worker.last_error = f"cannot load tokenizer for {model}: {exc}"
                    log.error("worker %s: %s", worker.id, worker.last_error)
                    continue
                approx = None
                if cfg.router_mode == "kv" and cfg.uses_indexer and not cfg.router_kv_events:
                    from router.approx import ApproxIndex

                    approx = ApproxIndex(bs, cfg.router_ttl_secs, cfg.router_max_tree_size, cfg.router_prune_target_ratio)
                thresholds = self.thresholds.get(model)
                if thresholds is None:
                    thresholds = self.thresholds[model] = BusyThresholds(
                        cfg.active_decode_blocks_threshold, cfg.active_prefill_tokens_threshold, cfg.active_prefill_tokens_threshold_frac)
                entry = self.models[model] = ModelEntry(model, bs, tokenizer, self.slots, self._events_registry(), approx, thresholds)
            elif worker.block_size and cfg.kv_cache_block_size is None and worker.block_size != entry.block_size:
                worker.last_error = f"block size {worker.block_size} differs from model {model}'s {entry.block_size}"
                log.error("worker %s not attached to %s: %s", worker.id, model, worker.last_error)
                continue
            entry.workers[worker.id] = worker
            try:
                self.slots.register(worker.id, model, TENANT, entry.block_size, worker.spec.dp_start, worker.spec.dp_size)
            except Exception as exc:  # already registered (health came back) or registered externally
                log.debug("tracker register %s/%s: %s", worker.id, model, exc)
            self._start_events(worker, entry)
            attached.append(model)
        for model in worker.attached_models:
            if model not in attached and model in self.models:
                attached.append(model)
        worker.attached_models = attached

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
                    model_name=entry.name,
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
            model = events.instances[worker.id].model_name

            async def unregister() -> None:
                try:
                    await events.unregister(worker.id, model)
                except Exception as exc:
                    log.debug("indexer unregister %s: %s", worker.id, exc)

            self._unregistering[worker.id] = self._spawn(unregister())
        for model in worker.attached_models:
            entry = self.models.get(model)
            if entry is not None and entry.approx is not None:
                entry.approx.remove_worker(worker.id)

    def apply_workers_file(self, specs: list[WorkerSpec], models: dict[str, dict[str, Any]]) -> None:
        for name, conf in models.items():
            if isinstance(conf, dict) and conf.get("model_path"):
                self.model_paths[name] = str(conf["model_path"])
        self.pool.sync_source("file", specs)

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.replica_sync is not None:
            await self.replica_sync.start()
        if self.file_watcher is not None:
            self.file_watcher.load_now()
            self.file_watcher.start()
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
        if self.sessions is not None:
            self._spawn(self._session_reaper())

    async def stop(self) -> None:
        self.shutting_down = True
        if self.file_watcher is not None:
            self.file_watcher.stop()
        for t in list(self._bg):
            t.cancel()
        if self.admission is not None:
            self.admission.close()
        if self.speculative is not None:
            await self.speculative.aclose()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        await self.pool.stop()
        events = self.events
        if events is not None:
            await events.close()

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(60.0)
            try:
                self.slots.expire_stale()
            except Exception:
                log.exception("tracker expiry failed")

    async def _session_reaper(self) -> None:
        while True:
            await asyncio.sleep(self.sessions.reap_interval_secs)
            self.sessions.expire()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task


# ============================================================================================
# OpenAI routes
# ============================================================================================

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _tokenize(entry: ModelEntry, body: dict, chat: bool) -> list[int]:
    from kvroute_common.tokenizer import PromptError, chat_request_token_ids, completion_prompt_token_ids

    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise OpenAIError(400, "'messages' must be a non-empty list", "messages")
            # every template argument the engine honours (chat_template_kwargs, add_generation_prompt,
            # continue_final_message, tools, documents): the router must hash the engine's tokens
            return chat_request_token_ids(entry.tokenizer, body)
        if "prompt" not in body:
            raise OpenAIError(400, "'prompt' is required", "prompt")
        return completion_prompt_token_ids(entry.tokenizer, body["prompt"])
    except PromptError as exc:
        raise OpenAIError(400, str(exc)) from None


class RequestContext:
    """What one OpenAI request carries through the pipeline."""

    __slots__ = ("entry", "mm", "hints", "timing", "session", "tokens", "body", "out_body", "stream", "chat", "t_start", "endpoint", "receive",
                 "recorded")

    def __init__(self) -> None:
        self.recorded = False  # a lease has recorded the request's end in the metrics
        self.receive: Any = None
        self.hints: Any = None
        self.timing: Any = None
        self.session: Any = None

    @property
    def rewrite(self) -> bool:
        """Whether the response must be looked into (response nvext, speculative prefill)."""
        h = self.hints
        return h is not None and (h.want_worker_id or h.want_timing or h.speculative_prefill)


class OpenAIRoutes:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        state = self.state
        ctx = RequestContext()
        ctx.t_start = _perf()
        ctx.receive = request.receive
        ctx.chat = chat
        ctx.endpoint = endpoint = "chat_completions" if chat else "completions"
        mm = None
        try:
            raw, body = await read_openai_body(request, BODY_LIMIT)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise OpenAIError(400, "'model' is required", "model")
            entry = state.models.get(model)
            if entry is None:
                raise model_not_found(model)
            stream = body.get("stream", False)
            if stream is None:
                stream = False
            if not isinstance(stream, bool):
                raise OpenAIError(400, "'stream' must be a boolean", "stream")
            ctx.entry, ctx.stream, ctx.body = entry, stream, body
            ctx.mm = mm = state.metrics.model_children(model, endpoint, "stream" if stream else "unary")
            mm.started.inc()
            mm.inflight.inc()
            mm.active.inc()
            mm.queued.inc()

            modified = False
            hints = None
            if parse_request_hints is not None:
                had_nvext = "nvext" in body
                try:
                    hints = parse_request_hints(body, request.headers, nvext_enabled=state.nvext_enabled)
                except ApiError as exc:
                    raise OpenAIError(exc.status, exc.message) from None
                modified = had_nvext
                if hints.priority is not None and engine_priority is not None:
                    p = engine_priority(hints)
                    if p is not None:
                        body["priority"] = p
                        modified = True
                if hints.want_timing and RequestTiming is not None:
                    ctx.timing = RequestTiming()
                if hints.cache_salt and body.get("cache_salt") != hints.cache_salt:
                    body["cache_salt"] = hints.cache_salt  # vLLM's field: the worker hashes its blocks with it too
                    modified = True
            ctx.hints = hints

            t_tok = _perf()
            tokens = hints.token_data if (hints is not None and hints.token_data) else _tokenize(entry, body, chat)
            state.metrics.tokenizer_ms.labels("tokenize").observe((_perf() - t_tok) * 1e3)
            ctx.tokens = tokens
            ctx.out_body = orjson.dumps(body) if modified else raw

            pinned_worker = hints.pinned_worker_id if hints is not None else None
            pinned_rank = hints.pinned_dp_rank if hints is not None else None
            if state.sessions is not None and hints is not None and hints.session_id:
                try:
                    ctx.session = state.sessions.lease(model, hints.session_id)
                except Exception as exc:  # router.session.SessionError
                    raise OpenAIError(getattr(exc, "status", 400), getattr(exc, "message", str(exc))) from None
                target = ctx.session.target
                if target is not None:  # a live binding beats headers and nvext
                    pinned_worker, pinned_rank = target
            try:
                if state.admission is not None and hints is not None:
                    if ctx.timing is not None:
                        ctx.timing.router_queue_depth = state.admission.depth(model)
                    try:
                        await state.admission.wait(model, hints, new_tokens=len(tokens), receive=request.receive)
                    except ClientDisconnected:
                        mm.inflight.dec()
                        mm.active.dec()
                        mm.queued.dec()
                        mm.finished("error", "cancelled")
                        state.metrics.disconnected.inc()
                        state.metrics.cancellations.labels(model, endpoint, mm.request_type).inc()
                        if ctx.session is not None:
                            ctx.session.release()
                        return Response(b"", status_code=499)
                return await self._dispatch(ctx, pinned_worker, pinned_rank)
            except BaseException:
                if ctx.session is not None:
                    ctx.session.release()
                raise
        except OpenAIError as exc:
            if mm is not None:
                mm.inflight.dec()
                mm.active.dec()
                mm.queued.dec()
                mm.finished("error", _error_type(exc.status))
                if exc.status == 529:
                    state.metrics.rejections.labels(mm.model, endpoint).inc()
            return openai_error_response(exc.status, exc.message, exc.param)
        except asyncio.CancelledError:
            if mm is not None and not ctx.recorded:
                mm.inflight.dec()
                mm.active.dec()
                mm.queued.dec()
                mm.finished("error", "cancelled")
            raise
        except Exception as exc:  # a bug or an unexpected library error: still an OpenAI-shaped 500
            log.exception("request failed")
            if mm is not None and not ctx.recorded:
                mm.inflight.dec()
                mm.active.dec()
                mm.queued.dec()
                mm.finished("error", "internal")
            return openai_error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    async def _dispatch(self, ctx: RequestContext, pinned_worker: int | None, pinned_rank: int | None) -> Any:
        state = self.state
        entry = ctx.entry
        attempts = 0
        while True:
            attempts += 1
            decision = state.router.route(entry, ctx.tokens, pinned_worker, pinned_rank,
                                          ctx.hints.cache_salt if ctx.hints is not None else None)
            request_id = state.next_request_id()
            try:
                state.router.book(entry, request_id, decision)
            except Exception as exc:
                raise OpenAIError(503, f"could not book worker {decision.worker.id}: {exc}") from None
            state.metrics.router_started.inc()
            lease = Lease(state, entry, request_id, decision, ctx.mm, ctx.t_start)
            if state.config.router_track_output_blocks:
                lease.track_output(ctx.hints.osl if ctx.hints is not None else None)
            _record_routed(state, ctx.mm, decision)
            if ctx.timing is not None:
                from .hints import kv_hit_rate

                ctx.timing.dispatched = time.monotonic()
                ctx.timing.kv_hit_rate = kv_hit_rate(decision.overlap_blocks, decision.isl, entry.block_size)
            try:
                response = await self._send(ctx, lease)
            except BaseException:
                lease.status, lease.error_type = "error", "cancelled"
                lease.release()
                ctx.recorded = True
                raise
            if response is _RETRY:
                if attempts < 3 and pinned_worker is None:
                    lease.release(final=False)
                    continue
                lease.status, lease.error_type = "error", "unavailable"
                lease.release()
                if ctx.session is not None:
                    ctx.session.invalidate()
                    ctx.session.release()
                return openai_error_response(503, f"worker {decision.worker.id} is unreachable")
            return response

    async def _send(self, ctx: RequestContext, lease: Lease) -> Any:
        """One attempt on the lease's worker. Returns a response, or _RETRY when the worker was unreachable."""
        state = self.state
        decision = lease.decision
        worker = decision.worker
        path = "/v1/chat/completions" if ctx.chat else "/v1/completions"
        headers = upstream_headers(decision.dp_rank, lease.request_id)
        stream = ctx.stream
        session = ctx.session
        watch = None
        if not stream and ctx.receive is not None:
            # a unary request can run for a long time: a client that goes away must free its load now
            watch = _watch_disconnect(ctx.receive)
        try:
            upstream = await worker.upstream.request("POST", path, ctx.out_body, headers, stream)
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            asyncio.current_task().uncancel()
            lease.status, lease.error_type = "error", "cancelled"
            state.metrics.disconnected.inc()
            state.metrics.cancellations.labels(lease.mm.model, lease.mm.endpoint, lease.mm.request_type).inc()
            lease.release()
            if session is not None:
                session.release()
            return Response(b"", status_code=499)
        except UpstreamConnectError as exc:
            # never reached the worker: take it out (it is now excluded) and let the caller route again
            state.pool.mark_failed(worker, str(exc))
            return _RETRY
        except UpstreamTimeout as exc:
            _lease_abort(lease, 504)
            if session is not None:
                session.release()
            return openai_error_response(504, str(exc))
        except (UpstreamError, OSError) as exc:
            state.pool.mark_failed(worker, f"{type(exc).__name__}: {exc}")
            _lease_abort(lease, 500)
            if session is not None:
                session.invalidate()
                session.release()
            return openai_error_response(500, f"worker {worker.id} failed: {exc}")
        finally:
            if watch is not None:
                watch.stop()
        if upstream.status != 200:
            if stream:
                try:
                    data = await upstream.aread()
                except UpstreamError:
                    data = b""
                await upstream.aclose()
            else:
                data = upstream.content
            if session is not None:
                session.release()
            return _upstream_error(lease, upstream.status, data)
        if session is not None:
            session.bind(decision.worker.id, decision.dp_rank)
            lease.hooks.append(_SessionHook(session))
        rewriter = ResponseRewriter(self, ctx, lease) if ctx.rewrite else None
        if stream:
            return StreamProxy(upstream, lease, _SSE_HEADERS + [(b"x-data-parallel-rank", str(decision.dp_rank).encode())],
                               self._stream_failed, rewriter)
        data = upstream.content
        lease.first_token()
        n = count_completion_tokens(data)
        if n:
            lease.tokens(n)
        if rewriter is not None:
            data = rewriter.unary(data)
        lease.release()
        if rewriter is not None:
            rewriter.finished(lease)
        return _PassThrough(data, upstream.header(b"content-type", b"application/json"), decision.dp_rank)

    async def explain(self, request: Request) -> Response:
        """``POST /admin/route``: the decision an OpenAI body would get now, with every candidate's
        cost terms, without booking or sending anything (operators: "why did it go there?")."""
        state = self.state
        body = await read_json(request, dict, BODY_LIMIT)
        model = body.get("model")
        entry = state.models.get(model) if isinstance(model, str) else None
        if entry is None:
            raise ApiError(404, f"Model not found: {model}")
        chat = "messages" in body
        try:
            tokens = _tokenize(entry, body, chat)
            d = state.router.route(entry, tokens, explain=True)
        except OpenAIError as exc:
            raise ApiError(exc.status, exc.message) from None
        cands = [{"worker_id": c.worker_id, "dp_rank": c.dp_rank, "overlap_blocks": c.overlap_blocks, "prefill_tokens": c.prefill_tokens,
                  "prefill_blocks": c.prefill_blocks, "decode_blocks": c.decode_blocks, "active_requests": c.active_requests, "cost": c.cost}
                 for c in (d.costs or [])]
        return json_response({"model": entry.name, "isl": d.isl, "block_size": entry.block_size, "router_mode": state.config.router_mode,
                              "worker_id": d.worker.id, "dp_rank": d.dp_rank, "overlap_blocks": d.overlap_blocks, "candidates": cands})

    def _stream_failed(self, lease: Lease, exc: BaseException) -> None:
        self.state.pool.mark_failed(lease.decision.worker, f"{type(exc).__name__}: {exc}")

    async def send_pinned(self, body: dict, worker_id: int, dp_rank: int | None) -> None:
        """Speculative prefill warm-up: a non-streaming request pinned to (worker, rank), full lifecycle."""
        state = self.state
        model = body.get("model")
        entry = state.models.get(model) if isinstance(model, str) else None
        if entry is None:
            return
        ctx = RequestContext()
        ctx.t_start = _perf()
        ctx.chat = "messages" in body
        ctx.endpoint = "chat_completions" if ctx.chat else "completions"
        ctx.entry, ctx.stream, ctx.body = entry, False, body
        ctx.tokens = _tokenize(entry, body, ctx.chat)
        ctx.out_body = orjson.dumps(body)
        ctx.mm = mm = state.metrics.model_children(entry.name, ctx.endpoint, "unary")
        mm.started.inc()
        mm.inflight.inc()
        mm.active.inc()
        mm.queued.inc()
        try:
            await self._dispatch(ctx, worker_id, dp_rank)
        except OpenAIError as exc:
            mm.inflight.dec()
            mm.active.dec()
            mm.queued.dec()
            mm.finished("error", _error_type(exc.status))
            raise


class _SessionHook:
    """Ends the session's lease with the request (restarting its idle TTL); failures unbind it."""

    __slots__ = ("session",)

    def __init__(self, session: Any) -> None:
        self.session = session

    def on_tokens(self, lease: Lease, n: int) -> None:
        pass

    def on_release(self, lease: Lease) -> None:
        if lease.status == "error" and lease.error_type not in ("cancelled", ""):
            self.session.invalidate()
        self.session.release()


class ResponseRewriter:
    """Only for requests that asked for response metadata or speculative prefill: adds ``nvext`` to
    the final chunk / body and collects the assistant's text."""

    def __init__(self, routes: OpenAIRoutes, ctx: RequestContext, lease: Lease) -> None:
        self.routes = routes
        self.ctx = ctx
        self.lease = lease
        self.collector = None
        self._buf = b""
        if ctx.hints.speculative_prefill and routes.state.speculative is not None:
            from .speculative import TurnTextCollector

            self.collector = TurnTextCollector()

    def _nvext(self) -> dict | None:
        from .hints import response_nvext

        h = self.ctx.hints
        if not (h.want_worker_id or h.want_timing):
            return None
        timing = self.ctx.timing
        if timing is not None:
            now = time.monotonic()
            if timing.first_token is None:
                timing.first_token = now
            timing.finished = now
        d = self.lease.decision
        return response_nvext(h, d.worker.id, d.dp_rank, timing)

    def unary(self, data: bytes) -> bytes:
        if self.collector is not None:
            self.collector.feed_json(data)
        ext = self._nvext()
        if ext is None:
            return data
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(obj, dict):
            obj["nvext"] = ext
            return orjson.dumps(obj)
        return data

    def first_token(self) -> None:
        t = self.ctx.timing
        if t is not None and t.first_token is None:
            t.first_token = time.monotonic()

    def chunk(self, data: bytes) -> bytes:
        """Rewrite whole SSE events; a partial event is held until its end arrives."""
        if self.collector is not None:
            self.collector.feed_sse(data)
        h = self.ctx.hints
        if not (h.want_worker_id or h.want_timing):
            return data
        buf = self._buf + data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2:]
        events = buf[: end + 2].split(b"\n\n")
        out = []
        for ev in events:
            if not ev:
                continue
            if ev.startswith(b"data: {") and b'"finish_reason":null' not in ev.replace(b" ", b""):
                try:
                    obj = orjson.loads(ev[6:])
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict) and any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or []):
                    ext = self._nvext()
                    if ext is not None:
                        obj["nvext"] = ext
                        ev = b"data: " + orjson.dumps(obj)
            out.append(ev + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        buf, self._buf = self._buf, b""
        return buf

    def finished(self, lease: Lease) -> None:
        """After a successful turn: schedule the speculative next-turn prefill."""
        spec = self.routes.state.speculative
        c = self.collector
        if spec is None or c is None or lease.status != "success":
            return
        d = lease.decision
        spec.on_turn_finished(orjson.loads(self.ctx.out_body), c.text(), d.worker.id, d.dp_rank)


_RETRY = object()


class _watch_disconnect:
    """Cancels the current task when the client disconnects (one extra task, only for unary requests)."""

    __slots__ = ("task", "gone", "_owner")

    def __init__(self, receive: Any) -> None:
        self.gone = False
        self._owner = asyncio.current_task()
        self.task = asyncio.get_running_loop().create_task(self._run(receive))

    async def _run(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._owner.cancel()
                return

    def stop(self) -> None:
        if not self.task.done():
            self.task.cancel()


class _PassThrough:
    """A worker's complete JSON answer, sent as is (cheaper than building a starlette Response)."""

    __slots__ = ("body", "content_type", "rank")

    def __init__(self, body: bytes, content_type: bytes, rank: int) -> None:
        self.body, self.content_type, self.rank = body, content_type, rank

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", self.content_type), (b"content-length", str(len(self.body)).encode()),
            (b"x-data-parallel-rank", str(self.rank).encode())]})
        await send({"type": "http.response.body", "body": self.body})


def _record_routed(state: FrontendState, mm: Any, decision: Any) -> None:
    isl = decision.isl
    mm.isl.observe(isl)
    mm.cached.observe(decision.cached_tokens)
    m = state.metrics
    m.router_isl.observe(isl)
    if isl:
        m.router_kv_hit_rate.observe(decision.cached_tokens / isl)
    state.worker_gauges(decision.worker.id, decision.dp_rank)[1].set(isl)


def _lease_abort(lease: Lease, status: int) -> None:
    lease.status, lease.error_type = "error", _error_type(status)
    lease.release()


def _upstream_error(lease: Lease, status: int, data: bytes) -> Response:
    """Worker said no: 4xx passes through with its message, 5xx becomes a generic 500."""
    _lease_abort(lease, status)
    if 400 <= status < 500:
        msg = _error_message(data) or f"worker returned {status}"
        return openai_error_response(status, msg)
    return openai_error_response(500, "Internal server error")


def _error_message(data: bytes) -> str | None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace")[:500] or None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return obj["message"]
    return None


def _error_type(status: int) -> str:
    from .errors import error_type_label

    return error_type_label(status)


# ============================================================================================
# Admin routes: models, health, metrics, busy thresholds, worker registration
# ============================================================================================


class AdminRoutes:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "kvroute"} for name in sorted(self.state.models)]
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.state.models:
            return openai_error_response(404, f"Model not found: {name}", "model")
        return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvroute"})

    async def health(self, request: Request) -> Response:
        st = self.state
        if st.shutting_down:
            return json_response({"status": "shutting_down", "message": "Service is shutting down"}, 503)
        workers = list(st.pool.workers.values())
        instances = [{"worker_id": w.id, "url": w.spec.url, "healthy": w.healthy, "models": w.models, "dp_size": w.spec.dp_size,
                      "last_error": w.last_error} for w in workers]
        endpoints = sorted({w.spec.url for w in workers if w.healthy})
        ready = any(e.ready for e in st.models.values())
        body = {"status": "healthy" if ready else "not_ready",
                "message": "Service is ready" if ready else "No healthy worker yet",
                "endpoints": endpoints, "instances": instances, "models": sorted(st.models)}
        return json_response(body, 200 if ready else 503)

    async def live(self, request: Request) -> Response:
        if self.state.shutting_down:
            return json_response({"status": "shutting_down", "message": "Service is shutting down"}, 503)
        return json_response({"status": "live", "message": "Service is live"})

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- /busy_threshold ------------------------------------------------------------------------
    async def busy_threshold_get(self, request: Request) -> Response:
        st = self.state
        items = [t.to_dict(m) for m, t in sorted(st.thresholds.items()) if t.enabled]
        return json_response({"thresholds": items})

    async def busy_threshold_post(self, request: Request) -> Response:
        st = self.state
        body = await read_json(request, dict)
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(422, "Failed to deserialize the JSON body into the target type: missing field `model`")
        decode = body.get("active_decode_blocks_threshold")
        prefill = body.get("active_prefill_tokens_threshold")
        frac = body.get("active_prefill_tokens_threshold_frac")
        if isinstance(prefill, float) and prefill.is_integer():
            prefill = int(prefill)
        for name, v in (("active_decode_blocks_threshold", decode), ("active_prefill_tokens_threshold", prefill),
                        ("active_prefill_tokens_threshold_frac", frac)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ApiError(422, f"Failed to deserialize the JSON body into the target type: {name}: invalid type")
        if decode is None and prefill is None and frac is None:
            t = st.thresholds.get(model) or BusyThresholds()
            return json_response(t.to_dict(model))
        try:
            validate_update(decode, prefill, frac)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if model not in st.models:
            raise ApiError(404, f"Model '{model}' not found. Thresholds can only be set for discovered models.")
        t = st.thresholds.get(model)
        if t is None:
            t = st.thresholds[model] = BusyThresholds()
            st.models[model].thresholds = t
        if decode is not None:
            t.active_decode_blocks_threshold = float(decode)
        if prefill is not None:
            t.active_prefill_tokens_threshold = int(prefill)
        if frac is not None:
            t.active_prefill_tokens_threshold_frac = float(frac)
        st.capacity_changed(model)
        return json_response(t.to_dict(model))

    # ---- worker registration API ----------------------------------------------------------------
    async def workers_list(self, request: Request) -> Response:
        st = self.state
        events = {e["instance_id"]: e for e in st.events.workers()} if st.events is not None else {}
        rows = []
        for w in sorted(st.pool.workers.values(), key=lambda w: w.id):
            row = w.describe()
            ev = events.get(w.id)
            if ev is not None:  # the embedded indexer's KV-event listeners of this worker
                row["kv_events"] = {"status": ev["status"], "listeners": ev["listeners"]}
            rows.append(row)
        body: dict[str, Any] = {"workers": rows}
        if st.file_watcher is not None:
            body["workers_file"] = {"path": st.file_watcher.path, "last_error": st.file_watcher.last_error}
        return json_response(body)

    async def workers_add(self, request: Request) -> Response:
        body = await read_json(request, dict)
        try:
            spec = WorkerSpec.from_mapping(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        pool = self.state.pool
        existing = pool.workers.get(spec.id)
        worker = pool.add(spec, "api")
        if request.query_params.get("wait", "true").lower() not in ("0", "false", "no"):
            await pool.probe(worker)
        return json_response(worker.describe(), 200 if existing is not None else 201)

    async def workers_remove(self, request: Request) -> Response:
        try:
            worker_id = int(request.path_params["worker_id"])
        except ValueError:
            raise ApiError(400, "worker id must be an integer") from None
        if self.state.pool.remove(worker_id) is None:
            raise ApiError(404, f"worker {worker_id} not found")
        return json_response({"status": "ok"})


def _tracker_routes(state: FrontendState) -> list[BaseRoute]:
    """The slot tracker's HTTP API on the frontend's port, backed by the embedded tracker."""
    try:
        from slot_tracker import service
    except ImportError:  # pragma: no cover
        return []
    factory = getattr(service, "tracker_routes", None)
    if factory is None:
        return []
    routes = factory(state.slots, state.replica_sync)
    # the frontend's own /health wins
    return [r for r in routes if getattr(r, "path", None) != "/health"]


def build_app(state: FrontendState) -> Starlette:
    oa = OpenAIRoutes(state)
    state._init_speculative(oa)
    ad = AdminRoutes(state)
    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", oa.chat_completions, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
        Route("/v1/models", ad.models, methods=["GET"]),
        Route("/v1/models/{model:path}", ad.model, methods=["GET"]),
        Route("/health", ad.health, methods=["GET"]),
        Route("/live", ad.live, methods=["GET"]),
        Route("/metrics", ad.metrics, methods=["GET"]),
        route("/busy_threshold", ad.busy_threshold_get, ["GET"]),
        route("/busy_threshold", ad.busy_threshold_post, ["POST"]),
        route("/admin/workers", ad.workers_list, ["GET"]),
        route("/admin/workers", ad.workers_add, ["POST"]),
        route("/admin/workers/{worker_id}", ad.workers_remove, ["DELETE"]),
        route("/admin/route", oa.explain, ["POST"]),
    ]
    routes += _tracker_routes(state)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = Starlette(routes=routes, exception_handlers=exception_handlers(), lifespan=lifespan)
    app.state.frontend = state
    return app
