"""What one wake-up of an idle event loop costs in CPU: the price of every periodic timer a service keeps.

A uvloop loop sleeps in ``asyncio.sleep(interval)`` for a few seconds; its CPU time per wake-up is read
from ``/proc/self/schedstat`` (the scheduler's own runtime, in ns) and from ``os.times`` (what ``/proc``
charges the process, as the peer benchmark reads it). On the 2-core virtual machine of issue 28 one
wake-up costs ~0.1 ms, so a 20 ms timer alone is ~5 ms of CPU per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import uvloop


def _runtime_s() -> float:
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def _measure(interval: float, seconds: float) -> tuple[int, float, float]:
    times0, run0, t0 = os.times(), _runtime_s(), time.monotonic()
    wakes = 0
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(interval)
        wakes += 1
    times1, run1 = os.times(), _runtime_s()
    charged = (times1.user + times1.system) - (times0.user + times0.system)
    return wakes, run1 - run0, charged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench wakeup_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="0.02,0.1,1.0", help="comma-separated timer intervals, seconds")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per interval")
    args = ap.parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"load average {' '.join(f.read().split()[:3])}")
    print("| timer interval | wake-ups | CPU per wake-up (schedstat) | CPU charged per second (/proc times) |")
    print("| --- | --- | --- | --- |")
    for interval in (float(x) for x in args.intervals.split(",")):
        wakes, run_s, charged_s = uvloop.run(_measure(interval, args.seconds))
        per_wake_us = 1e6 * run_s / max(1, wakes)
        print(f"| {interval * 1000:g} ms | {wakes} | {per_wake_us:.0f} us | {1000 * charged_s / args.seconds:.1f} ms |")
    return 0
