"""Per-request routing hints: the ``nvext`` body extension, the routing headers and session identity.

One parse per request turns the body's ``nvext`` object (removed from the body so the worker never
sees it) and the request headers into a flat :class:`RequestHints`. Rules (the router guide's nvext fields and
headers, as the reference frontend applies them):

- ``nvext`` is validated strictly: unknown fields (also inside ``agent_hints``) or wrong types are a
  400 ``invalid nvext: ...``.
- Routing headers win over ``nvext``; the canonical ``x-dynamo-*`` name is read before its legacy
  aliases; a value that does not parse is ignored (the body value stays).
- ``x-dynamo-worker-instance-id`` sets both ``backend_instance_id`` and ``decode_worker_id``.
- Session identity is header-only: ``x-dynamo-session-id`` first, then the coding-agent headers
  (Claude Code, Codex, DeepSeek harness, OpenCode), values trimmed, empty ignored.
- Queue priority jump = the effective ``priority`` (header, then body), else the deprecated
  ``latency_sensitivity``; clamped at 0 by the queue.

Hot path: a request without ``nvext`` and without any header we know costs one pass over the raw
header list and an empty RequestHints (fresh each time: callers may set fields on it).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvroute_common.constants import U32, U32_MAX, U64, U64_MAX
from kvroute_common.http import ApiError

I32_MIN = -(2**31)
I32_MAX = 2**31 - 1

# Longest session id the session-affinity table accepts (the reference's limit: 256 bytes; longer is a 400,
# raised by router.session when affinity is on; without affinity the id is only identity).
MAX_SESSION_ID_BYTES = 256

_I32 = Annotated[int, msgspec.Meta(ge=I32_MIN, le=I32_MAX)]


# ---------------------------------------------------------------------------------------------
# The nvext schema (1.6.1 field set; unknown fields rejected like serde's deny_unknown_fields)
# ---------------------------------------------------------------------------------------------


class _AgentHints(msgspec.Struct, forbid_unknown_fields=True):
    priority: _I32 | None = None
    strict_priority: U32 | None = None
    osl: U32 | None = None
    speculative_prefill: bool | None = None
    latency_sensitivity: float | None = None


class _MetadataUpload(msgspec.Struct, forbid_unknown_fields=True):
    url: str


class _RoutingConstraints(msgspec.Struct, forbid_unknown_fields=True):
    required_taints: list[str] = []
    preferred_taints: dict[str, float] = {}


class _RouterParams(msgspec.Struct, forbid_unknown_fields=True):
    ttft_target: float | None = None
    itl_target: float | None = None


class _NvExt(msgspec.Struct, forbid_unknown_fields=True):
    greed_sampling: bool | None = None
    use_raw_prompt: bool | None = None
    annotations: list[str] | None = None
    backend_instance_id: U64 | None = None
    token_data: list[U32] | None = None
    max_thinking_tokens: U32 | None = None
    cache_salt: str | None = None
    extra_fields: list[str] | None = None
    metadata_upload: _MetadataUpload | None = None
    prefill_worker_id: U64 | None = None
    decode_worker_id: U64 | None = None
    dp_rank: U32 | None = None
    prefill_dp_rank: U32 | None = None
    agent_hints: _AgentHints | None = None
    request_timestamp_ms: float | None = None
    routing_constraints: _RoutingConstraints | None = None
    router: _RouterParams | None = None


# ---------------------------------------------------------------------------------------------
# The parsed result
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestHints:
    """Everything the router and response builder need from ``nvext`` + headers, flattened."""

    # pinning (None = not pinned)
    backend_instance_id: int | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    dp_rank: int | None = None
    prefill_dp_rank: int | None = None
    # agent hints
    priority: int | None = None  # effective: header x-dynamo-request-priority, else body
    strict_priority: int | None = None  # effective: header x-dynamo-request-strict-priority, else body
    osl: int | None = None
    speculative_prefill: bool = False
    latency_sensitivity: float | None = None
    # response metadata requested via extra_fields
    want_worker_id: bool = False
    want_timing: bool = False
    # session identity (headers only)
    session_id: str | None = None
    parent_session_id: str | None = None
    session_final: bool | None = None
    # other accepted nvext fields the frontend may use
    cache_salt: str | None = None  # nvext.cache_salt, overridden by x-tenant-id; empty = absent
    token_data: list[int] | None = None
    greed_sampling: bool | None = None
    use_raw_prompt: bool | None = None
    annotations: list[str] | None = None
    max_thinking_tokens: int | None = None
    request_timestamp_ms: float | None = None
    extra_fields: list[str] = field(default_factory=list)
    want_stop_reason: bool = False
    metadata_upload: str | None = None  # nvext.metadata_upload.url
    required_taints: list[str] | None = None  # nvext.routing_constraints
    preferred_taints: dict[str, float] | None = None
    # headers: x-dynamo-request-id (a valid UUID, else a fresh uuid4) and x-dynamo-meta-* (name -> value)
    request_id: str | None = None
    metadata: dict[str, str] | None = None

    @property
    def priority_jump(self) -> float:
        """Seconds the router queue moves this request's arrival earlier (never negative)."""
        if self.priority is not None:
            return float(self.priority) if self.priority > 0 else 0.0
        ls = self.latency_sensitivity
        if ls is not None and ls > 0:
            return float(ls)
        return 0.0

    @property
    def queue_tier(self) -> int:
        """strict_priority as the queue's first key (unset = 0)."""
        return self.strict_priority or 0

    @property
    def pinned_worker_id(self) -> int | None:
        """The worker an aggregated (non-disaggregated) request must go to, if any.

        Aggregated serving uses ``backend_instance_id``; a body that names only
        ``decode_worker_id`` pins the decode (= only) phase too.
        """
        if self.backend_instance_id is not None:
            return self.backend_instance_id
        return self.decode_worker_id

    @property
    def pinned_dp_rank(self) -> int | None:
        return self.dp_rank

    @property
    def is_pinned(self) -> bool:
        return self.backend_instance_id is not None or self.decode_worker_id is not None


