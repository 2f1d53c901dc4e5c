"""The soak's CI version: 2 minutes of steady load through a real frontend and mockers.

After warm-up the frontend's RSS must grow < 5 % and the per-interval p99 must stay stable
(``bench.soak.judge``); the run writes its CSV, plot and verdict.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from bench.soak import Sample, judge
from tests.support import REPO_ROOT


def test_judge_flags_growth_latency_and_failures():
    flat = [Sample(t, 100.0, 10, 0, 5.0, 20.0) for t in range(10, 110, 10)]
    assert judge(flat, warmup=20).ok
    leaking = [Sample(s.t, 100.0 + s.t / 10, 10, 0, 5.0, 20.0) for s in flat]  # +9 % after warm-up
    v = judge(leaking, warmup=20)
    assert not v.ok and "RSS grew" in v.reasons[0]
    slower = [Sample(s.t, 100.0, 10, 0, 5.0, 20.0 if s.t < 60 else 500.0) for s in flat]
    assert any("p99 rose" in r for r in judge(slower, warmup=20).reasons)
    failing = [Sample(s.t, 100.0, 10, 1 if s.t == 50 else 0, 5.0, 20.0) for s in flat]
    assert judge(failing, warmup=20).reasons == ["1 request(s) failed"]
    with pytest.raises(ValueError):
        judge(flat[:2], warmup=20)


def test_soak_one_minute(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--duration", "60", "--interval", "5", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = json.loads((out / "soak.json").read_text())["verdict"]
    assert verdict["ok"] and verdict["failures"] == 0 and verdict["requests"] > 100
    assert verdict["rss_growth_pct"] < 5
    rows = list(csv.DictReader((out / "soak.csv").open()))
    assert len(rows) == 12 and all(float(r["rss_mib"]) > 0 for r in rows)
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
