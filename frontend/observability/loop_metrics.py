"""Prometheus metric classes for values updated from the event loop only: no lock per update.

prometheus_client keeps every value behind a ``threading.Lock`` and checks, on every update, that the
metric is a labelled child; a histogram's ``observe`` then walks its buckets in Python. A routed
request makes about fifty such updates (counters, gauges, ten histograms), each a few method calls
and two lock operations on objects the loop last touched a request ago. Here a value is a plain
float attribute and a histogram finds its bucket with ``bisect``: one attribute update per counter
or gauge, two per observation.

The classes subclass prometheus_client's, so registration, ``labels()``, exposition and scrape-time
reads are the library's own; only the value storage and the update methods differ. They rely on
prometheus_client's ``_metric_init`` / ``_child_samples`` contract (tested with 0.20-0.26:
tests/test_loop_metrics.py checks every class's exposition against the library's for the same
updates). Single-threaded by design: a value updated from two threads at once can lose an update,
so anything updated off the loop keeps prometheus_client's own classes.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Gauge, Histogram


class LoopValue:
    """A metric's value without a lock (prometheus_client's ``MutexValue`` interface, what scrapes read)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: Any) -> None:  # exemplars are not kept
        pass

    def get_exemplar(self) -> None:
        return None


class LoopCounter(Counter):
    """``Counter`` updated from the event loop only."""

    def _metric_init(self) -> None:
        self._value = LoopValue()
        self._created = time.time()

    def inc(self, amount: float = 1, exemplar: Any = None) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value.value += amount


class LoopGauge(Gauge):
    """``Gauge`` updated from the event loop only."""

    def _metric_init(self) -> None:
        self._value = LoopValue()

    def inc(self, amount: float = 1) -> None:
        self._value.value += amount

    def dec(self, amount: float = 1) -> None:
        self._value.value -= amount

    def set(self, value: float) -> None:
        self._value.value = float(value)


class LoopHistogram(Histogram):
    """``Histogram`` updated from the event loop only; ``observe_many`` adds a batch of observations."""

    def _metric_init(self) -> None:
        self._buckets = [LoopValue() for _ in self._upper_bounds]
        self._sum = LoopValue()
        self._created = time.time()

    def observe(self, amount: float, exemplar: Any = None) -> None:
        self._sum.value += amount
        if amount == amount:  # NaN: in the sum only, as prometheus_client counts it
            # the first bucket whose upper bound is >= amount (the last bound is +Inf)
            self._buckets[bisect_left(self._upper_bounds, amount)].value += 1

    def observe_many(self, amounts: list[float]) -> None:
        """``observe`` each amount (a streamed request's inter-token gaps arrive in batches)."""
        bounds, buckets, total = self._upper_bounds, self._buckets, self._sum
        for v in amounts:
            total.value += v
            if v == v:
                buckets[bisect_left(bounds, v)].value += 1
