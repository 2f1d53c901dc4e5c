"""Prometheus metrics with the reference frontend's names, labels and buckets (the reference frontend's exposition,
so its dashboards work unchanged).

Each frontend owns its own ``CollectorRegistry`` (several frontends can live in one test process).
Per-worker load gauges are read from the embedded slot tracker when /metrics is scraped instead
of being updated on every lifecycle event: that keeps the request path cheap and the numbers exact.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from frontend.observability.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

try:  # the reference has no *_created series
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover
    pass


def _round2sig(x: float) -> float:
    if x == 0:
        return 0.0
    digits = 1 - int(math.floor(math.log10(abs(x))))
    return round(x, digits)


def log_buckets(name: str, lo: float, hi: float, count: int) -> list[float]:
    """Dynamo's log-spaced buckets: 0 then ``count - 1`` points up to ``hi``; env-overridable."""
    lo = float(os.environ.get(f"DYN_METRICS_{name}_MIN", lo))
    hi = float(os.environ.get(f"DYN_METRICS_{name}_MAX", hi))
    count = int(os.environ.get(f"DYN_METRICS_{name}_COUNT", count))
    out = [0.0]
    a, b = math.log(lo), math.log(hi)
    for i in range(1, count):
        v = _round2sig(math.exp(a + (b - a) * i / (count - 1)))
        if v not in out:
            out.append(v)
    return out


REQUEST_DURATION_BUCKETS = log_buckets("REQUEST_DURATION", 1, 512, 10)
ISL_BUCKETS = log_buckets("INPUT_SEQUENCE", 50, 128000, 12)
OSL_BUCKETS = log_buckets("OUTPUT_SEQUENCE", 50, 32000, 10)
TTFT_BUCKETS = log_buckets("TTFT", 0.001, 480, 18)
ITL_BUCKETS = log_buckets("ITL", 0.001, 2, 13)
KV_HIT_RATE_BUCKETS = [round(i * 0.05, 2) for i in range(21)]
TOKENIZER_MS_BUCKETS = [0.5 * 2**k for k in range(11)]  # 0.5 .. 512
HASHING_MS_BUCKETS = [0.001 * 2**k for k in range(15)]
OVERHEAD_MS_BUCKETS = [round(0.01 * 3**k, 6) for k in range(17)]

WORKER_TYPE = "decode"
PREFILL_WORKER_TYPE = "prefill"  # disaggregated serving: the prefill pool's worker_type label


