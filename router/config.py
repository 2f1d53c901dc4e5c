"""Router configuration: every ``--router-*`` flag of the router guide with its ``DYN_*`` variable.

Precedence is the reference's: command line > environment variable > default. Boolean flags come
in ``--x`` / ``--no-x`` pairs and their variables accept ``1/true/yes/on`` and ``0/false/no/off``.
The same parser feeds ``python -m frontend`` and anything else that routes (benchmarks, tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

ROUTER_MODES = ("kv", "latency", "round_robin", "random")
KV_AWARE_MODES = ("kv", "latency")  # modes that read the block index
QUEUE_POLICIES = ("fcfs", "lcfs", "wspt")
SESSION_AFFINITY_MODES = ("hard", "soft")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def normalize_router_mode(value: str) -> str:
    """``round-robin`` and ``round_robin`` are the same mode."""
    mode = value.strip().lower().replace("-", "_")
    if mode not in ROUTER_MODES:
        raise argparse.ArgumentTypeError(
            f"invalid router mode {value!r} (choose from kv, latency, round_robin, random)"
        )
    return mode


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _optional_float(value: str) -> float | None:
    if value is None or value.strip().lower() in ("", "none", "null"):
        return None
    return float(value)


def _optional_int(value: str) -> int | None:
    if value is None or value.strip().lower() in ("", "none", "null"):
        return None
    return int(value)


def _positive_float(value: str) -> float:
    v = float(value)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def _nonneg_optional_float(value: str) -> float | None:
    v = _optional_float(value)
    if v is not None and v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _positive_optional_float(value: str) -> float | None:
    v = _optional_float(value)
    if v is not None and v <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def _unit_optional_float(value: str) -> float | None:
    v = _optional_float(value)
    if v is not None and not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0.0 and 1.0")
    return v


def _nonneg_int(value: str) -> int:
    v = int(value)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _nonneg_optional_int(value: str) -> int | None:
    v = _optional_int(value)
    if v is not None and v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _queue_policy(value: str) -> str:
    v = value.strip().lower()
    if v not in QUEUE_POLICIES:
        raise argparse.ArgumentTypeError(f"invalid queue policy {value!r} (choose from fcfs, lcfs, wspt)")
    return v


def _prefill_speed(value: str) -> float:
    v = float(value)
    if not 100.0 <= v <= 1e8:
        raise argparse.ArgumentTypeError("must be between 100 and 1e8 tokens/s")
    return v


def _window(value: str) -> float:
    v = float(value)
    if not 1.0 <= v <= 1e6:
        raise argparse.ArgumentTypeError("must be between 1 and 1e6 observations")
    return v


def _horizon(value: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 86400.0:
        raise argparse.ArgumentTypeError("must be between 0 (off) and 86400 s")
    return v


def _recompute_weight(value: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 100.0:
        raise argparse.ArgumentTypeError("must be between 0 and 100")
    return v


def _affinity_mode(value: str) -> str:
    v = value.strip().lower()
    if v not in SESSION_AFFINITY_MODES:
        raise argparse.ArgumentTypeError(f"invalid session affinity mode {value!r} (choose from hard, soft)")
    return v


def _positive_int(value: str) -> int:
    v = int(value)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def _session_ttl(value: str) -> float | None:
    v = _optional_float(value)
    if v is not None and not 1 <= v <= 31_536_000:
        raise argparse.ArgumentTypeError("must be between 1 and 31536000 seconds")
    return v


@dataclass(slots=True)
class RouterConfig:
    """Everything that shapes a routing decision. Defaults are the router guide's."""

    router_mode: str = "round_robin"
    router_temperature: float = 0.0
    kv_cache_block_size: int | None = None  # None: take the workers' block size
    router_kv_events: bool = True
    router_kv_overlap_score_weight: float = 1.0
    router_ttl_secs: float = 120.0
    router_max_tree_size: int = 1 << 20
    router_prune_target_ratio: float = 0.8
    router_event_threads: int = 1
    router_track_active_blocks: bool = True
    router_track_output_blocks: bool = False
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_queue_threshold: float | None = None
    router_queue_policy: str = "fcfs"
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    router_session_affinity_ttl_secs: float | None = None
    router_session_affinity_mode: str = "hard"  # hard = the bound worker or nothing; soft = a preference
    router_replica_sync: bool = False
    router_min_initial_workers: int = 0
    migration_limit: int = 0
    router_queue_max: int | None = None
    router_queue_timeout_secs: float | None = None
    stream_idle_timeout: float | None = None
    router_latency_prefill_tokens_per_s: float = 20000.0
    router_latency_window: float = 100.0
    router_latency_live_horizon: float = 10.0
    router_latency_recompute_weight: float = 1.0
    router_latency_predict_routed: bool = True
    router_latency_book_predicted: bool = False
    # JetStream mode (deprecated in the guide): accepted, no effect here (see JETSTREAM_FLAGS)
    router_durable_kv_events: bool = False
    router_reset_states: bool = False
    router_snapshot_threshold: int = 1_000_000
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def uses_indexer(self) -> bool:
        """A weight of 0 means pure load balancing: the reference builds no indexer at all."""
        if self.router_mode == "latency":
            return True
        return self.router_mode == "kv" and self.router_kv_overlap_score_weight != 0

    @property
    def kv_aware(self) -> bool:
        """kv and latency modes: overlaps from the index (event-fed or approximate) shape the choice."""
        return self.router_mode in KV_AWARE_MODES

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RouterConfig:
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if f.name != "extra" and hasattr(ns, f.name)}
        return cls(**values)


