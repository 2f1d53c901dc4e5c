"""How late KV-event batches are applied: one histogram per process over every listener.

Each batch carries the engine's wall clock at publishing (``ts``); the delay from there to its being
applied is the index lag of that batch. The per-worker gauges show the newest batch only; this
histogram counts every batch, so its quantiles are the index lag's distribution (p99 over a window is
the difference of two scrapes). Observing costs a bisect and an increment (why: it runs per batch on
the ingest path, beside a few microseconds of work per block).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# upper bounds in seconds; the last bucket (+Inf) takes the rest
BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

NAME = "kvroute_kv_index_apply_lag_seconds"


class LagHistogram:
    """Counts of batch apply lags per bucket, with their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def metric(self) -> Any:
        """The histogram as a Prometheus family (cumulative buckets)."""
        from prometheus_client.core import HistogramMetricFamily

        cumulative, running = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        fam = HistogramMetricFamily(
            NAME,
            "Seconds from an engine publishing a KV-event batch to its being applied to the index (every batch)",
        )
        fam.add_metric([], cumulative, self.total)
        return fam


def quantile(q: float, bounds: list[float], counts: list[float]) -> float:
    """The ``q`` quantile of a histogram given as per-bucket counts (not cumulative), interpolated
    linearly inside its bucket as Prometheus' ``histogram_quantile`` does; NaN when empty."""
    total = sum(counts)
    if total <= 0:
        return float("nan")
    rank, seen, lower = q * total, 0.0, 0.0
    for upper, n in zip(bounds, counts, strict=True):
        if n and seen + n >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
        lower = upper
    return lower