# ---------------------------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------------------------

H_WORKER = ("x-dynamo-worker-instance-id", "x-worker-instance-id")
H_PREFILL_WORKER = ("x-dynamo-prefill-instance-id", "x-prefill-instance-id")
H_DP_RANK = ("x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank")
H_PREFILL_DP_RANK = ("x-dynamo-prefill-dp-rank", "x-prefill-dp-rank")
H_PRIORITY = "x-dynamo-request-priority"
H_STRICT_PRIORITY = "x-dynamo-request-strict-priority"
H_TENANT = "x-tenant-id"

H_SESSION = "x-dynamo-session-id"
H_PARENT_SESSION = "x-dynamo-parent-session-id"
H_SESSION_FINAL = "x-dynamo-session-final"
# Coding-agent session headers, in the order the reference checks them:
# (root session header, child/sub-agent header, parent header, parent defaults to root for a child)
AGENT_SESSION_HEADERS: tuple[tuple[str, str | None, str | None, bool], ...] = (
    ("x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id", True),
    ("thread-id", None, "x-codex-parent-thread-id", False),  # Codex
    ("x-deepseek-harness-session-id", None, "x-deepseek-harness-parent-session-id", False),
    ("x-session-id", None, "x-parent-session-id", False),  # OpenCode
)

_ROUTING_HEADERS = frozenset(
    (*H_WORKER, *H_PREFILL_WORKER, *H_DP_RANK, *H_PREFILL_DP_RANK, H_PRIORITY, H_STRICT_PRIORITY, H_TENANT)
)
_SESSION_HEADERS = frozenset(
    [H_SESSION, H_PARENT_SESSION, H_SESSION_FINAL]
    + [h for group in AGENT_SESSION_HEADERS for h in group[:3] if h is not None]
)
H_REQUEST_ID = "x-dynamo-request-id"
# request metadata headers: x-dynamo-meta-<key> (prefix overridable with DYN_METADATA_HEADER)
META_PREFIX = (os.environ.get("DYN_METADATA_HEADER") or "x-dynamo-meta-").lower()
_META_PREFIX_B = META_PREFIX.encode("latin-1")
MAX_METADATA_ENTRIES = 64
MAX_METADATA_BYTES = 64 * 1024

