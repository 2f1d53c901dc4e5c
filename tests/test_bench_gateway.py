"""The gateway benchmark's summary over runs (python -m bench gateway --workload agentic --runs N): the
medians and each run's CPU against the proxy's in that same run. Pure rows, no process started."""

from __future__ import annotations

import pytest

from bench import gateway


def row(path: str, concurrency: int, cpu: float, ttft: float, hit: float | None = 0.8) -> dict:
    return {"path": path, "concurrency": concurrency, "frontend_cpu_ms_per_request": cpu, "ttft_p50_ms": ttft,
            "ttft_p90_ms": 2 * ttft, "hit_rate": hit}  # fmt: skip


def test_the_summary_compares_each_run_with_the_proxy_of_that_run() -> None:
    proxy, none = gateway.WORKLOAD_PATHS[0][0], gateway.WORKLOAD_PATHS[2][0]
    runs = [
        [row(proxy, 12, 5.0, 20), row(none, 12, 4.5, 22, 0.7)],  # a quiet run
        [row(proxy, 12, 8.0, 30), row(none, 12, 7.0, 31, 0.9)],  # a loaded one: both dearer
        [row(proxy, 12, 6.0, 25), row(none, 12, 6.5, 24, None), row(proxy, 32, 4.0, 15)],
    ]
    by = {(r["concurrency"], r["path"]): r for r in gateway.workload_summary(runs)}
    picker = by[(12, none)]
    assert picker["runs"] == 3
    assert picker["cpu_minus_proxy_ms_per_run"] == [-0.5, -1.0, 0.5]
    assert picker["cpu_minus_proxy_ms_median"] == -0.5
    assert picker["frontend_cpu_ms_per_request_median"] == 6.5
    assert picker["ttft_p50_ms_median"] == 24
    assert picker["hit_rate_mean"] == pytest.approx(0.8)  # the run without a hit rate left out
    assert "cpu_minus_proxy_ms_median" not in by[(12, proxy)]
    assert by[(32, proxy)]["runs"] == 1


def test_an_unknown_path_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit):
        gateway.main(["--workload", "agentic", "--paths", "proxy,nope"])
