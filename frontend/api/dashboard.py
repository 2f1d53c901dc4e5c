"""The live dashboard: ``GET /dashboard`` (a static page and its script) fed by ``GET /dashboard/data``.

Operators would rather look than read: per worker rank the load the router sees, what the index
holds and whether the worker is healthy or busy; routing decisions per second by mode; the hit-rate
decomposition (available / captured / delivered) over time; the last decisions with every
candidate's cost terms, in the shape of ``POST /admin/route``.

Nothing runs in the background: each poll computes a snapshot from the live state, numbers it
(``seq``), keeps the last few (``?seq=N`` answers exactly the snapshot a page rendered, which is how
the browser test compares what it shows with what was served) and, at most once a second, appends a
point to the time series. With ``--workers N`` each process answers for itself.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from frontend.routing.eligibility import rank_overloaded
from frontend.supervisor import child_index
from kvroute_common.http import ApiError, json_response

if TYPE_CHECKING:
    from frontend.state import FrontendState

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
HISTORY_POINTS = 180  # one a second at most: three minutes of series
KEPT_SNAPSHOTS = 16  # for ?seq=N
STATIC_FILES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


class Dashboard:
    """Builds the snapshots; the HTTP handlers below serve them."""

    def __init__(self, state: FrontendState, clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.clock = clock
        self.seq = 0
        self.snapshots: deque[dict[str, Any]] = deque(maxlen=KEPT_SNAPSHOTS)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._last_point: tuple[float, dict[str, int], dict[str, int]] | None = None

    def snapshot(self) -> dict[str, Any]:
        st = self.state
        now = self.clock()
        counts = dict(st.decisions.counts)
        decomposition = st.parity.decomposition.totals()
        self._add_point(now, counts, decomposition)
        self.seq += 1
        snap = {
            "seq": self.seq,
            "time": round(now, 3),
            "pid": os.getpid(),
            "process": child_index() or 0,
            "router_mode": st.config.router_mode,
            "ranks": self._ranks(),
            "decisions": {"total_by_mode": counts, "total": sum(counts.values())},
            "decomposition": decomposition,
            "history": list(self.history),
            "recent": st.decisions.records(),
        }
        self.snapshots.append(snap)
        return snap

    def find(self, seq: int) -> dict[str, Any] | None:
        return next((s for s in self.snapshots if s["seq"] == seq), None)

    def _add_point(self, now: float, counts: dict[str, int], decomposition: dict[str, int]) -> None:
        """One time-series point per second at most: decisions/s by mode and the decomposition shares
        of the prompt tokens counted since the previous point (null when none were)."""
        last = self._last_point
        if last is not None and now - last[0] < 1.0:
            return
        self._last_point = (now, counts, decomposition)
        if last is None:
            return
        dt = now - last[0]
        rates = {m: round((c - last[1].get(m, 0)) / dt, 3) for m, c in counts.items()}
        prompt = decomposition["prompt"] - last[2]["prompt"]
        shares = {
            k: (round((decomposition[k] - last[2][k]) / prompt, 4) if prompt > 0 else None)
            for k in ("available", "captured", "delivered")
        }
        self.history.append({"time": round(now, 3), "decisions_per_s": rates, **shares})

    def _ranks(self) -> list[dict[str, Any]]:
        st = self.state
        events: dict[int, dict[str, Any]] = (
            {e["instance_id"]: e for e in st.events.workers()} if st.events is not None else {}
        )
        rows = []
        entries = [(e, "decode" if e.name in st.prefill_models else "both") for e in st.models.values()]
        entries += [(e, "prefill") for e in st.prefill_models.values()]
        for entry, role in entries:
            index = entry.index
            blocks = index.blocks_per_worker() if index is not None else {}
            tracker = entry.tracker
            thresholds = entry.thresholds
            for w in sorted(entry.workers.values(), key=lambda w: w.id):
                ev = events.get(w.id)
                kv_health = st.events.health(w.id) if ev is not None and st.events is not None else {}
                for r in w.spec.ranks:
                    h = kv_health.get(str(r), {})
                    lag = h.get("index_lag_seconds")
                    prefill = tracker.active_prefill_tokens(w.id, r)
                    decode = tracker.active_decode_blocks(w.id, r)
                    busy = thresholds.enabled and rank_overloaded(
                        thresholds, prefill, decode, w.num_gpu_blocks, w.max_num_batched_tokens
                    )
                    rows.append(
                        {
                            "model": entry.name,
                            "role": role,
                            "worker_id": w.id,
                            "dp_rank": r,
                            "url": w.spec.url,
                            "healthy": w.healthy,
                            "busy": bool(busy),
                            "active_prefill_tokens": prefill,
                            "active_decode_blocks": decode,
                            "kv_blocks_indexed": blocks.get((w.id, r), 0),
                            "kv_events": ev["status"] if ev is not None else None,
                            # how late the newest KV-event batch was applied, and batches queued behind it
                            "kv_index_lag_ms": None if lag is None else round(lag * 1e3, 1),
                            "kv_batches_waiting": h.get("batches_waiting"),
                        }
                    )
        return rows


class DashboardRoutes:
    """``/dashboard`` (page, script, style) and ``/dashboard/data`` (JSON; admin-protected like /admin)."""

    def __init__(self, state: FrontendState) -> None:
        self.dashboard = Dashboard(state)

    async def page(self, request: Request) -> Response:
        return self._static("dashboard.html")

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC_FILES:
            raise ApiError(404, f"no dashboard file {name!r}")
        return self._static(name)

    async def data(self, request: Request) -> Response:
        seq = request.query_params.get("seq")
        if seq is None:
            return json_response(self.dashboard.snapshot())
        try:
            snap = self.dashboard.find(int(seq))
        except ValueError:
            raise ApiError(400, "seq must be an integer") from None
        if snap is None:
            raise ApiError(404, f"snapshot {seq} is no longer kept (the last {KEPT_SNAPSHOTS} are)")
        return json_response(snap)

    @staticmethod
    def _static(name: str) -> Response:
        return FileResponse(
            os.path.join(STATIC_DIR, name), media_type=STATIC_FILES[name], headers={"cache-control": "no-cache"}
        )