KNOWN_HEADERS = _ROUTING_HEADERS | _SESSION_HEADERS | {H_REQUEST_ID}
_KNOWN_HEADERS_B = frozenset(h.encode() for h in KNOWN_HEADERS)

_TRUE = frozenset(("1", "true", "yes", "on", "t", "y"))
_FALSE = frozenset(("0", "false", "no", "off", "f", "n"))


def _collect_headers(headers: Any) -> dict[str, str]:
    """The headers we know, lower-cased names -> first value. One pass over the raw list."""
    found: dict[str, str] = {}
    if headers is None:
        return found
    raw = getattr(headers, "raw", None)
    if raw is not None:  # starlette Headers / MutableHeaders: list of (lowercase bytes, bytes)
        for name, value in raw:
            if name in _KNOWN_HEADERS_B or name.startswith(_META_PREFIX_B):
                key = name.decode("latin-1")
                if key not in found:
                    found[key] = value.decode("latin-1")
        return found
    items = headers.items() if hasattr(headers, "items") else headers
    for name, value in items:
        if isinstance(name, bytes):
            name = name.decode("latin-1")
        key = name.lower()
        if (key in KNOWN_HEADERS or key.startswith(META_PREFIX)) and key not in found:
            found[key] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return found


def _parse_uint(text: str | None, maximum: int) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit() or not text.isascii():  # rejects signs, blanks, "1.0", unicode digits
        return None
    value = int(text)
    return value if value <= maximum else None


def _parse_i32(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    body = text[1:] if text[:1] in ("-", "+") else text
    if not body.isdigit() or not body.isascii():
        return None
    value = int(text)
    return value if I32_MIN <= value <= I32_MAX else None


def _first(found: dict[str, str], names: tuple[str, ...], maximum: int) -> int | None:
    """Canonical name first, then the aliases; the first *present* header decides (as the
    reference's `headers.get(canonical).or_else(alias)`), so an unparsable canonical value is ignored."""
    for name in names:
        value = found.get(name)
        if value is not None:
            return _parse_uint(value, maximum)
    return None


def _header_value(found: dict[str, str], name: str | None) -> str | None:
    if name is None:
        return None
    value = found.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _request_id(text: str) -> str:
    """x-dynamo-request-id: the value if it parses as a UUID (canonical form), else a fresh UUID v4."""
    try:
        return str(uuid.UUID(text.strip()))
    except ValueError:
        return str(uuid.uuid4())


def _parse_bool(text: str | None) -> bool | None:
    if text is None:
        return None
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    return None


def session_from_headers(found: dict[str, str]) -> tuple[str | None, str | None, bool | None]:
    """(session_id, parent_session_id, session_final) from already-collected headers."""
    final = _parse_bool(found.get(H_SESSION_FINAL))
    sid = _header_value(found, H_SESSION)
    if sid is not None:
        parent = _header_value(found, H_PARENT_SESSION)
        return sid, (parent if parent != sid else None), final
    for root_h, child_h, parent_h, parent_defaults_to_root in AGENT_SESSION_HEADERS:
        root = _header_value(found, root_h)
        if root is None:
            continue
        sid = _header_value(found, child_h) or root
        parent = _header_value(found, parent_h)
        if parent == sid:
            parent = None
        if parent_defaults_to_root:
            # Claude Code: a sub-agent's parent is the named parent agent, else the root session;
            # the root session itself has no parent.
            parent = (parent or root) if sid != root else None
        return sid, parent, final
    return None, None, final


# ---------------------------------------------------------------------------------------------
# The parse
# ---------------------------------------------------------------------------------------------


def _decode_nvext(raw: Any) -> _NvExt | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, f"invalid nvext: expected an object, got {type(raw).__name__}")
    if not raw:
        return None
    try:
        ext = msgspec.convert(raw, _NvExt)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid nvext: {exc}") from None
    for name in ("backend_instance_id", "prefill_worker_id", "decode_worker_id"):
        value = getattr(ext, name)
        if value is not None and value > U64_MAX:
            raise ApiError(400, f"invalid nvext: Expected `int` <= {U64_MAX} - at `$.{name}`")
    if ext.metadata_upload is not None and not ext.metadata_upload.url.strip():
        raise ApiError(400, "invalid nvext: metadata_upload.url must not be empty")
    return ext


