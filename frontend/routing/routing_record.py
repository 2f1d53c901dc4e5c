"""The routing record: every candidate's cost terms and the choice, as one JSON-able dict.

One shape for the ``POST /admin/route`` dry run and for ``nvext.extra_fields: ["routing"]`` on a
real request (the decision that request actually got), so "why did it go there?" has one answer.
Dynamo's router logs the cost as the candidate's *logit*; ``logit`` is the same number as ``cost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.routing.decision import Decision
    from frontend.routing.models import ModelEntry

EXTRA_FIELD = "routing"


def wants_routing(hints: Any) -> bool:
    """Whether the request asked for ``nvext.extra_fields: ["routing"]``."""
    return hints is not None and EXTRA_FIELD in (hints.extra_fields or ())


def routing_record(config: Any, entry: ModelEntry, decision: Decision) -> dict[str, Any]:
    """The decision with every candidate's terms (candidates is empty outside kv mode)."""
    bs = entry.block_size
    chosen = (decision.worker.id, decision.dp_rank)
    cands = [
        {
            "worker_id": c.worker_id,
            "dp_rank": c.dp_rank,
            "overlap_blocks": c.overlap_blocks,
            "prefill_tokens": c.prefill_tokens,
            "prefill_blocks": c.prefill_blocks,
            "decode_blocks": c.decode_blocks,
            "active_requests": c.active_requests,
            "cost": c.cost,
            "logit": c.cost,
            "selected": (c.worker_id, c.dp_rank) == chosen,
        }
        for c in (decision.costs or [])
    ]
    return {
        "model": entry.name,
        "lora_name": entry.lora_name,
        "isl": decision.isl,
        "block_size": bs,
        "router_mode": config.router_mode,
        "overlap_score_weight": config.router_kv_overlap_score_weight,
        "temperature": config.router_temperature,
        "worker_id": decision.worker.id,
        "dp_rank": decision.dp_rank,
        "overlap_blocks": decision.overlap_blocks,
        "available_overlap_blocks": decision.available_blocks,
        "overlap_source": decision.overlap_source or "embedded",
        "candidates": cands,
    }
