"""Generates deploy/grafana/kvroute.json, the Grafana dashboard over kvroute's Prometheus metrics.

    python deploy/grafana/dashboard.py          # rewrite kvroute.json
    python deploy/grafana/dashboard.py --check  # exit 1 if kvroute.json is not what this file makes

Edit the panels here, not the JSON: tests/test_grafana.py checks that the JSON is this file's output
and that every PromQL expression in it names only metrics and labels a running frontend (or, in the
"Standalone indexer" row, a running indexer) exports.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

Panel = dict[str, Any]

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvroute.json")
UID = "kvroute-frontend"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
INDEXER_ROW = "Standalone indexer"  # panels under this row read the indexer's metrics, not the frontend's

RI = "$__rate_interval"
F = 'instance=~"$instance"'  # the frontend replicas chosen at the top
FM = F + ', model=~"$model"'
FI = 'instance=~"$indexer"'


def rate(metric: str, sel: str = F, by: str = "", fn: str = "rate") -> str:
    """``sum [by (labels)] (fn(metric{sel}[$__rate_interval]))``: per second, or per interval with fn="increase"."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({fn}({metric}{{{sel}}}[{RI}]))"


def agg(metric: str, sel: str = F, by: str = "", op: str = "sum") -> str:
    """``op [by (labels)] (metric{sel})``: a gauge aggregated over the chosen series."""
    grouping = f" by ({by})" if by else ""
    return f"{op}{grouping} ({metric}{{{sel}}})"


def quantile(q: float, histogram: str, sel: str = F, by: str = "") -> str:
    """``histogram_quantile`` over the ``_bucket`` series of ``histogram``, grouped by ``le`` (and ``by``)."""
    labels = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{{{sel}}}[{RI}])))"


def mean(histogram: str, sel: str = F, by: str = "") -> str:
    """Mean of a histogram over the rate interval: rate of ``_sum`` over rate of ``_count``."""
    return f"{rate(histogram + '_sum', sel, by)} / {rate(histogram + '_count', sel, by)}"


