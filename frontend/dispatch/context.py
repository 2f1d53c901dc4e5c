"""What one generation request carries down the request path, and where it came from (the HTTP API, or
a gateway asking the endpoint picker); ``Send`` is the step that takes a booked request to its worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Receive

from frontend.dispatch.lifecycle import Lease
from frontend.dispatch.stream_dialect import ANTHROPIC, OPENAI, StreamDialect
from frontend.observability.parity import RequestProbe, UsageTap
from frontend.request.hints import RequestTiming
from frontend.routing import disagg as _disagg
from frontend.routing.models import ModelEntry
from frontend.routing.prompt import Prompt, with_prompt_ids
from frontend.routing.routing_record import wants_routing
from frontend.state import FrontendState
from kvroute_common.openai_api import read_openai_body

if TYPE_CHECKING:
    from frontend.observability.metrics import ModelMetrics
    from frontend.observability.tracing import RequestTrace
    from frontend.request.hints import RequestHints
    from frontend.routing.rate_limits import KeyState
    from router.session import SessionLease

log = logging.getLogger("frontend")
_perf = time.perf_counter


class RequestContext:
    """What one generation request carries through the pipeline."""

    __slots__ = (
        "entry",
        "mm",
        "count_as",
        "hints",
        "timing",
        "session",
        "tokens",
        "body",
        "out_body",
        "engine_ids",
        "ids_body",
        "stream",
        "chat",
        "t_start",
        "endpoint",
        "receive",
        "counting",
        "attempt",
        "probe",
        "evidence",
        "strip_usage",
        "migrations",
        "failed_workers",
        "pinned",
        "kind",
        "path",
        "prefill",
        "soft_target",
        "prompt",
        "rate",
        "trace",
        "dispatched",
        "routed_notes",
    )
    # set by the route before the request is routed
    t_start: float
    chat: bool
    endpoint: str
    stream: bool
    body: dict[str, Any]
    out_body: bytes
    tokens: Sequence[int]
    prompt: Prompt

    def __init__(self) -> None:
        self.kind = "chat"  # chat | completions | responses | messages | embeddings (see _KINDS)
        self.path = "/v1/chat/completions"
        self.counting = False  # in the metrics (count_start) and its end not recorded yet (lease or finish_unrouted)
        self.attempt: Lease | None = None  # the lease of the latest attempt booked for it
        self.probe: RequestProbe | None = None  # the parity evidence of the current attempt
        self.evidence = False  # sampled for parity evidence (ParityMonitor.sample): usage asked, probes made
        self.strip_usage = False  # the engine was asked for stream usage the client did not want
        self.migrations = 0  # times this request moved to another worker (--migration-limit)
        self.failed_workers: set[int] | None = None  # workers it failed on: not chosen again for it
        self.pinned = False
        self.prefill: _disagg.PrefillResult | None = None  # once a prefill worker computed the prompt
        self.soft_target: tuple[int, int | None] | None = None  # soft session affinity: preferred (worker, rank)
        self.receive: Receive | None = None
        self.hints: RequestHints | None = None
        self.timing: RequestTiming | None = None
        self.session: SessionLease | None = None
        self.rate: KeyState | None = None  # per-key rate limits: the key's buckets (charged at the end)
        self.trace: RequestTrace | None = None  # --otlp-traces-endpoint: the request's spans
        self.dispatched = False  # its first attempt's body went to an engine (kvroute_dispatch_path_ms)
        self.engine_ids: Sequence[int] | None = None  # a completions prompt as ids, for workers that take them
        self.ids_body: bytes | None = None  # out_body with engine_ids as its prompt, built on first use
        # the current attempt's booking still to record once its request is sent (RequestPath._dispatch)
        self.routed_notes: Callable[[], None] | None = None
        self.entry: ModelEntry
        self.mm: ModelMetrics
        # its metrics once its model and type are known, until count_start (see count_refused)
        self.count_as: ModelMetrics | None = None

    def sent(self) -> None:
        """The current attempt's request is written to its worker (or handed over, or failed before):
        record the rest of its booking, once. A ``Send`` calls this as soon as the bytes are out, before
        it waits for anything, so the next decision sees this one."""
        notes = self.routed_notes
        if notes is not None:
            self.routed_notes = None
            try:
                notes()
            except Exception:  # a bug here must not fail a request already sent, nor skip its release
                log.exception("recording a routed decision failed")

    def body_for(self, takes_ids: bool) -> bytes:
        """The body a worker gets: ``out_body``, with the prompt as the router's ids where it takes them."""
        if not takes_ids or self.engine_ids is None:
            return self.out_body
        if self.ids_body is None:
            self.ids_body = with_prompt_ids(self.out_body, self.engine_ids)
        return self.ids_body

    def usage_tap(self) -> UsageTap | None:
        """What reads a stream's usage for the probe and strips what the client did not ask for; None when
        there is neither (a request not sampled for evidence: its stream passes untouched)."""
        if self.probe is None and not self.strip_usage:
            return None
        return UsageTap(self.probe, self.strip_usage, self.dialect.usage_key, self.dialect.parse_usage)

    def count_start(self, mm: ModelMetrics) -> None:
        """The request enters the metrics: started, in flight, waiting for its first token."""
        self.mm = mm
        self.count_as = None
        mm.started.inc()
        mm.inflight.inc()
        mm.active.inc()
        mm.queued.inc()
        self.counting = True

    def count_refused(self) -> None:
        """A request refused once its model and type were known but before ``count_start`` (a value out
        of range, a model nobody serves) enters the request metrics here, to end as an error: a request
        that parses counts whatever its fate, one that does not (``RequestShapeError``) never does."""
        mm = self.count_as
        if mm is not None:
            self.count_start(mm)

    def finish_unrouted(self, error_type: str, *, client_gone: bool = False, rejected: bool = False) -> None:
        """End a request that no lease ended (refused, failed or cancelled before its booking, or between
        two attempts) and give back its session lease. Idempotent, and a no-op once a lease recorded the
        end (``counting`` cleared): the gauges ``count_start`` raised come down once and
        ``requests_total`` counts the request once. ``client_gone``: the client went away (a
        cancellation); ``rejected``: refused because every eligible worker was busy."""
        if self.session is not None:
            self.session.release()
        if not self.counting:
            return
        self.counting = False
        mm = self.mm
        mm.duration.observe(time.perf_counter() - self.t_start)
        mm.inflight.dec()
        mm.active.dec()
        if self.attempt is None or not self.attempt.ttft_recorded:  # a first token already left the queue
            mm.queued.dec()
        mm.finished("error", error_type)
        m = mm.parent
        if client_gone:
            m.disconnected.inc()
            m.cancellations.labels(mm.model, mm.endpoint, mm.request_type).inc()
        if rejected:
            m.rejections.labels(mm.model, mm.endpoint).inc()

    @property
    def dialect(self) -> StreamDialect:
        return ANTHROPIC if self.kind == "messages" else OPENAI

    @property
    def rewrite(self) -> bool:
        """Whether the response must be looked into (response nvext, speculative prefill)."""
        h = self.hints
        return h is not None and (
            h.want_worker_id or h.want_timing or h.want_stop_reason or h.speculative_prefill or wants_routing(h)
        )