# (flag, dest, env vars (first wins), type, default, help). Booleans use type=bool.
_FLAGS: list[tuple[str, str, tuple[str, ...], Any, Any, str]] = [
    (
        "--router-mode",
        "router_mode",
        ("DYN_ROUTER_MODE",),
        normalize_router_mode,
        "round_robin",
        "kv | latency (lowest estimated TTFT, learned per worker) | round_robin (round-robin) | random",
    ),
    (
        "--router-temperature",
        "router_temperature",
        ("DYN_ROUTER_TEMPERATURE",),
        float,
        0.0,
        "softmax temperature over min-max normalised costs; 0 = lowest cost, random among ties",
    ),
    (
        "--kv-cache-block-size",
        "kv_cache_block_size",
        ("DYN_KV_CACHE_BLOCK_SIZE", "DYN_ROUTER_BLOCK_SIZE"),
        _optional_int,
        None,
        "router block size in tokens (must match the engines'); default: the workers' block size",
    ),
    (
        "--router-kv-events",
        "router_kv_events",
        ("DYN_ROUTER_USE_KV_EVENTS", "DYN_ROUTER_KV_EVENTS"),
        bool,
        True,
        "learn cached blocks from the workers' ZMQ KV events; --no-router-kv-events = approximate mode",
    ),
    (
        "--router-kv-overlap-score-weight",
        "router_kv_overlap_score_weight",
        ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT"),
        float,
        1.0,
        "weight of prefill blocks in cost = weight * prefill_blocks + decode_blocks; 0 = pure load balancing",
    ),
    (
        "--router-ttl-secs",
        "router_ttl_secs",
        ("DYN_ROUTER_TTL_SECS", "DYN_ROUTER_TTL"),
        _positive_float,
        120.0,
        "approximate mode: lifetime of predicted blocks",
    ),
    (
        "--router-max-tree-size",
        "router_max_tree_size",
        ("DYN_ROUTER_MAX_TREE_SIZE",),
        int,
        1 << 20,
        "approximate mode: prune when the predicted index holds more blocks than this",
    ),
    (
        "--router-prune-target-ratio",
        "router_prune_target_ratio",
        ("DYN_ROUTER_PRUNE_TARGET_RATIO",),
        float,
        0.8,
        "approximate mode: prune down to this fraction of --router-max-tree-size",
    ),
    (
        "--router-event-threads",
        "router_event_threads",
        ("DYN_ROUTER_EVENT_THREADS",),
        _positive_int,
        1,
        "accepted (>= 1), no effect: KV events are decoded and applied on the asyncio loop in one thread (a pool would "
        "need a lock around every index update and, under the GIL, would not apply them faster)",
    ),
    (
        "--router-track-active-blocks",
        "router_track_active_blocks",
        ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS",),
        bool,
        True,
        "count in-flight prompt blocks per worker as decode load",
    ),
    (
        "--router-track-output-blocks",
        "router_track_output_blocks",
        ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS",),
        bool,
        False,
        "add placeholder blocks as output tokens stream, decayed by agent_hints.osl",
    ),
    (
        "--router-assume-kv-reuse",
        "router_assume_kv_reuse",
        ("DYN_ROUTER_ASSUME_KV_REUSE",),
        bool,
        True,
        "dedupe in-flight blocks by content; --no-router-assume-kv-reuse counts every request's blocks as unique",
    ),
    (
        "--router-track-prefill-tokens",
        "router_track_prefill_tokens",
        ("DYN_ROUTER_TRACK_PREFILL_TOKENS",),
        bool,
        True,
        "count uncached prompt tokens in flight per worker as prefill load",
    ),
    (
        "--router-queue-threshold",
        "router_queue_threshold",
        ("DYN_ROUTER_QUEUE_THRESHOLD",),
        _positive_optional_float,
        None,
        "hold requests while every rank's prefill tokens exceed this fraction of max_num_batched_tokens (unset = no "
        "queue)",
    ),
    (
        "--router-queue-policy",
        "router_queue_policy",
        ("DYN_ROUTER_QUEUE_POLICY",),
        _queue_policy,
        "fcfs",
        "order of held requests: fcfs | lcfs | wspt",
    ),
    (
        "--active-decode-blocks-threshold",
        "active_decode_blocks_threshold",
        ("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",),
        _unit_optional_float,
        None,
        "busy when active decode blocks exceed this fraction of the worker's KV blocks",
    ),
    (
        "--active-prefill-tokens-threshold",
        "active_prefill_tokens_threshold",
        ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",),
        _optional_int,
        None,
        "busy when active prefill tokens exceed this count",
    ),
    (
        "--active-prefill-tokens-threshold-frac",
        "active_prefill_tokens_threshold_frac",
        ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",),
        _nonneg_optional_float,
        None,
        "busy when active prefill tokens exceed this fraction of max_num_batched_tokens",
    ),
    (
        "--router-session-affinity-ttl-secs",
        "router_session_affinity_ttl_secs",
        ("DYN_ROUTER_SESSION_AFFINITY_TTL_SECS",),
        _session_ttl,
        None,
        "bind X-Dynamo-Session-ID sessions to a worker for this idle TTL (unset = off)",
    ),
    (
        "--router-session-affinity-mode",
        "router_session_affinity_mode",
        ("DYN_ROUTER_SESSION_AFFINITY_MODE",),
        _affinity_mode,
        "hard",
        "hard = a bound session goes to its worker or fails (503/529); soft = the binding is a preference: "
        "when that worker cannot take the request it is routed freely and the session rebinds",
    ),
    (
        "--router-replica-sync",
        "router_replica_sync",
        ("DYN_ROUTER_REPLICA_SYNC",),
        bool,
        False,
        "share active load with other frontend replicas",
    ),
    (
        "--router-min-initial-workers",
        "router_min_initial_workers",
        ("DYN_ROUTER_MIN_INITIAL_WORKERS",),
        int,
        0,
        "wait for this many workers before serving",
    ),
    (
        "--migration-limit",
        "migration_limit",
        ("DYN_MIGRATION_LIMIT",),
        _nonneg_int,
        0,
        "times one request may be re-dispatched to another worker after its worker failed (0 = off)",
    ),
    (
        "--router-queue-max",
        "router_queue_max",
        ("DYN_ROUTER_QUEUE_MAX",),
        _nonneg_optional_int,
        None,
        "requests the router queue may hold per model; a request arriving at a full queue gets 529 + Retry-After "
        "(unset = unbounded)",
    ),
    (
        "--router-queue-timeout-secs",
        "router_queue_timeout_secs",
        ("DYN_ROUTER_QUEUE_TIMEOUT_SECS",),
        _positive_optional_float,
        None,
        "a request held longer than this in the router queue gets 529 + Retry-After (unset = wait for capacity)",
    ),
    (
        "--stream-idle-timeout",
        "stream_idle_timeout",
        ("DYN_STREAM_IDLE_TIMEOUT",),
        _positive_optional_float,
        None,
        "seconds a worker may go silent mid-stream (after its first byte) before the stream is cut or migrated "
        "(unset = off)",
    ),
    (
        "--router-latency-prefill-tokens-per-s",
        "router_latency_prefill_tokens_per_s",
        ("DYN_ROUTER_LATENCY_PREFILL_TOKENS_PER_S",),
        _prefill_speed,
        20000.0,
        "latency mode: prior prefill speed of a worker rank until its own TTFTs are learned",
    ),
    (
        "--router-latency-window",
        "router_latency_window",
        ("DYN_ROUTER_LATENCY_WINDOW",),
        _window,
        100.0,
        "latency mode: observed TTFTs per rank the learned speed mostly rests on (exponential forgetting)",
    ),
    (
        "--router-latency-live-horizon",
        "router_latency_live_horizon",
        ("DYN_ROUTER_LATENCY_LIVE_HORIZON",),
        _horizon,
        10.0,
        "latency mode: seconds a block routed to a rank counts as live there (its cache terms: evicting live "
        "blocks, room); 0 turns the cache terms off",
    ),
    (
        "--router-latency-recompute-weight",
        "router_latency_recompute_weight",
        ("DYN_ROUTER_LATENCY_RECOMPUTE_WEIGHT",),
        _recompute_weight,
        1.0,
        "latency mode: a rank that would compute again blocks another rank holds is charged this many times "
        "their prefill, besides its own (raise it where engines share compute, e.g. CPU engines on the same cores)",
    ),
    (
        "--router-latency-predict-routed",
        "router_latency_predict_routed",
        ("DYN_ROUTER_LATENCY_PREDICT_ROUTED",),
        bool,
        True,
        "latency mode: a rank holds the blocks of the prompts just routed to it (within the live horizon) before "
        "their KV events arrive (a group's users arriving during their shared prefix's first prefill follow it)",
    ),
    (
        "--router-latency-book-predicted",
        "router_latency_book_predicted",
        ("DYN_ROUTER_LATENCY_BOOK_PREDICTED",),
        bool,
        False,
        "latency mode: a request whose prefix was just routed to its rank books only the prefill of the rest as "
        "queued work there (not the whole prompt until KV events show the prefix), so that rank does not look "
        "loaded by the prefix it holds",
    ),
    (
        "--router-durable-kv-events",
        "router_durable_kv_events",
        ("DYN_ROUTER_DURABLE_KV_EVENTS",),
        bool,
        False,
        "JetStream mode (deprecated in the guide): accepted, no effect: no NATS here; KV events come over ZMQ with "
        "gap replay",
    ),
    (
        "--router-reset-states",
        "router_reset_states",
        ("DYN_ROUTER_RESET_STATES",),
        bool,
        False,
        "JetStream mode only: accepted, no effect (no JetStream stream or object store to purge)",
    ),
    (
        "--router-snapshot-threshold",
        "router_snapshot_threshold",
        ("DYN_ROUTER_SNAPSHOT_THRESHOLD",),
        _positive_int,
        1_000_000,
        "JetStream mode only: accepted, no effect (no JetStream stream to snapshot)",
    ),
]