def quantiles(histogram: str, sel: str = F, what: str = "", mean_too: bool = True) -> list[tuple[str, str]]:
    """p50 / p90 / p99 (and the mean) targets of one histogram."""
    out = [(quantile(q, histogram, sel), f"{what}p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]
    if mean_too:
        out.append((mean(histogram, sel), f"{what}mean"))
    return out


def target(expr: str, legend: str, ref: int, **extra: Any) -> dict[str, Any]:
    refid = chr(ord("A") + ref)
    return {"datasource": DATASOURCE, "refId": refid, "expr": expr, "legendFormat": legend, "range": True, **extra}


def panel(
    kind: str,
    title: str,
    desc: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    w: int = 8,
    h: int = 8,
    **fields: Any,
) -> Panel:
    """One panel (ids and positions are filled in by ``layout``)."""
    defaults: dict[str, Any] = {"unit": unit}
    defaults.update(fields.pop("defaults", {}))
    p: Panel = {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "targets": [target(expr, legend, i) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
    }
    p.update(fields)
    return p


def ts(
    title: str,
    desc: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    w: int = 8,
    h: int = 8,
    stack: bool = False,
    **defaults: Any,
) -> Panel:
    """A time series panel."""
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10 if stack else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    return panel(
        "timeseries",
        title,
        desc,
        targets,
        unit,
        w,
        h,
        defaults={"custom": custom, **defaults},
        options={
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def stat(
    title: str,
    desc: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    w: int = 3,
    h: int = 4,
    red_at: float | None = None,
    graph: bool = True,
) -> Panel:
    """A stat panel (last value); ``red_at`` turns it red from that value on."""
    steps = [{"color": "green", "value": None}] + ([{"color": "red", "value": red_at}] if red_at is not None else [])
    return panel(
        "stat",
        title,
        desc,
        targets,
        unit,
        w,
        h,
        defaults={"thresholds": {"mode": "absolute", "steps": steps}, "color": {"mode": "thresholds"}},
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area" if graph else "none",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
    )


def timeline(
    title: str, desc: str, targets: list[tuple[str, str]], ok: str, bad: str, w: int = 12, h: int = 6
) -> Panel:
    """A state timeline of 0/1 series: 0 = ``ok`` (green), 1 = ``bad`` (red)."""
    mappings = [{"type": "value", "options": {"0": {"text": ok, "color": "green"}, "1": {"text": bad, "color": "red"}}}]
    return panel(
        "state-timeline",
        title,
        desc,
        targets,
        "none",
        w,
        h,
        defaults={
            "mappings": mappings,
            "color": {"mode": "thresholds"},
            "thresholds": {
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
            },
        },
        options={
            "showValue": "never",
            "mergeValues": True,
            "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        },
    )


def heatmap(title: str, desc: str, histogram: str, sel: str, unit: str, w: int = 8, h: int = 8) -> Panel:
    """A heatmap of a histogram's buckets (requests per bucket per interval)."""
    p = panel(
        "heatmap",
        title,
        desc,
        [(rate(histogram + "_bucket", sel, "le", "increase"), "{{le}}")],
        unit,
        w,
        h,
        options={
            "calculate": False,
            "yAxis": {"unit": unit},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges"},
            "tooltip": {"show": True, "yHistogram": False},
        },
    )
    p["targets"][0].update(format="heatmap", range=True)
    return p


def row(title: str, panels: list[Panel], collapsed: bool = False) -> tuple[Panel, list[Panel]]:
    return {
        "type": "row",
        "title": title,
        "collapsed": collapsed,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
        "panels": [],
    }, panels


W_RANK = "{{worker_type}} w{{worker_id}} r{{dp_rank}}"
WORKER_RANK = "{{instance}} " + W_RANK


def rows() -> list[tuple[Panel, list[Panel]]]:
    """Every row and its panels, top to bottom."""
    errors = f'{FM}, status="error"'
    mismatched = f'{F}, result="mismatch"'
    overview = row(
        "Overview",
        [
            stat(
                "Models ready",
                "Models with at least one healthy worker (dynamo_frontend_model_ready).",
                [(agg("dynamo_frontend_model_ready", FM), "ready")],
            ),
            stat(
                "Worker ranks healthy",
                "Worker ranks the router may pick (dynamo_component_router_worker_registered = 1) and all it knows.",
                [
                    (agg("dynamo_component_router_worker_registered"), "healthy"),
                    (agg("dynamo_component_router_worker_registered", op="count"), "known"),
                ],
            ),
            stat(
                "Requests / s",
                "Finished requests per second (dynamo_frontend_requests_total).",
                [(rate("dynamo_frontend_requests_total", FM), "req/s")],
                unit="reqps",
            ),
            stat(
                "Error ratio",
                'Share of finished requests with status="error".',
                [
                    (
                        f"({rate('dynamo_frontend_requests_total', errors)} or vector(0)) / "
                        f"{rate('dynamo_frontend_requests_total', FM)}",
                        "errors",
                    )
                ],
                unit="percentunit",
                red_at=0.05,
            ),
            stat(
                "TTFT p90",
                "90th percentile time to first token.",
                [(quantile(0.9, "dynamo_frontend_time_to_first_token_seconds", FM), "p90")],
                unit="s",
            ),
            stat(
                "Delivered cache reuse",
                "Engine-reported cached prompt tokens over prompt tokens (hit-rate decomposition: delivered / prompt).",
                [
                    (
                        f"{rate('kvroute_router_delivered_cached_tokens_total', FM)} / "
                        f"{rate('kvroute_router_prompt_tokens_total', FM)}",
                        "reuse",
                    )
                ],
                unit="percentunit",
            ),
            stat(
                "Hash-parity alarms",
                "Workers whose cached blocks never match the router's hashes (kvroute_hash_parity_mismatch). "
                "Above 0: KV routing is blind for them; the cause is in the frontend's log and /admin/workers.",
                [(agg("kvroute_hash_parity_mismatch") + " or vector(0)", "alarms")],
                red_at=1,
            ),
            stat(
                "Workers without KV events",
                "Healthy workers the router expects KV events from that have no kv_events_endpoint "
                "(dynamo_component_router_kv_event_source_mismatch_workers).",
                [(agg("dynamo_component_router_kv_event_source_mismatch_workers", FM) + " or vector(0)", "workers")],
                red_at=1,
            ),
        ],
    )
    requests = row(
        "Requests and errors",
        [
            ts(
                "Request rate by endpoint and type",
                "Finished requests per second by endpoint and unary / stream.",
                [
                    (
                        rate("dynamo_frontend_requests_total", FM, "endpoint, request_type"),
                        "{{endpoint}} {{request_type}}",
                    )
                ],
                unit="reqps",
            ),
            ts(
                "Errors by type",
                "Failed requests per second by error_type: overload (529, every worker busy or the queue refused), "
                "unavailable (503, no worker), validation (400), cancelled (client went away), internal (500)...",
                [(rate("dynamo_frontend_requests_total", errors, "model, error_type"), "{{model}} {{error_type}}")],
                unit="reqps",
            ),
            ts(
                "Requests in flight",
                "Requests the frontend holds (active) and those still waiting for their first token.",
                [
                    (agg("dynamo_frontend_active_requests", FM, "model"), "active {{model}}"),
                    (agg("dynamo_frontend_queued_requests", FM, "model"), "before first token {{model}}"),
                ],
            ),
            ts(
                "Cancellations and disconnects",
                "Requests cancelled by their client, and clients that went away before the end of their "
                "response (dynamo_frontend_disconnected_clients only grows: its rate is the disconnect rate).",
                [
                    (
                        rate("dynamo_frontend_model_cancellation_total", FM, "endpoint, request_type"),
                        "cancelled {{endpoint}} {{request_type}}",
                    ),
                    (rate("dynamo_frontend_disconnected_clients"), "disconnected"),
                ],
                unit="reqps",
            ),
            ts(
                "Token throughput",
                "Prompt tokens and generated tokens per second.",
                [
                    (rate("dynamo_frontend_input_sequence_tokens_sum", FM), "prompt tokens/s"),
                    (rate("dynamo_frontend_output_tokens_total", FM), "generated tokens/s"),
                ],
            ),
            ts(
                "Prompt and output length",
                "Median and 90th percentile prompt (ISL) and output (OSL) lengths in tokens.",
                [
                    (quantile(0.5, "dynamo_frontend_input_sequence_tokens", FM), "ISL p50"),
                    (quantile(0.9, "dynamo_frontend_input_sequence_tokens", FM), "ISL p90"),
                    (quantile(0.5, "dynamo_frontend_output_sequence_tokens", FM), "OSL p50"),
                    (quantile(0.9, "dynamo_frontend_output_sequence_tokens", FM), "OSL p90"),
                ],
            ),
        ],
    )
    latency = row(
        "Latency",
        [
            ts(
                "Time to first token",
                "TTFT quantiles and mean from dynamo_frontend_time_to_first_token_seconds.",
                quantiles("dynamo_frontend_time_to_first_token_seconds", FM),
                unit="s",
            ),
            ts(
                "Inter-token latency",
                "ITL quantiles and mean from dynamo_frontend_inter_token_latency_seconds.",
                quantiles("dynamo_frontend_inter_token_latency_seconds", FM),
                unit="s",
            ),
            ts(
                "Request duration",
                "Whole-request time quantiles and mean from dynamo_frontend_request_duration_seconds.",
                quantiles("dynamo_frontend_request_duration_seconds", FM),
                unit="s",
            ),
            heatmap(
                "TTFT distribution",
                "Requests per TTFT bucket per interval.",
                "dynamo_frontend_time_to_first_token_seconds",
                FM,
                "s",
            ),
            ts(
                "TTFT p90 by model",
                "90th percentile TTFT of each model.",
                [(quantile(0.9, "dynamo_frontend_time_to_first_token_seconds", FM, "model"), "{{model}}")],
                unit="s",
            ),
            ts(
                "Last TTFT and ITL per worker rank",
                "The most recent request's TTFT and ITL on each worker rank (gauges, not averages).",
                [
                    (f"dynamo_frontend_worker_last_time_to_first_token_seconds{{{F}}}", "TTFT " + WORKER_RANK),
                    (f"dynamo_frontend_worker_last_inter_token_latency_seconds{{{F}}}", "ITL " + WORKER_RANK),
                ],
                unit="s",
            ),
        ],
    )
    routing = row(
        "Routing",
        [
            ts(
                "Routing decisions",
                "Requests routed to a worker (started) and routed requests completed, per frontend replica. "
                "The router mode is a flag, not a label: compare replicas or time ranges.",
                [
                    (rate("dynamo_component_router_requests_started_total", F, "instance"), "routed {{instance}}"),
                    (rate("dynamo_component_router_requests_total", F, "instance"), "completed {{instance}}"),
                ],
                unit="reqps",
            ),
            ts(
                "Predicted KV hit rate",
                "Share of the prompt's blocks the router found cached on the worker it chose "
                "(dynamo_component_router_kv_hit_rate).",
                quantiles("dynamo_component_router_kv_hit_rate", F),
                unit="percentunit",
                min=0,
                max=1,
            ),
            ts(
                "Predicted cached share of prompt tokens",
                "Prompt tokens predicted cached on the chosen worker over all prompt tokens.",
                [
                    (
                        f"{rate('dynamo_frontend_cached_tokens_sum', FM, 'model')} / "
                        f"{rate('dynamo_frontend_input_sequence_tokens_sum', FM, 'model')}",
                        "{{model}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            ts(
                "Routing decision time",
                "The router's own time for one decision (hashing, index lookup, scheduling), ms.",
                quantiles("dynamo_router_overhead_total_ms", F, mean_too=False),
                unit="ms",
            ),
            ts(
                "Routing time by stage (p99)",
                "99th percentile of each stage of a routing decision, ms.",
                [
                    (quantile(0.99, f"dynamo_router_overhead_{stage}_ms", F), stage.replace("_", " "))
                    for stage in ("block_hashing", "seq_hashing", "indexer_find_matches", "scheduling")
                ],
                unit="ms",
            ),
            ts(
                "Tokenizer latency",
                "Tokenization time per request (median and p99), ms.",
                [
                    (quantile(0.5, "dynamo_frontend_tokenizer_latency_ms", F, "operation"), "{{operation}} p50"),
                    (quantile(0.99, "dynamo_frontend_tokenizer_latency_ms", F, "operation"), "{{operation}} p99"),
                ],
                unit="ms",
            ),
            ts(
                "Migrations",
                "Requests re-dispatched to another worker after their worker failed (--migration-limit).",
                [
                    (
                        rate("dynamo_frontend_model_migration_total", FM, "model, migration_type"),
                        "{{model}} {{migration_type}}",
                    )
                ],
                unit="reqps",
            ),
            ts(
                "Disaggregated prefill outcomes",
                "Requests of models with a prefill pool by how their prefill went: remote, "
                "no_prefill_worker, prefill_failed.",
                [(rate("kvroute_disagg_prefill_requests_total", FM, "model, outcome"), "{{model}} {{outcome}}")],
                unit="reqps",
            ),
        ],
    )
    queue = row(
        "Router queue and admission",
        [
            ts(
                "Queued requests",
                "Requests held in the router queue (--router-queue-threshold) until a worker has room.",
                [
                    (
                        agg("dynamo_frontend_router_queue_pending_requests", FM, "model, worker_type, policy_class"),
                        "{{model}} {{worker_type}} {{policy_class}}",
                    )
                ],
            ),
            ts(
                "Queued prompt tokens",
                "Prompt tokens of the queued requests, and how many of them are cached on their best worker.",
                [
                    (agg("dynamo_frontend_router_queue_pending_isl_tokens", FM, "model"), "prompt {{model}}"),
                    (agg("dynamo_frontend_router_queue_pending_cached_tokens", FM, "model"), "cached {{model}}"),
                ],
            ),
            ts(
                "Rejections and backpressure",
                "529 answers: every eligible worker busy (rejections) and requests the router queue refused "
                "(--router-queue-max full or --router-queue-timeout-secs expired) by reason.",
                [
                    (
                        rate("dynamo_frontend_model_rejection_total", FM, "model, endpoint"),
                        "rejected {{model}} {{endpoint}}",
                    ),
                    (
                        rate("dynamo_frontend_router_queue_backpressure_total", FM, "model, reason"),
                        "queue refused {{model}} {{reason}}",
                    ),
                ],
                unit="reqps",
            ),
        ],
    )
    load = row(
        "Worker load",
        [
            ts(
                "Active prefill tokens per worker rank",
                "Prompt tokens being prefilled on each worker rank, as the router books them.",
                [(f"dynamo_frontend_worker_active_prefill_tokens{{{F}}}", WORKER_RANK)],
            ),
            ts(
                "Active decode blocks per worker rank",
                "KV blocks held by running requests on each worker rank, as the router books them.",
                [(f"dynamo_frontend_worker_active_decode_blocks{{{F}}}", WORKER_RANK)],
            ),
            ts(
                "KV block use (router's view)",
                "Active decode blocks of all decode ranks over the models' total KV blocks, per replica.",
                [
                    (
                        agg("dynamo_frontend_worker_active_decode_blocks", F + ', worker_type="decode"', "instance")
                        + " / on (instance) "
                        + agg("dynamo_frontend_model_total_kv_blocks", F, "instance"),
                        "{{instance}}",
                    )
                ],
                unit="percentunit",
                min=0,
            ),
            timeline(
                "Worker rank health",
                "Healthy: the router may pick the rank; unhealthy: known but failing its health checks.",
                [
                    (
                        f"1 - dynamo_component_router_worker_registered{{{F}}}",
                        "{{instance}} {{worker_type}} w{{router_worker_id}} r{{dp_rank}}",
                    )
                ],
                ok="healthy",
                bad="unhealthy",
            ),
            ts(
                "Last prompt length per worker rank",
                "Prompt tokens of the most recent request on each worker rank.",
                [(f"dynamo_frontend_worker_last_input_sequence_tokens{{{F}}}", WORKER_RANK)],
                w=6,
                h=6,
            ),
            stat(
                "Model capacity",
                "What the workers report: total KV blocks, max batched tokens, block size, max sequences, context "
                "length.",
                [
                    (agg(f"dynamo_frontend_model_{m}", FM, "model", "max"), f"{{{{model}}}} {label}")
                    for m, label in (
                        ("total_kv_blocks", "KV blocks"),
                        ("max_num_batched_tokens", "max batched tokens"),
                        ("kv_cache_block_size", "block size"),
                        ("max_num_seqs", "max seqs"),
                        ("context_length", "context length"),
                    )
                ],
                w=6,
                h=6,
                graph=False,
            ),
        ],
    )
    decomposition = row(
        "Hit-rate decomposition",
        [
            ts(
                "Cached prompt tokens: available, captured, delivered",
                "Prompt tokens per second, and the cached share at each step: "
                "available (best eligible worker's predicted overlap), captured (chosen worker's predicted overlap), "
                "delivered (engine-reported).",
                [
                    (rate(f"kvroute_router_{m}_total", FM), label)
                    for m, label in (
                        ("prompt_tokens", "prompt"),
                        ("available_cached_tokens", "available"),
                        ("captured_cached_tokens", "captured"),
                        ("delivered_cached_tokens", "delivered"),
                    )
                ],
            ),
            ts(
                "Decomposition ratios",
                "Choice quality = captured / available (below 1: load balancing traded reuse away); prediction "
                "quality = delivered / captured (below 1: stale index, evictions or a hash mismatch); reuse = "
                "delivered / prompt; "
                "opportunity = available / prompt.",
                [
                    (f"{rate(f'kvroute_router_{a}_total', FM)} / {rate(f'kvroute_router_{b}_total', FM)}", label)
                    for a, b, label in (
                        ("captured_cached_tokens", "available_cached_tokens", "choice quality"),
                        ("delivered_cached_tokens", "captured_cached_tokens", "prediction quality"),
                        ("delivered_cached_tokens", "prompt_tokens", "reuse"),
                        ("available_cached_tokens", "prompt_tokens", "opportunity"),
                    )
                ],
                unit="percentunit",
                min=0,
            ),
            ts(
                "Requests in the decomposition",
                "Requests whose engine reported cached tokens (counted in the decomposition), "
                "against successful requests.",
                [
                    (rate("kvroute_router_decomposed_requests_total", FM), "decomposed"),
                    (rate("dynamo_frontend_requests_total", f'{FM}, status="success"'), "successful"),
                ],
                unit="reqps",
            ),
        ],
    )
    events = row(
        "KV events",
        [
            ts(
                "KV events applied by type and outcome",
                "Events the embedded indexer processed (dynamo_kvrouter_kv_cache_events_applied "
                "counts up as a gauge; its rate is events per second).",
                [
                    (
                        rate("dynamo_kvrouter_kv_cache_events_applied", F, "event_type, status"),
                        "{{event_type}} {{status}}",
                    )
                ],
            ),
            ts(
                "KV events received per worker rank",
                "Events in applied batches per worker rank, the batches applied, and batches dropped as undecodable.",
                [
                    (
                        rate("kvroute_kv_events_received_total", F, "worker_id, dp_rank"),
                        "events w{{worker_id}} r{{dp_rank}}",
                    ),
                    (
                        rate("kvroute_kv_event_batches_applied_total", F, "worker_id, dp_rank"),
                        "batches w{{worker_id}} r{{dp_rank}}",
                    ),
                    (
                        rate("kvroute_kv_event_batches_dropped_total", F, "worker_id, dp_rank"),
                        "dropped batches w{{worker_id}} r{{dp_rank}}",
                    ),
                ],
            ),
            ts(
                "Gaps, replays and restarts",
                "Per interval: sequence gaps and the batches they skipped, replays requested and abandoned, "
                "engine restarts, stored blocks rejected for a block size that is not the router's.",
                [
                    (
                        rate(f"kvroute_kv_event_{m}_total", F, "worker_id, dp_rank", "increase"),
                        f"{label} w{{{{worker_id}}}} r{{{{dp_rank}}}}",
                    )
                    for m, label in (
                        ("gaps", "gaps"),
                        ("batches_missed", "missed batches"),
                        ("replays", "replays"),
                        ("replay_timeouts", "replay timeouts"),
                        ("engine_restarts", "engine restarts"),
                        ("blocks_rejected_block_size", "wrong block size"),
                    )
                ],
            ),
            ts(
                "Last KV event age per worker rank",
                "Seconds since each worker rank's last applied batch; an idle worker publishes "
                "nothing, so read it together with its load.",
                [
                    (
                        "time() - " + agg("kvroute_kv_event_last_timestamp_seconds", F, "worker_id, dp_rank", "max"),
                        "w{{worker_id}} r{{dp_rank}}",
                    )
                ],
                unit="s",
                w=12,
            ),
            ts(
                "KV index lag per worker rank",
                "Seconds from the engine publishing its newest applied KV-event batch to the router applying it "
                "(the engine's clock against the router's): a lag that grows means the index is behind and "
                "routes on stale overlaps.",
                [
                    (
                        agg("kvroute_kv_index_lag_seconds", F, "worker_id, dp_rank", "max"),
                        "w{{worker_id}} r{{dp_rank}}",
                    ),
                    (quantile(0.99, "kvroute_kv_index_apply_lag_seconds"), "p99 of every batch"),
                ],
                unit="s",
                w=12,
            ),
            ts(
                "KV-event batches waiting per worker rank",
                "Batches found queued behind the first when the index last read a worker's KV-event socket: "
                "0 while the index keeps up; a rank that keeps showing more is being applied late.",
                [
                    (
                        agg("kvroute_kv_event_batches_waiting", F, "worker_id, dp_rank", "max"),
                        "w{{worker_id}} r{{dp_rank}}",
                    )
                ],
                w=12,
            ),
            ts(
                "Event-loop lag",
                "How late each frontend's event loop ran a timer that was due (every 20 ms): every request on "
                "that process waited as long. Long stalls come from work done on the loop (a burst of KV "
                "events, a full garbage collection) or from a process starved of CPU.",
                quantiles("kvroute_event_loop_lag_seconds", mean_too=False)
                + [(quantile(0.999, "kvroute_event_loop_lag_seconds"), "p99.9")],
                unit="s",
                w=12,
            ),
            ts(
                "Workers without a KV-event endpoint",
                "Healthy workers the router expects KV events from but that publish none.",
                [
                    (
                        agg("dynamo_component_router_kv_event_source_mismatch_workers", FM, "model, worker_type"),
                        "{{model}} {{worker_type}}",
                    )
                ],
                w=12,
            ),
        ],
    )
    parity = row(
        "Hash parity",
        [
            timeline(
                "Hash-parity alarm per worker",
                "Red while the worker's cached blocks never match the router's hashes "
                "(kvroute_hash_parity_mismatch): wrong tokenizer, block size or salt.",
                [(agg("kvroute_hash_parity_mismatch", F, "worker", "max"), "worker {{worker}}")],
                ok="match",
                bad="mismatch",
            ),
            ts(
                "Parity checks by source and result",
                "Evidence per second: events (the prompt's blocks in the index after the request), "
                "usage (predicted vs engine-reported cached tokens), prompt_tokens (engine counted another prompt "
                "length).",
                [(rate("kvroute_hash_parity_checks_total", F, "source, result"), "{{source}} {{result}}")],
                w=6,
                h=6,
            ),
            ts(
                "Parity mismatch share per worker",
                "Share of a worker's parity checks that mismatched.",
                [
                    (
                        f"{rate('kvroute_hash_parity_checks_total', mismatched, 'worker')} / "
                        f"{rate('kvroute_hash_parity_checks_total', F, 'worker')}",
                        "worker {{worker}}",
                    )
                ],
                unit="percentunit",
                w=6,
                h=6,
                min=0,
            ),
        ],
    )
    indexer = row(
        INDEXER_ROW,
        [
            ts(
                "Indexer HTTP requests and errors",
                "Requests per endpoint and error answers by status class (dynamo_kvindexer_*).",
                [
                    (rate("dynamo_kvindexer_requests_total", FI, "endpoint"), "{{endpoint}}"),
                    (
                        rate("dynamo_kvindexer_errors_total", FI, "endpoint, status_class"),
                        "{{endpoint}} {{status_class}}",
                    ),
                ],
                unit="reqps",
            ),
            ts(
                "Indexer request latency",
                "p50 / p99 per endpoint.",
                [
                    (
                        quantile(q, "dynamo_kvindexer_request_duration_seconds", FI, "endpoint"),
                        f"{{{{endpoint}}}} p{int(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ],
                unit="s",
            ),
            ts(
                "Indexer state",
                "Model partitions, registered workers, ZMQ listeners by status, indexed (worker, block) entries.",
                [
                    (agg("dynamo_kvindexer_models", FI), "models"),
                    (agg("dynamo_kvindexer_workers", FI), "workers"),
                    (agg("dynamo_kvindexer_listeners", FI, "status"), "listeners {{status}}"),
                    (agg("dynamo_kvindexer_blocks", FI, "model, tenant_id"), "blocks {{model}} {{tenant_id}}"),
                ],
            ),
            ts(
                "Indexer KV events",
                "Events applied by type and outcome, and sequence gaps / replays per worker rank.",
                [
                    (
                        rate("dynamo_kvrouter_kv_cache_events_applied", FI, "event_type, status"),
                        "{{event_type}} {{status}}",
                    ),
                    (
                        rate("kvroute_kv_event_gaps_total", FI, "worker_id, dp_rank", "increase"),
                        "gaps w{{worker_id}} r{{dp_rank}}",
                    ),
                    (
                        rate("kvroute_kv_event_replays_total", FI, "worker_id, dp_rank", "increase"),
                        "replays w{{worker_id}} r{{dp_rank}}",
                    ),
                ],
                w=24,
            ),
        ],
        collapsed=True,
    )
    return [overview, requests, latency, routing, queue, load, decomposition, events, parity, indexer]


def layout(sections: list[tuple[Panel, list[Panel]]]) -> list[Panel]:
    """Give every panel an id and a grid position: rows stacked, panels left to right, wrapping at 24."""
    out: list[Panel] = []
    next_id, y = 1, 0
    for head, panels in sections:
        head["id"], head["gridPos"]["y"] = next_id, y
        next_id, y = next_id + 1, y + 1
        out.append(head)
        x, line_h = 0, 0
        for p in panels:
            g = p["gridPos"]
            if x + g["w"] > 24:
                x, y, line_h = 0, y + line_h, 0
            g["x"], g["y"] = x, y
            x, line_h = x + g["w"], max(line_h, g["h"])
            p["id"], next_id = next_id, next_id + 1
        if head["collapsed"]:
            head["panels"] = panels  # a collapsed row carries its panels and takes no room below it
            y = head["gridPos"]["y"] + 1
        else:
            out.extend(panels)
            y += line_h
    return out


def variable(name: str, label: str, query: str, multi: bool = True) -> dict[str, Any]:
    """A query variable over ``label_values(...)`` (All = ``.*``)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
        "regex": "",
        "skipUrlSync": False,
    }


def dashboard() -> dict[str, Any]:
    """The whole dashboard as a dict."""
    templating = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "includeAll": False,
            "multi": False,
            "options": [],
            "refresh": 1,
            "regex": "",
            "skipUrlSync": False,
        },
        variable("instance", "Frontend", "label_values(dynamo_frontend_model_ready, instance)"),
        variable("model", "Model", 'label_values(dynamo_frontend_model_ready{instance=~"$instance"}, model)'),
        variable("indexer", "Standalone indexer", "label_values(dynamo_kvindexer_workers, instance)"),
    ]
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "kvroute: KV-cache-aware routing frontend (requests, latency, routing, queue, worker load, "
        "hit-rate decomposition, KV events, hash parity, standalone indexer).",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [],
        "panels": layout(rows()),
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["kvroute", "llm", "routing"],
        "templating": {"list": templating},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "kvroute",
        "uid": UID,
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    """The dashboard JSON text, as committed."""
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{OUT} is stale: run python deploy/grafana/dashboard.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