def parse_request_hints(body: dict, headers: Any, *, nvext_enabled: bool = True) -> RequestHints:
    """Pop ``nvext`` from ``body`` and merge it with the routing/session headers.

    ``headers`` is a starlette ``Headers`` (fast path over ``.raw``) or any mapping / list of pairs.
    ``nvext_enabled=False`` (``DYN_DISABLE_FRONTEND_NVEXT``) still strips ``nvext`` from the body but
    ignores it and the routing headers; session identity still comes from the headers.
    Raises ``ApiError(400)`` for an invalid ``nvext``. (Session id limits are enforced by the
    session-affinity table, only when affinity is on.)
    """
    raw_nvext = body.pop("nvext", None) if body else None
    found = _collect_headers(headers)
    if not found and (raw_nvext is None or not nvext_enabled):
        return RequestHints()
    ext = _decode_nvext(raw_nvext) if nvext_enabled else None

    hints = RequestHints()
    if ext is not None:
        hints.backend_instance_id = ext.backend_instance_id
        hints.prefill_worker_id = ext.prefill_worker_id
        hints.decode_worker_id = ext.decode_worker_id
        hints.dp_rank = ext.dp_rank
        hints.prefill_dp_rank = ext.prefill_dp_rank if ext.prefill_dp_rank != U32_MAX else None
        hints.cache_salt = ext.cache_salt or None
        hints.token_data = ext.token_data
        hints.greed_sampling = ext.greed_sampling
        hints.use_raw_prompt = ext.use_raw_prompt
        hints.annotations = ext.annotations
        hints.max_thinking_tokens = ext.max_thinking_tokens
        hints.request_timestamp_ms = ext.request_timestamp_ms
        if ext.extra_fields:
            hints.extra_fields = ext.extra_fields
            hints.want_worker_id = "worker_id" in ext.extra_fields
            hints.want_timing = "timing" in ext.extra_fields
            hints.want_stop_reason = "stop_reason" in ext.extra_fields
        if ext.metadata_upload is not None:
            hints.metadata_upload = ext.metadata_upload.url
        rc = ext.routing_constraints
        if rc is not None:
            hints.required_taints = list(rc.required_taints) or None
            hints.preferred_taints = dict(rc.preferred_taints) or None
        if ext.annotations and any(a.startswith("query_instance_id:") for a in ext.annotations):
            hints.want_worker_id = True
        ah = ext.agent_hints
        if ah is not None:
            hints.priority = ah.priority
            hints.strict_priority = ah.strict_priority
            hints.osl = ah.osl
            hints.speculative_prefill = bool(ah.speculative_prefill)
            hints.latency_sensitivity = ah.latency_sensitivity

    if found:
        if nvext_enabled:
            worker = _first(found, H_WORKER, U64_MAX)
            if worker is not None:
                hints.backend_instance_id = worker
                hints.decode_worker_id = worker
            prefill = _first(found, H_PREFILL_WORKER, U64_MAX)
            if prefill is not None:
                hints.prefill_worker_id = prefill
            rank = _first(found, H_DP_RANK, U32_MAX)
            if rank is not None:
                hints.dp_rank = rank
            prank = _first(found, H_PREFILL_DP_RANK, U32_MAX)
            if prank is not None and prank != U32_MAX:
                hints.prefill_dp_rank = prank
            prio = _parse_i32(found.get(H_PRIORITY))
            if prio is not None:
                hints.priority = prio
            strict = _parse_uint(found.get(H_STRICT_PRIORITY), U32_MAX)
            if strict is not None:
                hints.strict_priority = strict
            tenant = found.get(H_TENANT)
            if tenant:
                hints.cache_salt = tenant
        if H_REQUEST_ID in found:
            hints.request_id = _request_id(found[H_REQUEST_ID])
        meta = {
            k[len(META_PREFIX) :]: v
            for k, v in found.items()
            if k.startswith(META_PREFIX) and len(k) > len(META_PREFIX)
        }
        if meta:
            if len(meta) > MAX_METADATA_ENTRIES:
                raise ApiError(400, f"too many {META_PREFIX}* headers: {len(meta)} (at most {MAX_METADATA_ENTRIES})")
            size = sum(len(k) + len(v) for k, v in meta.items())
            if size > MAX_METADATA_BYTES:
                raise ApiError(400, f"{META_PREFIX}* headers carry {size} bytes (at most {MAX_METADATA_BYTES})")
            hints.metadata = meta
        sid, parent, final = session_from_headers(found)
        hints.session_id = sid
        hints.parent_session_id = parent
        hints.session_final = final
    return hints


