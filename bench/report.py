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


def measure_checkouts(script: str, before: str | None, rounds: int) -> tuple[dict[str, str], dict[str, list[Any]]]:
    """``rounds`` rounds, each a fresh process per checkout (``before``, when given, then this one): the
    checkouts by label, and each one's results, a round each."""
    checkouts = ([("before", os.path.abspath(before))] if before else []) + [("after", os.getcwd())]
    results: dict[str, list[Any]] = {label: [] for label, _ in checkouts}
    for _ in range(rounds):
        for label, directory in checkouts:
            results[label].append(measure_checkout(script, directory))
    return dict(checkouts), results


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
