"""How a benchmark hands over its result: the JSON on stdout, and in ``--out`` when given; and how an
in-process microbenchmark measures another checkout in the same run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def checkout_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The arguments of an in-process microbenchmark that compares checkouts (``measure_checkouts``)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="another checkout, measured in the same run (alternating)")
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per checkout [5]")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    return ap


def measure_checkouts(script: str, before: str | None, rounds: int) -> tuple[dict[str, str], dict[str, Any]]:
    """``rounds`` rounds, each a fresh process per checkout (``before``, when given, then this one): the
    checkouts by label, and each one's samples, its rounds pooled (``pool``)."""
    checkouts = ([("before", os.path.abspath(before))] if before else []) + [("after", os.getcwd())]
    pooled: dict[str, Any] = {label: {} for label, _ in checkouts}
    for _ in range(rounds):
        for label, directory in checkouts:
            pool(pooled[label], measure_checkout(script, directory))
    return dict(checkouts), pooled


def pool(into: dict[str, Any], round_result: dict[str, Any]) -> None:
    """Add one round's samples (nested dicts of lists) to ``into``, list by list."""
    for key, value in round_result.items():
        if isinstance(value, dict):
            pool(into.setdefault(key, {}), value)
        else:
            into.setdefault(key, []).extend(value)


def summarize(samples: dict[str, Any]) -> dict[str, Any]:
    """``summary_ms`` of every list of samples in nested dicts."""
    return {k: summarize(v) if isinstance(v, dict) else summary_ms(v) for k, v in samples.items()}


def summary_ms(values: list[float]) -> dict[str, float]:
    """Count, median, p90 and worst of samples in milliseconds."""
    v = sorted(values)
    return {
        "samples": len(v),
        "p50_ms": round(statistics.median(v), 3),
        "p90_ms": round(v[int(len(v) * 0.9)], 3),
        "max_ms": round(v[-1], 3),
    }


def measure_checkout(script: str, directory: str) -> Any:
    """One round of ``script --measure`` in a fresh process importing ``directory``'s code (the script
    handles ``--measure`` before importing anything of ``bench``, which that checkout may not have): its JSON."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), "--measure"],
        cwd=directory,
        env=dict(os.environ, PYTHONPATH=directory),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def checkout_main(script: str, prog: str, doc: str | None, key: str, argv: list[str] | None) -> int:
    """A checkout-comparing microbenchmark's ``main`` after ``--measure``: rounds of ``script`` in every
    checkout, each one's samples summarized under ``key``."""
    args = checkout_parser(prog, doc).parse_args(argv)
    checkouts, samples = measure_checkouts(script, args.before, args.rounds)
    result: dict[str, Any] = {
        "load_average": os.getloadavg(),
        "rounds": args.rounds,
        "checkouts": checkouts,
        key: summarize(samples),
    }
    emit(result, args.out)
    return 0
