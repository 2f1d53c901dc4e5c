"""Disaggregated prefill/decode over the OpenAI API, the way vLLM's disaggregated deployments work.

Workers declare ``role=prefill|decode|both`` (``--worker``, workers file, admin API, discovery).
Prefill-role workers of a model form its *prefill pool* (``FrontendState.prefill_models``); as soon
as the pool has a healthy worker, every request of that model runs in two phases (router guide,
"Disaggregated Serving"):

1. **Prefill**: the prefill router (KV-aware over the prefill pool, fed by the prefill workers' own
   KV events, active-block tracking off since prefill workers never decode) picks a (worker, rank);
   the request goes there non-streaming with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true, ...}`` (vLLM's NIXL connector fields, as
   vLLM's reference proxy sends them). The worker answers with the ``kv_transfer_params`` a decode
   engine needs to pull the prompt's KV blocks (``do_remote_prefill``, ``remote_block_ids``,
   ``remote_engine_id``, ``remote_host``, ``remote_port``).
2. **Decode**: the original request plus those ``kv_transfer_params`` goes to the decode worker the
   decode router chooses, load-only (the reference's per-request override: overlap weight 0, no KV
   reuse assumption, no prefill tokens: the prompt arrives by transfer). The client sees that one
   response or stream.

Fallback (the guide's "falls back gracefully to decode-only"): no healthy / non-busy prefill worker,
an unreachable or failing prefill worker, or an answer without ``kv_transfer_params`` sends the
original request decode-only (aggregated on a decode worker), with a warning. A prefill pin
(``nvext.prefill_worker_id`` / ``prefill_dp_rank``, headers ``x-dynamo-prefill-instance-id`` /
``x-dynamo-prefill-dp-rank``) that names no prefill worker of the model is a 400.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from frontend.dispatch.proxy import upstream_headers
from frontend.dispatch.upstream import UpstreamConnectError, UpstreamError
from frontend.observability.metrics import PREFILL_WORKER_TYPE
from frontend.request.errors import OpenAIError
from frontend.routing.engine_polarity import for_worker as _priority_for_worker
from frontend.routing.routing_record import routing_record, wants_routing

if TYPE_CHECKING:
    from frontend.routing.models import ModelEntry
    from frontend.state import FrontendState

log = logging.getLogger("frontend.routing.disagg")
_perf = time.perf_counter

# What the prefill request asks of the engine (vLLM NIXL connector): compute the prompt, keep its
# blocks for a remote decode, answer with the transfer parameters.
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

OUTCOME_REMOTE = "remote"
OUTCOME_NO_WORKER = "no_prefill_worker"
OUTCOME_FAILED = "prefill_failed"


@dataclass(slots=True)
class PrefillResult:
    """The prefill phase of one request: where it ran and what the decode worker needs."""

    worker_id: int
    dp_rank: int
    isl: int
    overlap_blocks: int
    cached_tokens: int
    kv_transfer_params: dict[str, Any]
    seconds: float
    record: dict[str, Any] | None = None  # the prefill decision's routing record (extra_fields ["routing"])


def prefill_body(body: dict) -> bytes:
    """The prefill request: one token, non-streaming, asking for remote decode (vLLM's proxy does the same)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return orjson.dumps(out)


def decode_body(body: dict, params: dict[str, Any], stream_usage: bool = False) -> bytes:
    """The decode request: the client's request with the prefill worker's transfer parameters
    (``stream_usage``: also ask for the stream's usage event, which the frontend reads and strips)."""
    out = dict(body)
    out["kv_transfer_params"] = params
    if stream_usage and out.get("stream"):
        opts = out.get("stream_options")
        out["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return orjson.dumps(out)


def prefill_pin(state: FrontendState, model: str, hints: Any) -> tuple[int | None, int | None]:
    """(worker, rank) pin of the prefill phase: ``prefill_worker_id``, else ``backend_instance_id``
    when it names a prefill worker (the reference's phase resolution)."""
    if hints is None:
        return None, None
    pin = hints.prefill_worker_id
    if pin is None and hints.backend_instance_id is not None:
        pool = state.prefill_models.get(model)
        if pool is not None and hints.backend_instance_id in pool.workers:
            pin = hints.backend_instance_id
    return pin, hints.prefill_dp_rank


def wants_prefill(state: FrontendState, model: str, hints: Any) -> bool:
    """Whether this request takes the disaggregated path (cheap: no prefill pool, no work)."""
    return model in state.prefill_models or (
        hints is not None and (hints.prefill_worker_id is not None or hints.prefill_dp_rank is not None)
    )


async def run_prefill(state: FrontendState, ctx: Any) -> PrefillResult | None:
    """Run the prefill phase of ``ctx``'s request; None = decode-only (fallback, already counted and logged).

    On success ``ctx.out_body`` becomes the decode request (with ``kv_transfer_params``).
    Raises OpenAIError(400) for a prefill pin that names no prefill worker of the model.
    """
    model = ctx.entry.name
    hints = ctx.hints
    pool: ModelEntry | None = state.prefill_models.get(model)
    pin, prank = prefill_pin(state, model, hints)
    counter = state.metrics.disagg_prefill
    if pool is None:
        if pin is not None or prank is not None:
            raise OpenAIError(
                400, f"model {model} has no prefill workers: prefill_worker_id / prefill_dp_rank cannot be honoured"
            )
        return None
    if pin is not None and pin not in pool.workers:
        raise OpenAIError(400, f"prefill worker {pin} is not a prefill worker of model {model}")
    salt = hints.cache_salt if hints is not None else None
    try:
        decision = state.prefill_router.route(pool, ctx.tokens, pin, prank, salt, record=wants_routing(hints))
    except OpenAIError as exc:
        if exc.status == 400:
            raise
        log.warning("no prefill worker for %s (%s): decode-only", model, exc.message)
        counter.labels(model, OUTCOME_NO_WORKER).inc()
        return None
    worker, rank = decision.worker, decision.dp_rank
    request_id = state.next_request_id() + "-prefill"
    tracker = pool.tracker
    try:
        state.prefill_router.book(pool, request_id, decision)
    except Exception as exc:
        log.warning("could not book prefill worker %s: %s: decode-only", worker.id, exc)
        counter.labels(model, OUTCOME_FAILED).inc()
        return None
    timing = ctx.timing
    if timing is not None:  # the request is dispatched when its prefill is
        from frontend.request.hints import kv_hit_rate

        timing.dispatched = time.monotonic()
        timing.kv_hit_rate = kv_hit_rate(decision.overlap_blocks, decision.isl, pool.block_size)
    path = "/v1/chat/completions" if ctx.chat else "/v1/completions"
    t0 = _perf()
    error: str | None = None
    params: Any = None
    try:
        body = _priority_for_worker(prefill_body(ctx.body), hints, worker)  # the prefill engine's priority sign
        upstream = await worker.upstream.request("POST", path, body, upstream_headers(rank, request_id), False)
        if upstream.status != 200:
            error = f"prefill worker {worker.id} answered {upstream.status}: {upstream.content[:200]!r}"
        else:
            try:
                obj = orjson.loads(upstream.content)
            except orjson.JSONDecodeError:
                obj = None
            params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
            if not isinstance(params, dict) or not params:
                error = f"prefill worker {worker.id} returned no kv_transfer_params"
    except UpstreamConnectError as exc:
        state.pool.mark_failed(worker, str(exc))
        error = f"prefill worker {worker.id} unreachable: {exc}"
    except (UpstreamError, OSError) as exc:
        state.pool.mark_failed(worker, f"{type(exc).__name__}: {exc}", unreachable=False)
        error = f"prefill worker {worker.id} failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            tracker.free(request_id)
        except Exception as exc:
            log.debug("free(%s): %s", request_id, exc)
        state.capacity_changed(model)
    seconds = _perf() - t0
    if error is not None:
        log.warning("%s: decode-only", error)
        counter.labels(model, OUTCOME_FAILED).inc()
        return None
    counter.labels(model, OUTCOME_REMOTE).inc()
    g = state.worker_gauges(worker.id, rank, PREFILL_WORKER_TYPE)
    g[0].set(seconds)
    g[1].set(decision.isl)
    ctx.out_body = decode_body(ctx.body, params, getattr(ctx, "strip_usage", False))
    ctx.engine_ids = ctx.ids_body = None  # the decode side gets the text the prefill side computed
    ctx.body = {**ctx.body, "kv_transfer_params": params}  # bodies re-derived from it (unary-as-stream) keep them
    record = routing_record(state.prefill_router.config, pool, decision) if wants_routing(hints) else None
    return PrefillResult(
        worker.id, rank, decision.isl, decision.overlap_blocks, decision.cached_tokens, params, seconds, record
    )


def explain_prefill(state: FrontendState, model: str, tokens: Sequence[int]) -> dict | None:
    """``POST /admin/route``'s view of the prefill phase (nothing booked), or None without a prefill pool."""
    pool = state.prefill_models.get(model)
    if pool is None:
        return None
    try:
        d = state.prefill_router.route(pool, tokens, explain=True)
    except OpenAIError as exc:
        return {"error": exc.message, "fallback": "decode-only"}
    return routing_record(state.prefill_router.config, pool, d)