# ---------------------------------------------------------------------------------------------
# Fields the frontend honours (on the request body) or refuses (400): none is silently ignored
# ---------------------------------------------------------------------------------------------

# extra_fields items the document lists that the engines behind kvroute cannot produce over the
# OpenAI API (other unknown items are ignored, as the reference does)
UNSUPPORTED_EXTRA_FIELDS = {
    "routed_experts": "the engines' OpenAI API reports no expert routing",
    "engine_data": "the engines' OpenAI API returns no engine data",
    "completion_token_ids": "the engines' OpenAI API returns text, not output token ids",
    "prompt_logprobs": "use the engine's own prompt_logprobs request field",
}
SUPPORTED_ANNOTATIONS = ("formatted_prompt", "token_ids")


def check_supported(hints: RequestHints, chat: bool, stream: bool) -> None:
    """Raise ApiError(400) for nvext fields this frontend cannot honour for this request."""

    def refuse(message: str) -> None:
        raise ApiError(400, f"unsupported nvext: {message}")

    if hints.use_raw_prompt and chat:
        refuse(
            "use_raw_prompt applies to /v1/completions (whose prompts are never templated); on /v1/chat/completions "
            "the engine renders its chat template, send the raw text to /v1/completions instead"
        )
    if hints.max_thinking_tokens is not None:
        refuse("max_thinking_tokens: the engines' OpenAI API takes no thinking budget")
    if hints.metadata_upload is not None:
        refuse("metadata_upload: no out-of-band metadata upload in kvroute")
    if hints.preferred_taints:
        refuse("routing_constraints.preferred_taints: workers carry no taints in kvroute")
    if hints.required_taints:
        refuse("routing_constraints.required_taints: workers carry no taints in kvroute")
    for item in hints.extra_fields:
        why = UNSUPPORTED_EXTRA_FIELDS.get(item)
        if why is not None:
            refuse(f"extra_fields {item!r}: {why}")
    for a in hints.annotations or ():
        if a.startswith("query_instance_id:"):
            refuse(
                "annotation query_instance_id: kvroute routes and dispatches in one step; POST /admin/route "
                "answers the decision for a body without sending it"
            )
        if a not in SUPPORTED_ANNOTATIONS:
            refuse(f"unknown annotation {a!r} (supported: {', '.join(SUPPORTED_ANNOTATIONS)})")
        if not stream:
            refuse(f"annotation {a!r} is sent as a server-sent event: it needs stream=true")


def worker_headers(headers: list[tuple[str, str]], hints: RequestHints) -> list[tuple[str, str]]:
    """The client's x-dynamo-request-id becomes the worker request's ``x-request-id`` (vLLM's request id
    header); x-dynamo-meta-* headers are passed on to the worker unchanged."""
    if hints.request_id:
        headers = [(k, v) for k, v in headers if k != "x-request-id"] + [("x-request-id", hints.request_id)]
    if hints.metadata:
        headers = headers + [(META_PREFIX + k, v) for k, v in hints.metadata.items()]
    return headers


def apply_to_body(hints: RequestHints, body: dict) -> bool:
    """Body changes the hints ask for; True when the body changed (greed_sampling = greedy decoding)."""
    if hints.greed_sampling:
        body["temperature"] = 0.0
        body.pop("top_p", None)
        body.pop("top_k", None)
        return True
    return False


def annotation_events(hints: RequestHints, formatted_prompt: str | None, token_ids: list[int]) -> bytes:
    """The requested annotations as SSE events sent before the first chunk: ``event: <name>`` with the
    JSON value as a comment line, the way the reference's SSE encoder writes annotated events."""
    import orjson

    out = []
    for a in hints.annotations or ():
        if a == "formatted_prompt":
            out.append(b"event: formatted_prompt\n:" + orjson.dumps(formatted_prompt) + b"\n\n")
        elif a == "token_ids":
            out.append(b"event: token_ids\n:" + orjson.dumps(token_ids) + b"\n\n")
    return b"".join(out)


