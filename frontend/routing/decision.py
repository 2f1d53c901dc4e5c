"""What the router decided for one request: the (worker, DP rank), what it expects cached there, what
it booked, and (for the routing record and the dashboard) every candidate's cost terms.

Its own module so that everything that carries a decision (the lease, the parity alarm, the routing
record, the dashboard) depends on this small value and not on the router that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.selection import WorkerCost

if TYPE_CHECKING:
    from frontend.pool.workers import Worker


@dataclass(slots=True)
class Decision:
    """Where a request goes and what was booked for it."""

    worker: Worker
    dp_rank: int
    isl: int
    overlap_blocks: int
    new_isl_tokens: int
    tracked_hashes: list[int]
    local_hashes: list[int]
    seq_hashes: list[int]
    cost: WorkerCost | None = None
    costs: list[WorkerCost] | None = None  # every candidate's terms (explain / record only)
    available_blocks: int = 0  # best overlap among the eligible candidates (hit-rate decomposition)
    t_routed: float = 0.0  # perf_counter at the decision (latency mode: TTFT observations start here)
    overlap_source: str | None = None  # remote | remote_unavailable (--use-remote-indexer); None: embedded
    # the prefill booked on the rank when latency mode expects more cached there than the index shows
    # (blocks just routed there, --router-latency-book-predicted); None: new_isl_tokens
    booked_new_tokens: int | None = None

    @property
    def cached_tokens(self) -> int:
        return self.isl - self.new_isl_tokens
