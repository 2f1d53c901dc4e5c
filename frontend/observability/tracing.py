"""OpenTelemetry traces of the request path (``--otlp-traces-endpoint``; off unless configured).

One trace per request, joined with the client's and the engine's: the client's W3C ``traceparent``
(and ``tracestate``) is the parent of the request's span, and the engine is sent the context of
kvroute's engine-call span, so an engine started with its own ``--otlp-traces-endpoint`` (vLLM)
puts its spans in the same trace. Spans (all children of ``kvroute.request``):

- ``kvroute.tokenize``: rendering and tokenizing the prompt (``kvroute.prompt_tokens``);
- ``kvroute.queue``: from the tokenized prompt to the routing decision: the per-key rate limit, the
  router queue (``--router-queue-threshold``), a disaggregated prefill;
- ``kvroute.route`` (one per attempt; migration adds more): the decision, with ``kvroute.worker_id``,
  ``kvroute.dp_rank``, ``kvroute.overlap_blocks``, ``kvroute.cached_tokens``, ``kvroute.cost``,
  ``kvroute.router_mode``, ``kvroute.attempt``;
- ``kvroute.engine`` (CLIENT; the engine's spans are its children): the call to the engine, with
  children ``kvroute.first_token`` (sent -> first token) and ``kvroute.stream`` (first token -> end,
  ``gen_ai.usage.completion_tokens``).

The spans are created with the timestamps the request path already takes (``perf_counter``), mostly
when the request ends, so the hot path only records numbers. The standard ``OTEL_*`` variables apply:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the flag's default), ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(``grpc``, vLLM's default, or ``http/protobuf``), ``OTEL_SERVICE_NAME`` (default ``kvroute-frontend``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``;
``OTEL_SDK_DISABLED=true`` turns tracing off. With tracing off nothing here is imported and the request
path pays one ``is None`` test per step.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from frontend.dispatch.lifecycle import Lease

log = logging.getLogger("frontend.tracing")
_perf = time.perf_counter

DEFAULT_SERVICE_NAME = "kvroute-frontend"
PROTOCOLS = ("grpc", "http/protobuf")
INSTALL = "pip install 'kvroute[tracing]' (opentelemetry-sdk and its OTLP exporters)"


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("observability")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
        metavar="URL",
        help="export OpenTelemetry spans of every request to this OTLP endpoint (gRPC by default, e.g. "
        "http://collector:4317; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for .../v1/traces) and pass the "
        "trace context on to the engines (vLLM's flag of the same name joins their spans) "
        "[env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; default: off]",
    )


def tracing_from_args(ns: argparse.Namespace) -> Tracing | None:
    """The tracer the flags and ``OTEL_*`` variables ask for, None when tracing is off."""
    endpoint = ns.otlp_traces_endpoint
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if protocol not in PROTOCOLS:
        raise SystemExit(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        return Tracing(endpoint, protocol)
    except ImportError as exc:
        if exc.name and exc.name.startswith("opentelemetry.proto") and "cannot import name" in str(exc):
            raise SystemExit(
                f"--otlp-traces-endpoint: OpenTelemetry's protos are an older copy ({exc}); xds-protos (the endpoint "
                "picker's) ships one: pip install --no-deps --force-reinstall opentelemetry-proto"
            ) from None
        raise SystemExit(f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} missing): {INSTALL}") from None


class Tracing:
    """The process's tracer provider and exporter; ``follow`` traces one request."""

    def __init__(self, endpoint: str, protocol: str = "grpc") -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        exporter: Any
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            # plaintext unless the URL says https (a collector next to the router, as vLLM assumes)
            exporter = GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter(endpoint=endpoint)
        name = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        self.provider: TracerProvider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("kvroute.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self.server, self.client, self.internal = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
        # perf_counter (what the request path measures with) -> epoch nanoseconds (what spans carry)
        self.offset_ns = time.time_ns() - time.perf_counter_ns()
        self.endpoint, self.protocol = endpoint, protocol

    def ns(self, t_perf: float) -> int:
        return int(t_perf * 1e9) + self.offset_ns

    async def follow(self, pipeline: Callable[..., Awaitable[Any]], source: Any, kind: str, send: Any) -> Any:
        """Run the request path (``pipeline(source, kind, send, trace)``) inside a request span."""
        trace = RequestTrace(self, source.headers, kind, _perf())
        result: Any = None
        try:
            result = await pipeline(source, kind, send, trace)
            return result
        finally:
            trace.returned(getattr(result, "status_code", 200) if result is not None else 499)

    def shutdown(self) -> None:
        """Export what is still buffered (the frontend's exit)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. The request path tells it what happened (``tokenized``, ``routed``,
    ``engine_headers``); as a lease hook it sees the first token and the end."""

    __slots__ = (
        "t",
        "root",
        "t_tokenized",
        "engine",
        "t_sent",
        "lease",
        "attempts",
        "status",
        "returned_",
        "ended",
        "first_done",
    )

    def __init__(self, tracing: Tracing, headers: Any, kind: str, t_start: float) -> None:
        self.t = tracing
        parent = tracing.propagator.extract(headers)  # the client's traceparent, if any
        self.root: Span = tracing.tracer.start_span(
            "kvroute.request",
            context=parent,
            kind=tracing.server,
            start_time=tracing.ns(t_start),
            attributes={"kvroute.api": kind},
        )
        self.t_tokenized = t_start
        self.engine: Span | None = None
        self.t_sent = 0.0
        self.lease: Lease | None = None
        self.attempts = 0
        self.status = 0
        self.returned_ = False
        self.ended = False
        self.first_done = False

    def _span(
        self, name: str, start: float, end: float, parent: Span | None = None, attrs: dict[str, Any] | None = None
    ) -> None:
        from opentelemetry.trace import set_span_in_context

        t = self.t
        span = t.tracer.start_span(
            name,
            context=set_span_in_context(parent or self.root),
            kind=t.internal,
            start_time=t.ns(start),
            attributes=attrs,
        )
        span.end(end_time=t.ns(end))

    # ---- what the request path reports ------------------------------------------------------------

    def tokenized(self, t_start: float, model: str, prompt_tokens: int, stream: bool) -> None:
        now = _perf()
        self.t_tokenized = now
        self._span("kvroute.tokenize", t_start, now, attrs={"kvroute.prompt_tokens": prompt_tokens})
        self.root.set_attributes(
            {"gen_ai.request.model": model, "gen_ai.usage.prompt_tokens": prompt_tokens, "kvroute.stream": stream}
        )

    def routed(self, lease: Lease, t_route: float, router_mode: str) -> None:
        """A decision was made and booked (``t_route``: when routing began): the queue span (first
        attempt), the route span with the decision's terms, and this trace on the lease's hooks."""
        now = _perf()
        self.attempts += 1
        if self.attempts == 1:
            self._span("kvroute.queue", self.t_tokenized, t_route)
        d = lease.decision
        attrs: dict[str, Any] = {
            "kvroute.worker_id": d.worker.id,
            "kvroute.dp_rank": d.dp_rank,
            "kvroute.overlap_blocks": d.overlap_blocks,
            "kvroute.cached_tokens": d.cached_tokens,
            "kvroute.router_mode": router_mode,
            "kvroute.attempt": self.attempts,
            "kvroute.request_id": lease.request_id,
        }
        if d.cost is not None:
            attrs["kvroute.cost"] = float(d.cost.cost)
        if d.overlap_source is not None:
            attrs["kvroute.overlap_source"] = d.overlap_source
        self._span("kvroute.route", t_route, now, attrs=attrs)
        self.lease = lease
        if self not in lease.hooks:
            lease.hooks.append(self)

    def engine_headers(
        self, headers: list[tuple[str, str]], worker: Any, earlier: str = "retried"
    ) -> list[tuple[str, str]]:
        """The engine call starts: its span, and the headers that make it the engine's parent."""
        from opentelemetry.trace import set_span_in_context

        t = self.t
        if self.engine is not None:  # a retry or a migration: the earlier call ended here
            self.engine.set_attribute("kvroute.outcome", earlier)
            self.engine.end()
        self.t_sent = _perf()
        self.engine = span = t.tracer.start_span(
            "kvroute.engine",
            context=set_span_in_context(self.root),
            kind=t.client,
            start_time=t.ns(self.t_sent),
            attributes={"server.address": str(getattr(worker.spec, "url", "")), "kvroute.worker_id": worker.id},
        )
        carrier: dict[str, str] = {}
        t.propagator.inject(carrier, context=set_span_in_context(span))
        return [*headers, *carrier.items()]

    def migrated(
        self, lease: Lease, worker: Any, headers: list[tuple[str, str]], router_mode: str
    ) -> list[tuple[str, str]]:
        """A stream continues on another worker (``--migration-limit``): its decision, and the new
        engine call's span and headers."""
        self.routed(lease, _perf(), router_mode)
        return self.engine_headers(headers, worker, "migrated")

    # ---- lease hook -------------------------------------------------------------------------------

    def on_tokens(self, lease: Lease, n: int) -> None:
        if not self.first_done:
            self._first_token(lease)

    def _first_token(self, lease: Lease) -> None:
        t_first = lease.t_first
        if t_first is None or self.engine is None:
            return
        self.first_done = True
        self._span("kvroute.first_token", min(self.t_sent, t_first), t_first, self.engine)
        self.root.set_attribute("kvroute.ttft_ms", (t_first - lease.t_start) * 1e3)

    def on_release(self, lease: Lease) -> None:
        now = _perf()
        if not self.first_done:
            self._first_token(lease)
        if self.engine is not None:
            if self.first_done and lease.t_first is not None:
                self._span(
                    "kvroute.stream",
                    max(lease.t_first, self.t_sent),  # a migrated stream: from the last engine call
                    now,
                    self.engine,
                    {"gen_ai.usage.completion_tokens": lease.tokens_out},
                )
            self.engine.set_attribute("kvroute.outcome", lease.status if not lease.error_type else lease.error_type)
            self.engine.end(end_time=self.t.ns(now))
            self.engine = None
        self.root.set_attributes(
            {
                "gen_ai.usage.completion_tokens": lease.tokens_out,
                "kvroute.status": lease.status,
                "kvroute.error": lease.error_type,
            }
        )
        if self.returned_:
            self._end(now)

    def returned(self, status: int) -> None:
        """The request path answered (a stream goes on until its lease is released)."""
        self.returned_ = True
        self.status = status
        lease = self.lease
        if lease is None or lease.released:
            if self.engine is not None:  # sent, but no lease release followed (the request failed)
                self.engine.end()
                self.engine = None
            self._end(_perf())

    def _end(self, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        root = self.root
        root.set_attribute("http.response.status_code", self.status)
        if self.status >= 500:
            from opentelemetry.trace import Status, StatusCode

            root.set_status(Status(StatusCode.ERROR))
        root.end(end_time=self.t.ns(now))