class RequestSource(Protocol):
    """Where a generation request comes from: the HTTP API, or a gateway asking the endpoint picker."""

    @property
    def headers(self) -> Headers:
        """The request's headers (``x-dynamo-*`` routing hints)."""

    @property
    def receive(self) -> Receive | None:
        """The client's ASGI receive (disconnect detection), None without one."""

    async def read(self, limit: int) -> tuple[bytes, dict[str, Any]]:
        """The raw body and its JSON object (OpenAIError 413 / 400)."""

    def excluded(self, state: FrontendState) -> set[int] | None:
        """Workers this request must not go to (a gateway's endpoint subset), None for none."""

    @property
    def reads_response(self) -> bool:
        """Whether the response's body passes through kvroute: only then is the engine asked for stream
        usage the client did not ask for (read for the parity alarm, then taken out of the client's stream)."""


class HttpSource:
    """A request on the frontend's own HTTP API."""

    __slots__ = ("request", "headers", "receive")
    reads_response = True  # the proxy relays every chunk

    def __init__(self, request: Request) -> None:
        self.request = request
        self.headers = request.headers
        self.receive: Receive | None = request.receive

    async def read(self, limit: int) -> tuple[bytes, dict[str, Any]]:
        return await read_openai_body(self.request, limit)

    def excluded(self, state: FrontendState) -> set[int] | None:
        return None


# the proxy's dispatch (RequestPath.send), or the endpoint picker's hand-over to its gateway; either calls
# ``ctx.sent()`` once the request is on its way
Send = Callable[[RequestContext, Lease], Awaitable[Any]]
