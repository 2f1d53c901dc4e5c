"""The routers' recent decisions and per-mode counts, for the dashboard.

``record`` is on the request path (every booked decision), so it only counts and keeps a reference;
the routing records are built when the dashboard asks.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from frontend.routing.routing_record import routing_record

if TYPE_CHECKING:
    from frontend.routing.decision import Decision
    from frontend.routing.models import ModelEntry

RECENT_DECISIONS = 50  # kept; the page shows the newest 15


class DecisionLog:
    """The last ``maxlen`` booked decisions and how many each router (labelled by mode) made."""

    __slots__ = ("recent", "counts")

    def __init__(self, maxlen: int = RECENT_DECISIONS) -> None:
        self.recent: deque[tuple[float, str, str, Any, ModelEntry, Decision]] = deque(maxlen=maxlen)
        self.counts: Counter[str] = Counter()

    def record(self, mode: str, config: Any, entry: ModelEntry, request_id: str, decision: Decision) -> None:
        self.counts[mode] += 1
        self.recent.append((time.time(), mode, request_id, config, entry, decision))

    def records(self, limit: int = 15) -> list[dict[str, Any]]:
        """Newest first, each as the routing record plus when, which request and which router."""
        out = []
        for t, mode, rid, config, entry, decision in reversed(list(self.recent)[-limit:]):
            rec = routing_record(config, entry, decision)
            rec.update(time=round(t, 3), request_id=rid, router=mode)
            out.append(rec)
        return out
