"""The frontend's listener of the request lifecycle (``frontend/dispatch/lifecycle.py``): Prometheus metrics per
request and per worker rank, the latency model's TTFT observations, and the admission queue's wake-ups.

The lease says what happened; this decides what each event updates, so a new metric or consumer is
added here and the request path does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from frontend.observability.metrics import WORKER_TYPE, FrontendMetrics

if TYPE_CHECKING:
    from frontend.dispatch.lifecycle import Lease
    from frontend.routing.request_router import RequestRouter

WorkerGauges = tuple  # (last TTFT, last ISL, last ITL) children of one (worker, rank, worker type)


class RequestMetrics:
    """Implements ``LifecycleListener`` for the frontend."""

    def __init__(
        self, metrics: FrontendMetrics, router: RequestRouter, capacity_changed: Callable[[str], None]
    ) -> None:
        self.metrics = metrics
        self.router = router
        self.capacity_changed = capacity_changed
        self._worker_gauges: dict[tuple[int, int, str], WorkerGauges] = {}

    def worker_gauges(self, worker_id: int, dp_rank: int, worker_type: str = WORKER_TYPE) -> WorkerGauges:
        g = self._worker_gauges.get((worker_id, dp_rank, worker_type))
        if g is None:
            labels = (str(worker_id), str(dp_rank), worker_type)
            m = self.metrics
            g = self._worker_gauges[(worker_id, dp_rank, worker_type)] = (
                m.worker_last_ttft.labels(*labels),
                m.worker_last_isl.labels(*labels),
                m.worker_last_itl.labels(*labels),
            )
        return g

    def first_token(self, lease: Lease, ttft: float, now: float, streamed: bool) -> None:
        if streamed:  # an answer that arrived whole says nothing about the time to its first token
            self.router.observe_first_token(lease.entry, lease.decision, now)
        mm = lease.mm
        mm.ttft.observe(ttft)
        mm.queued.dec()
        self.metrics.router_ttft.observe(ttft)
        self.worker_gauges(lease.decision.worker.id, lease.decision.dp_rank)[0].set(ttft)

    def tokens(self, lease: Lease, n: int, gaps: list[float]) -> None:
        if gaps:
            lease.mm.itl.observe_many(gaps)
            self.metrics.router_itl.observe_many(gaps)
        lease.mm.output_tokens.inc(n)

    def cancelled(self, lease: Lease) -> None:
        self.metrics.disconnected.inc()
        mm = lease.mm
        self.metrics.cancellations.labels(mm.model, mm.endpoint, mm.request_type).inc()

    def released(self, lease: Lease, duration: float) -> None:
        mm = lease.mm
        if not lease.ttft_recorded:
            mm.queued.dec()
        mm.duration.observe(duration)
        mm.inflight.dec()
        mm.active.dec()
        mm.osl.observe(lease.tokens_out)
        mm.finished(lease.status, lease.error_type)
        m = self.metrics
        m.router_requests.inc()
        m.router_osl.observe(lease.tokens_out)
        if lease.tokens_out > 1 and lease.t_first is not None and lease.t_last is not None:
            self.worker_gauges(lease.decision.worker.id, lease.decision.dp_rank)[2].set(
                (lease.t_last - lease.t_first) / (lease.tokens_out - 1)
            )
