"""``python -m bench paired``: two routers' data-path runs at the same time, each router's CPU a request against
the other's, run by run.

Why: on this testbed the machine's speed moves between runs minutes apart (the same kvroute checkout spends
1.3-2.9 ms a request from one run to the next, a Python process more than the Rust routers), so runs one
after the other tell a few per cent apart only with many of them. Here two ``python -m bench data_path``
runs start together, one per side, each with its own engines and client on core 0 and both routers pinned
to core 1: both sides see the same machine at the same moment, and the ratio of the two figures is steady
from pair to pair. What the pairing changes: the two routers share core 1, so each is preempted by the
other (a multi-threaded router switches more: the vLLM router ~75 times a request here against ~31 alone),
which costs the side that switches more; compare two checkouts of one router with it, and read a peer
pairing beside the runs alone on a core.

    python -m bench paired --a-dir . --b-dir /tmp/before --runs 6             # this checkout against another
    python -m bench paired --a-router kvroute-latency --b-router vllm-kv_aware   # kvroute against a peer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence

DATA_PATH_ARGS = ["--tokenizers", "builtin", "--apis", "completions", "--pin", "--no-profile", "--runs", "1"]


def _command(router: str, concurrency: int, out_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "bench", "data_path", "--routers", router, "--concurrency", str(concurrency),
        *DATA_PATH_ARGS, "--idle-seconds", "0", "--out-dir", out_dir,
    ]  # fmt: skip


def pair_rows(a: dict, b: dict) -> dict:
    """One pair's figures and the CPU ratio a / b."""
    return {
        "a": a,
        "b": b,
        "cpu_ratio": round(a["cpu_ms_per_request"] / b["cpu_ms_per_request"], 3),
        "switches": [a["switches_per_request"], b["switches_per_request"]],
    }


def summary(pairs: Sequence[dict], a_label: str, b_label: str) -> str:
    """A markdown table of the pairs and the median (min-max) of their CPU ratios."""
    lines = [
        f"| pair | {a_label} CPU ms / request | {b_label} CPU ms / request | ratio | switches / request | hit rate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, p in enumerate(pairs, 1):
        a, b = p["a"], p["b"]
        lines.append(
            f"| {i} | {a['cpu_ms_per_request']:.2f} | {b['cpu_ms_per_request']:.2f} | {p['cpu_ratio']:.3f}x "
            f"| {p['switches'][0]:.1f} / {p['switches'][1]:.1f} "
            f"| {100 * a['hit_rate']:.1f} % / {100 * b['hit_rate']:.1f} % |"
        )
    ratios = [p["cpu_ratio"] for p in pairs]
    if ratios:
        lines.append("")
        lines.append(
            f"{a_label} against {b_label}, CPU a request: median **{statistics.median(ratios):.3f}x** "
            f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} pairs"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench paired", description=__doc__.splitlines()[0])
    ap.add_argument("--a-dir", default=".", help="the checkout side A runs from (default: this one)")
    ap.add_argument("--b-dir", default=".", help="the checkout side B runs from")
    ap.add_argument("--a-router", default="kvroute-latency")
    ap.add_argument("--b-router", default="kvroute-latency")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5, help="pairs, one after the other")
    ap.add_argument("--out-dir", default="/tmp/bench-paired")
    args = ap.parse_args(argv)
    a_label = f"{args.a_router} ({os.path.abspath(args.a_dir)})"
    b_label = f"{args.b_router} ({os.path.abspath(args.b_dir)})"
    os.makedirs(args.out_dir, exist_ok=True)
    pairs: list[dict] = []
    for i in range(1, args.runs + 1):
        outs = [os.path.join(args.out_dir, f"{side}{i}") for side in ("a", "b")]
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)  # no figure from an earlier run is read as this one's
        procs = [
            subprocess.Popen(_command(router, args.concurrency, out), cwd=cwd, stdout=subprocess.DEVNULL)
            for router, out, cwd in zip((args.a_router, args.b_router), outs, (args.a_dir, args.b_dir), strict=True)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"pair {i}: a data_path run failed ({codes}); its logs are in {args.out_dir}", file=sys.stderr)
            return 1
        a, b = (json.load(open(os.path.join(out, "data_path.json")))["rows"][0] for out in outs)
        pairs.append(pair_rows(a, b))
        ratio = pairs[-1]["cpu_ratio"]
        print(f"pair {i}: {a['cpu_ms_per_request']} / {b['cpu_ms_per_request']} ms = {ratio}x", flush=True)
    result = {"a": a_label, "b": b_label, "concurrency": args.concurrency, "pairs": pairs}
    with open(os.path.join(args.out_dir, "paired.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(summary(pairs, a_label, b_label))
    return 0