class FrontendMetrics:
    """All metric families of one frontend; methods are the hot-path update points. Every value is updated
    on the event loop (``loop_metrics``: no lock per update)."""

    def __init__(self, prefix: str | None = None, router_id: str | None = None) -> None:
        p = prefix or os.environ.get("DYN_METRICS_PREFIX", "dynamo_frontend")
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.router_id = router_id or uuid.uuid4().hex[:16]
        m = ("model",)
        self.requests_total = LoopCounter(
            f"{p}_requests",
            "Requests handled",
            ("model", "endpoint", "request_type", "status", "error_type"),
            registry=r,
        )
        self.requests_started = LoopCounter(
            f"{p}_requests_started", "Requests started", ("model", "endpoint", "request_type"), registry=r
        )
        self.inflight = LoopGauge(
            f"{p}_inflight_requests", "Requests in flight (deprecated name of active_requests)", m, registry=r
        )
        self.active = LoopGauge(f"{p}_active_requests", "Requests in flight", m, registry=r)
        self.queued = LoopGauge(f"{p}_queued_requests", "Requests waiting for their first token", m, registry=r)
        self.disconnected = LoopGauge(
            f"{p}_disconnected_clients", "Clients that went away before the end of their response", registry=r
        )
        self.duration = LoopHistogram(
            f"{p}_request_duration_seconds", "Request duration", m, buckets=REQUEST_DURATION_BUCKETS, registry=r
        )
        self.isl = LoopHistogram(f"{p}_input_sequence_tokens", "Prompt tokens", m, buckets=ISL_BUCKETS, registry=r)
        self.osl = LoopHistogram(f"{p}_output_sequence_tokens", "Generated tokens", m, buckets=OSL_BUCKETS, registry=r)
        self.cached = LoopHistogram(
            f"{p}_cached_tokens",
            "Prompt tokens predicted cached on the chosen worker",
            m,
            buckets=ISL_BUCKETS,
            registry=r,
        )
        self.ttft = LoopHistogram(
            f"{p}_time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = LoopHistogram(
            f"{p}_inter_token_latency_seconds", "Inter-token latency", m, buckets=ITL_BUCKETS, registry=r
        )
        self.output_tokens = LoopCounter(f"{p}_output_tokens", "Generated tokens", m, registry=r)
        self.tokenizer_ms = LoopHistogram(
            f"{p}_tokenizer_latency_ms", "Tokenizer latency", ("operation",), buckets=TOKENIZER_MS_BUCKETS, registry=r
        )
        self.tokenize_ms = self.tokenizer_ms.labels("tokenize")  # every request's
        self.rejections = LoopCounter(
            f"{p}_model_rejection",
            "Requests rejected because every eligible worker was busy",
            ("model", "endpoint"),
            registry=r,
        )
        self.migrations = LoopCounter(
            f"{p}_model_migration",
            "Requests re-dispatched to another worker after a worker failure",
            ("model", "migration_type"),
            registry=r,
        )
        self.queue_backpressure = LoopCounter(
            f"{p}_router_queue_backpressure",
            "Requests refused by the router queue (529 + Retry-After)",
            ("model", "worker_type", "policy_class", "reason"),
            registry=r,
        )
        self.cancellations = LoopCounter(
            f"{p}_model_cancellation",
            "Requests cancelled by the client",
            ("model", "endpoint", "request_type"),
            registry=r,
        )
        # worker gauges always carry the dynamo_frontend_ prefix in the reference
        self.worker_last_ttft = LoopGauge(
            "dynamo_frontend_worker_last_time_to_first_token_seconds",
            "Last TTFT per worker",
            ("worker_id", "dp_rank", "worker_type"),
            registry=r,
        )
        self.worker_last_isl = LoopGauge(
            "dynamo_frontend_worker_last_input_sequence_tokens",
            "Last ISL per worker",
            ("worker_id", "dp_rank", "worker_type"),
            registry=r,
        )
        self.worker_last_itl = LoopGauge(
            "dynamo_frontend_worker_last_inter_token_latency_seconds",
            "Last ITL per worker",
            ("worker_id", "dp_rank", "worker_type"),
            registry=r,
        )

        hier = ("dynamo_namespace", "dynamo_component", "dynamo_endpoint", "router_id")
        self._hier = ("kvroute", "router", "generate", self.router_id)
        rp = "dynamo_component_router"
        self.router_started = LoopCounter(f"{rp}_requests_started", "Requests routed", hier, registry=r).labels(
            *self._hier
        )
        self.router_requests = LoopCounter(f"{rp}_requests", "Routed requests completed", hier, registry=r).labels(
            *self._hier
        )
        self.router_ttft = LoopHistogram(
            f"{rp}_time_to_first_token_seconds", "TTFT seen by the router", hier, buckets=TTFT_BUCKETS, registry=r
        ).labels(*self._hier)
        self.router_itl = LoopHistogram(
            f"{rp}_inter_token_latency_seconds", "ITL seen by the router", hier, buckets=ITL_BUCKETS, registry=r
        ).labels(*self._hier)
        self.router_isl = LoopHistogram(
            f"{rp}_input_sequence_tokens", "Prompt tokens routed", hier, buckets=ISL_BUCKETS, registry=r
        ).labels(*self._hier)
        self.router_osl = LoopHistogram(
            f"{rp}_output_sequence_tokens", "Output tokens routed", hier, buckets=OSL_BUCKETS, registry=r
        ).labels(*self._hier)
        self.router_kv_hit_rate = LoopHistogram(
            f"{rp}_kv_hit_rate",
            "Predicted cached fraction of the prompt on the chosen worker",
            hier,
            buckets=KV_HIT_RATE_BUCKETS,
            registry=r,
        ).labels(*self._hier)

        rid = ("router_id",)
        op = "dynamo_router_overhead"
        self.oh_block_hashing = LoopHistogram(
            f"{op}_block_hashing_ms", "Block hashing time", rid, buckets=HASHING_MS_BUCKETS, registry=r
        ).labels(self.router_id)
        self.oh_seq_hashing = LoopHistogram(
            f"{op}_seq_hashing_ms", "Sequence hashing time", rid, buckets=HASHING_MS_BUCKETS, registry=r
        ).labels(self.router_id)
        self.oh_find_matches = LoopHistogram(
            f"{op}_indexer_find_matches_ms", "Indexer lookup time", rid, buckets=OVERHEAD_MS_BUCKETS, registry=r
        ).labels(self.router_id)
        self.oh_scheduling = LoopHistogram(
            f"{op}_scheduling_ms", "Load lookup, cost and choice time", rid, buckets=OVERHEAD_MS_BUCKETS, registry=r
        ).labels(self.router_id)
        self.oh_total = LoopHistogram(
            f"{op}_total_ms", "Whole routing decision time", rid, buckets=OVERHEAD_MS_BUCKETS, registry=r
        ).labels(self.router_id)
        # a proxied request's path to its engine: from the start of its pipeline (body read, parsed,
        # tokenized, routed, booked) to its body handed to the engine's connection, first attempt only
        self.dispatch_path = LoopHistogram(
            "kvroute_dispatch_path_ms",
            "Time from a request's start to its body written to the engine (first attempt)",
            buckets=OVERHEAD_MS_BUCKETS,
            registry=r,
        )
        # disaggregated serving (frontend/routing/disagg.py): how each request's prefill phase went;
        # outcome = remote (prefilled on a prefill worker) | no_prefill_worker | prefill_failed
        self.disagg_prefill = LoopCounter(
            "kvroute_disagg_prefill_requests",
            "Requests of models with a prefill pool, by prefill outcome",
            ("model", "outcome"),
            registry=r,
        )
        # the endpoint picker (--epp-port): how each ext_proc stream ended, the messages it exchanged
        # (a streamed response body is one message per chunk), bookings moved to the engine that served
        self.epp_streams = LoopCounter(
            "kvroute_epp_streams", "Endpoint-picker ext_proc streams, by how they ended", ("end",), registry=r
        )
        self.epp_messages = LoopCounter(
            "kvroute_epp_messages", "Endpoint-picker ext_proc messages received, by kind", ("kind",), registry=r
        )
        self.epp_moved = LoopCounter(
            "kvroute_epp_bookings_moved",
            "Picked requests the gateway served on another endpoint of the list (booking moved there)",
            registry=r,
        )
        from frontend.observability.loop_lag import LAG_BUCKETS

        self.loop_lag = LoopHistogram(
            "kvroute_event_loop_lag_seconds",
            "How late the event loop ran a timer that was due (every request on the process waited as long)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self._per_model: dict[tuple[str, str, str], Any] = {}

    def model_children(self, model: str, endpoint: str, request_type: str) -> ModelMetrics:
        """Label-resolved children for one (model, endpoint, type): resolved once, reused per request."""
        key = (model, endpoint, request_type)
        mm = self._per_model.get(key)
        if mm is None:
            mm = self._per_model[key] = ModelMetrics(self, model, endpoint, request_type)
        return mm

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    __slots__ = (
        "parent",
        "model",
        "endpoint",
        "request_type",
        "started",
        "inflight",
        "active",
        "queued",
        "duration",
        "isl",
        "osl",
        "cached",
        "ttft",
        "itl",
        "output_tokens",
        "_status",
    )

    def __init__(self, f: FrontendMetrics, model: str, endpoint: str, request_type: str) -> None:
        self.parent = f
        self.model, self.endpoint, self.request_type = model, endpoint, request_type
        self.started = f.requests_started.labels(model, endpoint, request_type)
        self.inflight = f.inflight.labels(model)
        self.active = f.active.labels(model)
        self.queued = f.queued.labels(model)
        self.duration = f.duration.labels(model)
        self.isl = f.isl.labels(model)
        self.osl = f.osl.labels(model)
        self.cached = f.cached.labels(model)
        self.ttft = f.ttft.labels(model)
        self.itl = f.itl.labels(model)
        self.output_tokens = f.output_tokens.labels(model)
        self._status: dict[tuple[str, str], Any] = {}

    def finished(self, status: str, error_type: str = "") -> None:
        key = (status, error_type)
        c = self._status.get(key)
        if c is None:
            c = self._status[key] = self.parent.requests_total.labels(
                self.model, self.endpoint, self.request_type, status, error_type
            )
        c.inc()


class CallbackCollector(Collector):
    """Gauges computed at scrape time by ``produce() -> iterable of metric families``."""

    def __init__(self, produce: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._produce = produce

    def collect(self):
        yield from self._produce()

    def describe(self):
        return []
