"""The event loop's metric classes expose exactly what prometheus_client's own do for the same updates."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frontend.observability.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

BUCKETS = [0.001, 0.005, 0.01, 0.1, 1.0]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):  # a timestamp: differs between any two metrics
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _same(a: CollectorRegistry, b: CollectorRegistry) -> None:
    x, y = _samples(a), _samples(b)
    assert x.keys() == y.keys()
    for key, value in x.items():
        if math.isnan(value):
            assert math.isnan(y[key]), key
        elif key[0].endswith("_sum"):
            assert y[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        else:
            assert y[key] == value, key


def test_counter_gauge_and_histogram_expose_what_the_library_does() -> None:
    rng = random.Random(7)
    lib, loop = CollectorRegistry(), CollectorRegistry()
    pairs = [
        (Counter("c", "a counter", ["m"], registry=lib), LoopCounter("c", "a counter", ["m"], registry=loop)),
        (Gauge("g", "a gauge", ["m"], registry=lib), LoopGauge("g", "a gauge", ["m"], registry=loop)),
        (
            Histogram("h_seconds", "a histogram", ["m"], buckets=BUCKETS, registry=lib),
            LoopHistogram("h_seconds", "a histogram", ["m"], buckets=BUCKETS, registry=loop),
        ),
    ]
    # bounds themselves (le is inclusive), between them, below the first, above the last, negative, +Inf, NaN
    values = [0.0, 0.001, 0.003, 0.005, 0.01, 0.05, 1.0, 7.5, -2.0, math.inf, math.nan]
    for _ in range(2000):
        label = rng.choice(["a", "b"])
        kind = rng.randrange(6)
        for reference, ours in pairs:
            r, o = reference.labels(label), ours.labels(label)
            if isinstance(reference, Counter):
                amount = rng.choice([1, 2.5]) if kind < 5 else 0
                r.inc(amount)
                o.inc(amount)
            elif isinstance(reference, Gauge):
                if kind < 2:
                    r.inc(kind + 1)
                    o.inc(kind + 1)
                elif kind < 4:
                    r.dec(0.5)
                    o.dec(0.5)
                else:
                    r.set(kind * 1.5)
                    o.set(kind * 1.5)
        v = values[rng.randrange(len(values) - 1)]  # NaN only below: it makes the whole sum NaN
        pairs[2][0].labels(label).observe(v)
        pairs[2][1].labels(label).observe(v)
    _same(lib, loop)
    pairs[2][0].labels("a").observe(math.nan)
    pairs[2][1].labels("a").observe(math.nan)
    _same(lib, loop)


def test_observe_many_is_one_observe_per_value() -> None:
    rng = random.Random(5)
    values = [rng.choice([0.0, 0.001, 0.003, 0.005, 0.01, 0.05, 1.0, 7.5]) for _ in range(1000)]
    lib, loop = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("itl_seconds", "x", ["model"], buckets=BUCKETS, registry=lib).labels("m")
    h2 = LoopHistogram("itl_seconds", "x", ["model"], buckets=BUCKETS, registry=loop).labels("m")
    for v in values:
        h1.observe(v)
    for start in range(0, len(values), 64):
        h2.observe_many(values[start : start + 64])
    h2.observe_many([])
    _same(lib, loop)
    assert _samples(loop)[("itl_seconds_count", (("model", "m"),))] == len(values)


def test_misuse_fails_as_with_the_library() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("c", "a counter", ["m"], registry=registry)
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(Exception):  # noqa: B017 - a labelled parent has no value to update
        counter.inc()
    with pytest.raises(Exception):  # noqa: B017
        LoopHistogram("h", "x", ["m"], registry=registry).observe(1.0)
    assert _samples(registry) == {("c_total", (("m", "a"),)): 0.0}  # the refused update left nothing behind