# ---------------------------------------------------------------------------------------------
# Engine priority
# ---------------------------------------------------------------------------------------------

# Backends whose engine schedules *lower* priority values first (vLLM's --scheduling-policy priority).
LOWER_IS_HIGHER_BACKENDS = frozenset(("vllm", "mocker", "trtllm"))


def engine_priority(hints: RequestHints, backend: str = "vllm") -> int | None:
    """The value to send as the engine request's ``priority`` field, or None to send nothing.

    Dynamo's ``priority`` means "higher = more important"; vLLM schedules smaller values first, so
    for vLLM-style engines (and our mocker, which speaks vLLM's API) the sign is flipped. SGLang's
    default (higher first) gets the value unchanged. ``latency_sensitivity`` only moves the router
    queue; it is never forwarded.
    """
    p = hints.priority
    if p is None:
        return None
    if backend in LOWER_IS_HIGHER_BACKENDS:
        return -p
    return p


# ---------------------------------------------------------------------------------------------
# Response nvext
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestTiming:
    """Timestamps the frontend records for one request (monotonic seconds, plus wall-clock arrival).

    Set ``dispatched`` when the request is booked on a worker (after any router-queue wait),
    ``first_token`` on the first streamed token, ``finished`` when the response ends.
    """

    received: float = field(default_factory=time.monotonic)
    received_wall_ms: float = field(default_factory=lambda: time.time() * 1000.0)
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    kv_hit_rate: float | None = None  # overlap_blocks / ceil(isl / block_size) at routing time
    router_queue_depth: int | None = None  # queue depth seen when this request arrived

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"request_received_ms": round(self.received_wall_ms)}
        r = self.received
        if self.dispatched is not None:
            out["prefill_wait_time_ms"] = (self.dispatched - r) * 1000.0
            if self.first_token is not None:
                out["prefill_time_ms"] = (self.first_token - self.dispatched) * 1000.0
        if self.first_token is not None:
            out["ttft_ms"] = (self.first_token - r) * 1000.0
        if self.finished is not None:
            out["total_time_ms"] = (self.finished - r) * 1000.0
        if self.kv_hit_rate is not None:
            out["kv_hit_rate"] = self.kv_hit_rate
        if self.router_queue_depth is not None:
            out["router_queue_depth"] = self.router_queue_depth
        return out


def kv_hit_rate(overlap_blocks: int, isl_tokens: int, block_size: int) -> float:
    """overlap_blocks / ceil(isl / block_size); 0.0 for an empty prompt."""
    total = -(-isl_tokens // block_size) if isl_tokens > 0 else 0
    return min(1.0, overlap_blocks / total) if total else 0.0


def response_nvext(
    hints: RequestHints,
    worker_id: int | None,
    dp_rank: int | None,
    timing: RequestTiming | None = None,
    prefill: tuple[int, int] | None = None,
    stop_reason: Any = None,
) -> dict | None:
    """The response's ``nvext`` object, or None when nothing requested is available.

    ``worker_id`` (aggregated serving: the same worker is prefill and decode worker; disaggregated:
    ``prefill`` = the prefill worker's (id, rank)) when the request asked for it; ``timing`` only
    when asked for AND passed: pass it only with the piece that carries the ``finish_reason``
    (non-streaming body, or the final stream chunk).
    """
    out: dict | None = None
    if hints.want_worker_id and worker_id is not None:
        pw, pr = prefill if prefill is not None else (worker_id, dp_rank)
        info: dict[str, int] = {"prefill_worker_id": pw}
        if pr is not None:
            info["prefill_dp_rank"] = pr
        info["decode_worker_id"] = worker_id
        if dp_rank is not None:
            info["decode_dp_rank"] = dp_rank
        out = {"worker_id": info}
    if hints.want_timing and timing is not None:
        if out is None:
            out = {}
        out["timing"] = timing.as_dict()
    if hints.want_stop_reason and stop_reason is not None:
        if out is None:
            out = {}
        out["stop_reason"] = stop_reason
    return out
