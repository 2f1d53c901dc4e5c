"""bench/paired.py: the pairs' ratios and their report (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

from bench.paired import _command, pair_rows, summary


def _row(cpu: float, switches: float = 17.0, hit: float = 0.888) -> dict:
    return {"cpu_ms_per_request": cpu, "switches_per_request": switches, "hit_rate": hit}


def test_each_pair_is_a_over_b_and_the_report_gives_their_median_and_spread() -> None:
    pairs = [pair_rows(_row(a), _row(b)) for a, b in ((1.90, 2.00), (2.10, 2.00), (1.80, 2.00))]
    assert [p["cpu_ratio"] for p in pairs] == [0.95, 1.05, 0.9]
    text = summary(pairs, "A", "B")
    assert "| 2 | 2.10 | 2.00 | 1.050x | 17.0 / 17.0 | 88.8 % / 88.8 % |" in text
    assert "A against B, CPU a request: median **0.950x** (0.900-1.050) over 3 pairs" in text


def test_both_sides_run_the_same_pinned_data_path_cell() -> None:
    a = _command("kvroute-latency", 12, "/tmp/a1")
    b = _command("vllm-kv_aware", 12, "/tmp/b1")
    assert a[a.index("--routers") + 1] == "kvroute-latency" and b[b.index("--routers") + 1] == "vllm-kv_aware"
    for cmd in (a, b):
        assert "--pin" in cmd and cmd[cmd.index("--concurrency") + 1] == "12" and cmd[cmd.index("--runs") + 1] == "1"