# flags that need NATS JetStream, which kvroute does not run: dest -> why they have no effect
JETSTREAM_FLAGS: dict[str, str] = {
    "router_durable_kv_events": "--router-durable-kv-events selects NATS JetStream for KV events; kvroute takes KV "
    "events "
    "over ZMQ from the workers (gap replay rebuilds state), so it has no effect",
    "router_reset_states": "--router-reset-states purges the JetStream stream and object store; kvroute runs neither, "
    "so it has no effect (restarting the frontend already starts from the workers' state)",
    "router_snapshot_threshold": "--router-snapshot-threshold sizes JetStream radix-tree snapshots; kvroute runs no "
    "JetStream, so it has no effect",
}


def _env_default(envs: tuple[str, ...], conv: Any, default: Any, environ: dict[str, str]) -> Any:
    for name in envs:
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            return _parse_bool(raw) if conv is bool else conv(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"invalid value for {name}={raw!r}: {exc}") from None
    return default


def add_router_args(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Add every router flag to ``parser`` with defaults taken from the DYN_* environment."""
    env = dict(os.environ if environ is None else environ)
    group = parser.add_argument_group("router")
    for flag, dest, envs, conv, default, help_text in _FLAGS:
        value = _env_default(envs, conv, default, env)
        help_full = f"{help_text} [env {envs[0]}; default {default}]"
        if conv is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=value, help=help_full)
        else:
            group.add_argument(flag, dest=dest, type=conv, default=value, help=help_full)
    # the reference's legacy spellings
    group.add_argument(
        "--kv-overlap-score-weight",
        dest="router_kv_overlap_score_weight",
        type=float,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    group.add_argument(
        "--router-ttl", dest="router_ttl_secs", type=_positive_float, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    # the standalone router's name for the block size (router guide, disaggregated serving)
    group.add_argument(
        "--router-block-size",
        dest="kv_cache_block_size",
        type=_optional_int,
        default=argparse.SUPPRESS,
        help="same as --kv-cache-block-size (the standalone router's name) [env DYN_ROUTER_BLOCK_SIZE]",
    )


# Disaggregated serving (frontend/routing/disagg.py) routes each phase with a variant of the frontend's settings.
def prefill_router_config(cfg: RouterConfig) -> RouterConfig:
    """The prefill router: the frontend's settings with active-block (and output-block) tracking off."""
    return dataclasses.replace(cfg, router_track_active_blocks=False, router_track_output_blocks=False)


def decode_router_config(cfg: RouterConfig) -> RouterConfig:
    """Decode routing of a remotely prefilled request: load only (the prompt's KV arrives by transfer,
    so cache overlap and prefill tokens do not matter, and transferred blocks may duplicate cached ones).
    latency mode's estimate is a prefill time, so the decode side uses kv's load term instead."""
    return dataclasses.replace(
        cfg,
        router_mode="kv" if cfg.router_mode == "latency" else cfg.router_mode,
        router_kv_overlap_score_weight=0.0,
        router_assume_kv_reuse=False,
        router_track_prefill_tokens=False,
    )
