"""The live dashboard (``/dashboard``) in a real browser against a real frontend and simulated workers.

Debian's headless chromium loads the page while a bounded background load runs; the page stamps the
snapshot it rendered (``body[data-seq]``), and every number it shows is compared with exactly that
snapshot from ``/dashboard/data?seq=N``. A screenshot is written to ``tests/output/dashboard.png``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from frontend.api.dashboard import Dashboard
from frontend.routing.decision_log import DecisionLog
from kvroute_common.local_cluster import MockerOptions, start_cluster
from support import REPO_ROOT, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = os.path.join(REPO_ROOT, "tests", "output", "dashboard.png")
MODEL = "kvroute-demo"


def _need_chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium for this test")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return CHROMIUM


def _chromium(url: str, *mode: str, budget_ms: int = 4000) -> str:
    """Run headless chromium on ``url`` with a fresh profile; returns its stdout (the DOM with --dump-dom)."""
    with tempfile.TemporaryDirectory(prefix="kvroute-chromium-") as profile:
        out = subprocess.run(
            [
                _need_chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--window-size=1400,1100",
                f"--virtual-time-budget={budget_ms}",
                *mode,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class RenderedPage(HTMLParser):
    """The numbers the page shows: by element id, per rank row, per decision row, in the totals table."""

    def __init__(self) -> None:
        super().__init__()
        self.seq: int | None = None
        self.by_id: dict[str, str] = {}
        self.ranks: dict[str, dict[str, str]] = {}
        self.recent: list[tuple[str, dict[str, str]]] = []
        self.totals: dict[str, str] = {}
        self._row: dict[str, str] | None = None
        self._field: str | None = None
        self._id: str | None = None
        self._table: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body" and a.get("data-seq"):
            self.seq = int(a["data-seq"] or 0)
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr" and a.get("data-rank"):
            self._row = self.ranks.setdefault(a["data-rank"] or "", {})
        elif tag == "tr" and a.get("data-request"):
            self._row = {}
            self.recent.append((a["data-request"] or "", self._row))
        elif tag == "tr" and self._table == "decomposition":
            self._row = self.totals
        if a.get("data-field") and self._row is not None:
            self._field, self._text = a["data-field"], []
        elif a.get("id") and tag in ("b", "span", "div"):
            self._id, self._text = a["id"], []

    def handle_data(self, data: str) -> None:
        if self._field or self._id:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._field and self._row is not None:
            self._row[self._field] = "".join(self._text).strip()
            self._field = None
        elif tag in ("b", "span", "div") and self._id:
            self.by_id[self._id] = "".join(self._text).strip()
            self._id = None
        elif tag == "tr":
            self._row = None
        elif tag == "table":
            self._table = None


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def _compare(page: RenderedPage, snap: dict[str, Any]) -> None:
    """Every number on the page equals the snapshot it says it rendered."""
    assert page.by_id["seq"] == str(snap["seq"]) and page.by_id["mode"] == snap["router_mode"]
    assert page.by_id["decisions-total"] == str(snap["decisions"]["total"])
    dec = snap["decomposition"]
    for k in ("available", "captured", "delivered"):
        assert page.by_id[f"share-{k}"] == _pct(dec[k], dec["prompt"]), k
    assert page.totals == {k: str(dec[k]) for k in ("requests", "prompt", "available", "captured", "delivered")}
    assert len(page.ranks) == len(snap["ranks"])
    for r in snap["ranks"]:
        shown = page.ranks[f"{r['model']}|{r['role']}|{r['worker_id']}|{r['dp_rank']}"]
        assert shown == {
            "worker_id": str(r["worker_id"]),
            "dp_rank": str(r["dp_rank"]),
            "healthy": "healthy" if r["healthy"] else "down",
            "busy": "busy" if r["busy"] else "no",
            "active_prefill_tokens": str(r["active_prefill_tokens"]),
            "active_decode_blocks": str(r["active_decode_blocks"]),
            "kv_blocks_indexed": str(r["kv_blocks_indexed"]),
            "kv_events": r["kv_events"] or "off",
            "kv_index_lag_ms": "-" if r["kv_index_lag_ms"] is None else f"{r['kv_index_lag_ms']:.1f}",
            "kv_batches_waiting": "-" if r["kv_batches_waiting"] is None else str(r["kv_batches_waiting"]),
        }, r
    assert [rid for rid, _ in page.recent] == [d["request_id"] for d in snap["recent"]]
    for (_, shown), d in zip(page.recent, snap["recent"], strict=True):
        assert shown == {"isl": str(d["isl"]), "chosen": f"w{d['worker_id']}/{d['dp_rank']}"}


class Load:
    """Streaming chat requests from a few threads until stopped or ``limit`` requests were sent."""

    def __init__(self, url: str, threads: int = 6, limit: int = 3000) -> None:
        self.url, self.limit = url, limit
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                with self._lock:
                    if self.sent >= self.limit:
                        return
                    self.sent += 1
                    n = self.sent
                body = {
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": 48,
                    "messages": [
                        {
                            "role": "system",
                            "content": f"You are assistant number {n % 4}, expert in prefix caches. " * 8,
                        },
                        {"role": "user", "content": f"question {n}"},
                    ],
                }
                with c.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}")
                    for _ in r.iter_lines():
                        pass

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def test_dashboard_in_a_browser_matches_its_data_under_load() -> None:
    _need_chromium()
    with start_cluster(3, MockerOptions(speedup_ratio=1.0, max_num_seqs=8)) as cluster:
        url = cluster.frontend_url
        assert url
        with Load(url) as load, httpx.Client(timeout=30) as c:
            wait_until(
                lambda: c.get(f"{url}/dashboard/data").json()["decisions"]["total"] >= 20, 60, what="traffic routed"
            )
            # a few polls a second apart so that the page's time series has points
            for _ in range(3):
                first = c.get(f"{url}/dashboard/data").json()["time"]
                wait_until(
                    lambda first=first: c.get(f"{url}/dashboard/data").json()["time"] - first >= 1.0,
                    10,
                    what="a second of data",
                )
            live = None
            for _ in range(6):  # render until a snapshot caught requests in flight (the load keeps them coming)
                page = RenderedPage()
                page.feed(_chromium(f"{url}/dashboard", "--dump-dom"))
                assert page.seq, "the page rendered no snapshot"
                snap = c.get(f"{url}/dashboard/data", params={"seq": page.seq}).json()
                _compare(page, snap)
                if any(r["active_prefill_tokens"] or r["active_decode_blocks"] for r in snap["ranks"]):
                    live = snap
                    break
            assert live is not None, "no rendered snapshot showed load in flight"
            assert live["decisions"]["total"] > 0 and sum(r["kv_blocks_indexed"] for r in live["ranks"]) > 0
            assert all(r["healthy"] and r["kv_events"] == "active" for r in live["ranks"])
            # index lag per rank: how late its newest KV-event batch was applied, and nothing piling up
            assert any(r["kv_index_lag_ms"] is not None for r in live["ranks"])
            assert all(r["kv_batches_waiting"] is not None and r["kv_batches_waiting"] >= 0 for r in live["ranks"])
            assert live["history"] and any(h["decisions_per_s"].get("kv", 0) > 0 for h in live["history"])
            assert live["recent"] and len(live["recent"][0]["candidates"]) == 3
            os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
            _chromium(f"{url}/dashboard", f"--screenshot={SCREENSHOT}")
            assert os.path.getsize(SCREENSHOT) > 20_000
            print(f"dashboard screenshot: {SCREENSHOT}")
        assert not load.failures, load.failures[:5]


def test_dashboard_data_needs_the_admin_token_and_the_page_does_not() -> None:
    with start_cluster(1, MockerOptions(speedup_ratio=10.0), frontend_args=["--admin-token", "s3cret"]) as cluster:
        url = cluster.frontend_url
        with httpx.Client(timeout=30) as c:
            page = c.get(f"{url}/dashboard")
            assert (
                page.status_code == 200
                and page.headers["content-type"].startswith("text/html")
                and "dashboard.js" in page.text
            )
            assert c.get(f"{url}/dashboard/dashboard.js").status_code == 200
            assert c.get(f"{url}/dashboard/dashboard.css").headers["content-type"].startswith("text/css")
            assert c.get(f"{url}/dashboard/data").status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            assert c.get(f"{url}/dashboard/nope.js", headers=auth).status_code == 404
            snap = c.get(f"{url}/dashboard/data", headers=auth).json()
            assert set(snap) >= {
                "seq",
                "time",
                "router_mode",
                "ranks",
                "decisions",
                "decomposition",
                "history",
                "recent",
            }
            assert c.get(f"{url}/dashboard/data", params={"seq": snap["seq"]}, headers=auth).json() == snap
            assert c.get(f"{url}/dashboard/data", params={"seq": "x"}, headers=auth).status_code == 400
            assert c.get(f"{url}/dashboard/data", params={"seq": 10**6}, headers=auth).status_code == 404


class _FakeState:
    """Just what ``Dashboard.snapshot`` reads, for the time-series arithmetic."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.decisions = DecisionLog()
        self.totals = {"prompt": 0, "available": 0, "captured": 0, "delivered": 0, "requests": 0}
        self.parity = SimpleNamespace(decomposition=SimpleNamespace(totals=lambda: dict(self.totals)))
        self.config = SimpleNamespace(router_mode="kv")
        self.events = None
        self.models: dict = {}
        self.prefill_models: dict = {}


def test_time_series_points_are_rates_and_shares_since_the_previous_point() -> None:
    state = _FakeState()
    now = [1000.0]
    dash = Dashboard(state, clock=lambda: now[0])  # type: ignore[arg-type]
    assert dash.snapshot()["history"] == []
    state.decisions.counts["kv"] += 10
    state.totals.update(prompt=1000, available=800, captured=600, delivered=500, requests=10)
    now[0] += 0.5
    assert dash.snapshot()["history"] == []  # less than a second: no point
    now[0] += 1.5
    point = dash.snapshot()["history"][-1]
    assert point == {
        "time": 1002.0,
        "decisions_per_s": {"kv": 5.0},
        "available": 0.8,
        "captured": 0.6,
        "delivered": 0.5,
    }
    now[0] += 1.0
    point = dash.snapshot()["history"][-1]
    assert point["decisions_per_s"] == {"kv": 0.0} and point["available"] is None  # no new prompt tokens: no share
    assert [s["seq"] for s in dash.snapshots] == [1, 2, 3, 4] and dash.find(2)["seq"] == 2 and dash.find(99) is None
