"""What a routed request's metric updates cost: prometheus_client's classes against the frontend's loop classes.

A request updates about thirty metric values on the event loop (histograms for its TTFT, durations,
sequence lengths and routing overheads; counters; in-flight gauges). This times one request's worth,
the same updates on both kinds of metric, warm (in a tight loop) and cold (a 32 MB buffer written
between two requests, as the loop's other work does to the CPU caches between one request's updates).

    python -m bench metrics_updates
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from frontend.observability.loop_metrics import LoopCounter, LoopGauge, LoopHistogram
from frontend.observability.metrics import OVERHEAD_MS_BUCKETS

HISTOGRAMS, COUNTERS, GAUGES = 14, 8, 3  # one streamed, routed request's updates (frontend/observability)


def _request(counter: type, gauge: type, histogram: type) -> Callable[[], None]:
    registry = CollectorRegistry()
    hs = [
        histogram(f"h{i}", "x", ["m"], buckets=OVERHEAD_MS_BUCKETS, registry=registry).labels("a")
        for i in range(HISTOGRAMS)
    ]
    cs = [counter(f"c{i}", "x", ["m"], registry=registry).labels("a") for i in range(COUNTERS)]
    gs = [gauge(f"g{i}", "x", ["m"], registry=registry).labels("a") for i in range(GAUGES)]

    def one() -> None:
        for h in hs:
            h.observe(0.37)
        for c in cs:
            c.inc()
        for g in gs:
            g.inc()
            g.dec()

    return one


def _time(one: Callable[[], None], requests: int, cold: bool) -> float:
    evict = bytearray(32 << 20)
    total = 0.0
    for i in range(requests):
        if cold:
            evict[::64] = bytes([i & 0xFF]) * (len(evict) // 64)  # a write to every cache line
        t0 = time.perf_counter()
        one()
        total += time.perf_counter() - t0
    return total / requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench metrics_updates", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args(argv)
    print(f"one request's {HISTOGRAMS} observations, {COUNTERS} counter and {GAUGES * 2} gauge updates, us (mean)")
    print("| metric classes | warm | cold |")
    print("| --- | --- | --- |")
    for name, classes in (
        ("prometheus_client (Counter, Gauge, Histogram)", (Counter, Gauge, Histogram)),
        ("frontend loop_metrics (LoopCounter, LoopGauge, LoopHistogram)", (LoopCounter, LoopGauge, LoopHistogram)),
    ):
        one = _request(*classes)
        warm, cold = _time(one, args.requests, False), _time(one, args.requests // 4, True)
        print(f"| {name} | {warm * 1e6:.1f} | {cold * 1e6:.1f} |")
    return 0
