"""Soak: the frontend + mockers under a steady, bounded load for a fixed time; RSS and latency per interval.

    python -m bench soak --duration 1800 --out soak-out     # 30 minutes, by hand
    python -m bench soak --duration 120 --interval 10       # the CI version (tests/test_soak.py)

A fixed number of closed-loop clients (``--concurrency``) stream chat requests whose system prompts
come from a small pool (so the index and the tokenizer's caches are exercised, but bounded by the
mockers' cache sizes) plus a fresh user message each. Every ``--interval`` seconds the frontend's RSS
(/proc/<pid>/status VmRSS) and the p50/p99 end-to-end latency of the requests finished in that
interval are recorded. After ``--warmup`` (default a fifth of the run) the verdict is:

- RSS growth: (max RSS after warm-up - RSS at the end of warm-up) / RSS at the end of warm-up < 5 %;
- p99 stable: the median per-interval p99 of the last half after warm-up is at most
  ``--p99-factor`` (3) x that of the first half, plus 50 ms (a shared machine's noise floor);
- no request failed.

Writes ``soak.csv``, ``soak.png`` and ``soak.json`` (the verdict) under ``--out``; exits 1 if the
verdict fails.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MODEL = "kvroute-demo"
NOISE_FLOOR_MS = 50.0


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: float
    requests: int
    failures: int
    p50_ms: float | None
    p99_ms: float | None


@dataclass
class Verdict:
    rss_warm_mib: float
    rss_max_after_warmup_mib: float
    rss_growth_pct: float
    p99_early_ms: float
    p99_late_ms: float
    requests: int
    failures: int
    ok: bool
    reasons: list[str] = field(default_factory=list)


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _prompts(seed: int, n_systems: int = 16) -> tuple[list[str], list[str]]:
    import pydoc_data.topics as topics

    rng = random.Random(seed)
    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    systems = [text[o : o + 2000] for o in (rng.randrange(0, len(text) - 2000) for _ in range(n_systems))]
    words = text.split()
    return systems, words


async def _load(
    url: str, duration: float, interval: float, concurrency: int, max_tokens: int, seed: int, pid: int, on_sample: Any
) -> list[Sample]:
    """Closed-loop streaming clients for ``duration`` seconds; one Sample per interval."""
    import httpx

    systems, words = _prompts(seed)
    rng = random.Random(seed)
    latencies: list[float] = []
    failures = 0
    samples: list[Sample] = []
    t0 = time.monotonic()
    end = t0 + duration

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.monotonic() < end:
            user = " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": rng.randint(4, max_tokens),
                "ignore_eos": True,
                "messages": [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": user}],
            }
            start = time.monotonic()
            try:
                async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    done = False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                    if r.status_code != 200 or not done:
                        failures += 1
                        continue
            except httpx.HTTPError:
                failures += 1
                continue
            latencies.append((time.monotonic() - start) * 1e3)

    async def sampler() -> None:
        nonlocal latencies, failures
        next_t = t0 + interval
        while next_t <= end + 1e-6:
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))  # a clock for sampling, not synchronisation
            lat, latencies = latencies, []
            fails, failures = failures, 0
            s = Sample(
                round(next_t - t0, 1),
                round(rss_mib(pid), 2),
                len(lat),
                fails,
                round(_pct(lat, 50), 2) if lat else None,
                round(_pct(lat, 99), 2) if lat else None,
            )
            samples.append(s)
            on_sample(s)
            next_t += interval

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as c:
        await asyncio.gather(sampler(), *(client(c) for _ in range(concurrency)))
    return samples


def judge(samples: list[Sample], warmup: float, p99_factor: float = 3.0, max_growth_pct: float = 5.0) -> Verdict:
    """The soak verdict over the samples taken after ``warmup`` seconds (see the module docstring)."""
    warm = [s for s in samples if s.t <= warmup]
    after = [s for s in samples if s.t > warmup]
    if not warm or len(after) < 2:
        raise ValueError(
            "need at least one sample in the warm-up and two after it: lengthen --duration or shorten --interval"
        )
    base = warm[-1].rss_mib
    peak = max(s.rss_mib for s in after)
    growth = (peak - base) / base * 100
    half = len(after) // 2
    early = [s.p99_ms for s in after[:half] if s.p99_ms is not None]
    late = [s.p99_ms for s in after[half:] if s.p99_ms is not None]
    reasons = []
    p99_early = statistics.median(early) if early else float("nan")
    p99_late = statistics.median(late) if late else float("nan")
    if not early or not late:
        reasons.append("an interval after warm-up finished no request")
    elif p99_late > p99_factor * p99_early + NOISE_FLOOR_MS:
        reasons.append(f"p99 rose from {p99_early:.1f} ms to {p99_late:.1f} ms")
    if growth >= max_growth_pct:
        reasons.append(f"RSS grew {growth:.2f} % after warm-up ({base:.1f} -> {peak:.1f} MiB)")
    requests = sum(s.requests for s in samples)
    failures = sum(s.failures for s in samples)
    if failures:
        reasons.append(f"{failures} request(s) failed")
    return Verdict(
        round(base, 2),
        round(peak, 2),
        round(growth, 3),
        round(p99_early, 2),
        round(p99_late, 2),
        requests,
        failures,
        not reasons,
        reasons,
    )


def plot(samples: list[Sample], warmup: float, path: str) -> None:
    """Two panels over time: frontend RSS, and per-interval p50/p99 latency (small PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3), dpi=72)
    a.plot(t, [s.rss_mib for s in samples], color="#264653")
    a.set_title("frontend RSS (MiB)")
    b.plot(t, [s.p50_ms for s in samples], label="p50", color="#2a9d8f")
    b.plot(t, [s.p99_ms for s in samples], label="p99", color="#e76f51")
    b.set_title("end-to-end latency per interval (ms)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.axvline(warmup / 60, color="#8d99ae", linestyle="--", linewidth=1)
        ax.set_xlabel("minutes")
    a.set_ylim(0, max(s.rss_mib for s in samples) * 1.25)  # from 0: growth is read against the whole RSS
    b.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default %(default)s)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds per sample (default %(default)s)")
    p.add_argument(
        "--warmup", type=float, default=None, help="seconds excluded from the verdict (default: a fifth of --duration)"
    )
    p.add_argument("--workers", type=int, default=2, help="mockers (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request (default %(default)s)")
    p.add_argument(
        "--speedup-ratio", type=float, default=4.0, help="the mockers' --speedup-ratio (default %(default)s)"
    )
    p.add_argument("--p99-factor", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak-out", help="output directory (default %(default)s)")
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else args.duration / 5
    if not (
        args.duration > 0
        and 0 < args.interval <= args.duration
        and 0 <= warmup < args.duration
        and args.concurrency > 0
    ):
        p.error("need duration > 0, 0 < interval <= duration, 0 <= warmup < duration, concurrency > 0")

    from kvroute_common.local_cluster import MockerOptions, start_cluster

    os.makedirs(args.out, exist_ok=True)
    opts = MockerOptions(speedup_ratio=args.speedup_ratio, num_gpu_blocks=2048)
    with start_cluster(
        args.workers, opts, frontend_args=["--log-level", "warning"], log_dir=os.path.join(args.out, "logs")
    ) as cluster:
        pid = cluster.frontend.proc.pid  # type: ignore[union-attr]

        def show(s: Sample) -> None:
            print(json.dumps(asdict(s)), flush=True)

        samples = asyncio.run(
            _load(
                cluster.frontend_url or "",
                args.duration,
                args.interval,
                args.concurrency,
                args.max_tokens,
                args.seed,
                pid,
                show,
            )
        )
        cluster.check_alive()
    with open(os.path.join(args.out, "soak.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "rss_mib", "requests", "failures", "p50_ms", "p99_ms"])
        for s in samples:
            w.writerow([s.t, s.rss_mib, s.requests, s.failures, s.p50_ms, s.p99_ms])
    plot(samples, warmup, os.path.join(args.out, "soak.png"))
    verdict = judge(samples, warmup, args.p99_factor)
    report = {"args": vars(args) | {"warmup": warmup}, "verdict": asdict(verdict), "loadavg": os.getloadavg()}
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["verdict"]), flush=True)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
