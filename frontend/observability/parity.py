"""Hash-parity alarm: does a worker cache the blocks the router hashes?

KV routing silently becomes load balancing when the router's block hashes differ from the ones a
worker's cache is keyed by (another tokenizer or chat template, block size, LoRA, cache salt). For
every routed request on a worker with KV events, two kinds of evidence are collected:

* **events**: once a request the router predicted no overlap for is done, the router's block hashes
  of its prompt must be in the indexer for that (worker, rank), because the worker stored them at
  prefill. Found = match. Not
  found although the worker stored (or sent blocks of another size) since dispatch = mismatch.
  Nothing stored at all = no evidence. A miss is re-checked after ``grace`` seconds (events race
  the response).
* **usage**: the engine's ``usage.prompt_tokens_details.cached_tokens``. A predicted overlap > 0
  is itself a match (the worker's events carried our hashes); the engine reporting a cached block
  the router predicted none of is a (weak) mismatch; ``cached_tokens`` that is not a multiple of
  the block size points at the block size. ``usage.prompt_tokens`` different from the router's
  count points at the tokenizer / chat template (recorded as a cause, not as block evidence).

A worker is in alarm when its last ``window`` pieces of evidence hold at least ``min_mismatches``
mismatches and no match: a cold cache or the first request gives no evidence, an eviction or a
lagging event stream gives a stray mismatch that the next match outweighs.

Exported: ``kvroute_hash_parity_mismatch{worker}`` (gauge 0/1, the alarm) and
``kvroute_hash_parity_checks_total{worker,source,result}``; a warning log line with the likely
cause when the alarm rises; the state in ``/admin/workers`` (``hash_parity``).

Streams: the engine is asked for usage (``stream_options.include_usage``); when the client did not
ask for it, the usage event and the ``"usage":null`` fields are stripped from what the client gets.

Sampled: after the first ``ParityMonitor.WARMUP_REQUESTS`` requests, one in ``--parity-sample-every``
collects evidence (default 8). Asking for and stripping a stream's usage, and the checks at its end,
cost ~5 % of the frontend's CPU a request; the alarm needs a window of evidence per worker and the
decomposition is read as ratios, which a sample serves as well.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from frontend.observability.decomposition import HitRateDecomposition
from frontend.observability.loop_metrics import LoopCounter, LoopGauge

if TYPE_CHECKING:
    from frontend.dispatch.lifecycle import Lease
    from frontend.routing.decision import Decision
    from frontend.routing.models import ModelEntry

log = logging.getLogger("frontend.observability.parity")

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_USAGE_KEY = b'"prompt_tokens"'  # only a usage object has it (a quote inside content is escaped)
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null')

MATCH, MISMATCH = True, False


# ---------------------------------------------------------------------------------------------
# usage on the wire
# ---------------------------------------------------------------------------------------------


def parse_usage(data: bytes) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from a response body or SSE event (None when absent)."""
    i = data.rfind(b'"usage"')
    if i < 0:
        return None, None
    tail = data[i:]
    p = _PROMPT.search(tail)
    c = _CACHED.search(tail)
    return (int(p.group(1)) if p else None), (int(c.group(1)) if c else None)


_USAGE_SPLICE = b'{"stream_options":{"include_usage":true},'  # spliced before an unchanged body's first field


def stream_body_with_usage(body: dict, raw: bytes | None) -> tuple[bytes | None, bool]:
    """For a streamed request: ``(body to send, strip)`` asking the engine for usage.

    ``None`` body = send as planned (the client asked for usage itself, or its stream_options are
    not an object and the engine will answer the 400). ``strip``: remove usage from the client's
    stream. With ``raw`` (the body was not otherwise rewritten) the field is spliced into the raw
    bytes instead of serialising the whole body again.
    """
    opts = body.get("stream_options")
    if opts is None:
        if raw is not None:
            i = raw.find(b"{")
            if i >= 0 and raw[i + 1 :].lstrip()[:1] not in (b"}", b""):
                return _USAGE_SPLICE + raw[i + 1 :], True
        body["stream_options"] = {"include_usage": True}
        return None, True
    if not isinstance(opts, dict) or opts.get("include_usage"):
        return None, False
    opts["include_usage"] = True
    return None, True


def _event_end(data: bytes, pos: int) -> int:
    """Index just past the end of the SSE event containing ``pos`` (``len(data)`` if it has none)."""
    a = data.find(b"\n\n", pos)
    b = data.find(b"\n\r\n", pos)
    ends = [e for e in (a + 2 if a >= 0 else -1, b + 3 if b >= 0 else -1) if e >= 0]
    return min(ends) if ends else len(data)


def _last_event_end(data: bytes) -> int:
    """Index just past the last complete SSE event (0 when there is none)."""
    a = data.rfind(b"\n\n")
    b = data.rfind(b"\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0)


class UsageTap:
    """Sits in a stream's path: reads the engine's usage event and, if asked, strips it.

    Works on whole SSE events (``\n\n`` or ``\r\n\r\n`` ends one): a partial trailing event is
    held until its end arrives (a client cannot use half an event anyway), never more than
    ``MAX_HELD`` bytes (then it is passed on as it is, so a stream never stalls here)."""

    __slots__ = ("strip", "probe", "_held", "key", "parse")

    MAX_HELD = 1 << 16

    def __init__(
        self,
        probe: RequestProbe | None,
        strip: bool,
        key: bytes = _USAGE_KEY,
        parse: Callable[[bytes], tuple[int | None, int | None]] = parse_usage,
    ) -> None:
        self.probe = probe
        self.strip = strip
        self.key = key  # what only a usage object contains (Anthropic streams: b'"input_tokens"')
        self.parse = parse  # -> (prompt_tokens, cached_tokens)
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        if not (chunk.endswith(b"\n\n") or chunk.endswith(b"\n\r\n")):
            end = _last_event_end(chunk)
            if end == 0:
                if len(chunk) < self.MAX_HELD:
                    self._held = chunk
                    return b""
                return chunk
            self._held = chunk[end:]
            chunk = chunk[:end]
        i = chunk.find(self.key)
        while i >= 0:  # every usage in the chunk, the last one counts (Anthropic: message_start, message_delta)
            start = chunk.rfind(b"data:", 0, i)
            start = 0 if start < 0 else start
            end = _event_end(chunk, i)
            prompt, cached = self.parse(chunk[start:end])
            if self.probe is not None:
                self.probe.usage(prompt, cached)
            if self.strip and _EMPTY_CHOICES.search(chunk, start, end):  # a usage-only event
                chunk = chunk[:start] + chunk[end:]
                end = start
            i = chunk.find(self.key, end)
        if self.strip and b'"usage"' in chunk:
            chunk = _USAGE_NULL.sub(b"", chunk)
        return chunk

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


# ---------------------------------------------------------------------------------------------
# per request
# ---------------------------------------------------------------------------------------------


class RequestProbe:
    """One routed request's prediction, the engine's usage and the worker's event counters at
    dispatch; a lease hook, so the checks run when the request ends."""

    __slots__ = (
        "monitor",
        "entry",
        "decision",
        "listener",
        "stored_before",
        "rejected_before",
        "prompt_tokens",
        "cached_tokens",
        "checked",
    )

    def __init__(self, monitor: ParityMonitor, entry: ModelEntry, decision: Decision, listener: Any) -> None:
        self.monitor = monitor
        self.entry = entry
        self.decision = decision
        self.listener = listener  # the worker rank's KV-event listener, None = no event evidence
        if listener is not None:
            self.stored_before = listener.applier.blocks_applied
            self.rejected_before = listener.applier.blocks_block_size_mismatch
        else:
            self.stored_before = self.rejected_before = 0
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.checked = False

    def usage(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if cached_tokens is not None:
            self.cached_tokens = cached_tokens

    def usage_from_body(self, data: bytes) -> None:
        self.usage(*parse_usage(data))

    # lease hook interface
    def on_tokens(self, lease: Lease, n: int) -> None:
        pass

    def on_release(self, lease: Lease) -> None:
        if lease.status == "success" and not self.checked:
            self.checked = True
            self.monitor.finished(self)


# ---------------------------------------------------------------------------------------------
# per worker
# ---------------------------------------------------------------------------------------------


class WorkerParity:
    """The evidence window and likely-cause hints of one worker."""

    __slots__ = (
        "worker_id",
        "window",
        "alarm",
        "pending",
        "totals",
        "foreign_block_size",
        "cached_not_multiple",
        "prompt_len_mismatch",
        "stores_unmatched",
        "usage_unpredicted",
        "last_cause",
        "last_kind",
        "gauge",
        "render",
        "render_cause",
        "checks",
    )

    def __init__(self, worker_id: int, window: int, gauge: Any) -> None:
        self.worker_id = worker_id
        self.checks: dict[tuple[str, str], Any] = {}  # (source, result) -> its checks_total child
        self.window: deque[bool] = deque(maxlen=window)
        self.alarm = False
        self.pending = 0  # event re-checks scheduled
        self.totals = {"match": 0, "mismatch": 0}
        self.foreign_block_size: int | None = None  # block size of rejected event blocks
        self.cached_not_multiple: int | None = None  # last cached_tokens that was not a block multiple
        self.prompt_len_mismatch: tuple[int, int] | None = None  # (router tokens, engine tokens), last seen
        self.stores_unmatched = 0
        self.usage_unpredicted = 0
        self.last_cause: str | None = None
        self.last_kind: str | None = None  # which kind of cause was last logged
        self.gauge = gauge
        self.render: dict[str, Any] | None = None  # the engine-rendering check (frontend/pool/render_parity.py)
        self.render_cause: str | None = None  # set while that check proves a tokenizer mismatch
        gauge.set(0)

    def cause_kind(self) -> str:
        if self.render_cause is not None:
            return "render"
        if self.foreign_block_size is not None:
            return "events_block_size"
        if self.cached_not_multiple is not None:
            return "cached_block_size"
        if self.prompt_len_mismatch is not None:
            return "prompt_tokens"
        return "stores" if self.stores_unmatched else "usage"

    def likely_cause(self, block_size: int) -> str:
        if self.render_cause is not None:
            return self.render_cause
        if self.foreign_block_size is not None:
            return (
                f"block size mismatch: the worker publishes {self.foreign_block_size}-token blocks, the router uses "
                f"{block_size} (set the worker's block_size / --kv-cache-block-size to the engine's)"
            )
        if self.cached_not_multiple is not None:
            return (
                f"block size mismatch: the engine reported {self.cached_not_multiple} cached tokens, not a multiple "
                "of the "
                f"router's block size {block_size}"
            )
        if self.prompt_len_mismatch is not None:
            mine, theirs = self.prompt_len_mismatch
            return (
                f"tokenizer or chat template mismatch: the router counted {mine} prompt tokens, the engine {theirs} "
                "(give --model-path the engine's model directory)"
            )
        if self.stores_unmatched:
            return (
                "tokenizer, chat template, LoRA or cache salt mismatch: the worker stores blocks but none match the "
                "router's hashes"
            )
        return (
            "the engine reports cached prefixes the router never predicted: its KV events are missing or hashed "
            "differently (tokenizer, chat template, block size, LoRA or salt)"
        )

    def describe(self) -> dict[str, Any]:
        w = self.window
        out: dict[str, Any] = {
            "mismatch": self.alarm,
            "window_matches": sum(1 for e in w if e),
            "window_mismatches": sum(1 for e in w if not e),
            "matches": self.totals["match"],
            "mismatches": self.totals["mismatch"],
        }
        if self.alarm:
            out["likely_cause"] = self.last_cause
        if self.prompt_len_mismatch is not None:
            out["prompt_tokens_router_vs_engine"] = list(self.prompt_len_mismatch)
        if self.foreign_block_size is not None:
            out["events_block_size"] = self.foreign_block_size
        if self.render is not None:
            out["render"] = self.render
        return out


class ParityMonitor:
    """Collects per-request evidence into per-worker alarms, and feeds the hit-rate decomposition."""

    def __init__(
        self,
        registry: CollectorRegistry,
        events: Any,
        window: int = 16,
        min_mismatches: int = 4,
        grace: float = 1.0,
        max_pending: int = 8,
        sample_every: int = 1,
    ) -> None:
        self.events = events  # callable -> the embedded IndexerRegistry or None
        self.sample_every = sample_every  # --parity-sample-every: evidence from one request in this many
        self._requests = 0  # requests asked ``sample`` so far
        self.window = window
        self.min_mismatches = min_mismatches
        self.grace = grace
        self.max_pending = max_pending
        self.decomposition = HitRateDecomposition(registry)
        self.alarm_gauge = LoopGauge(
            "kvroute_hash_parity_mismatch",
            "1 while the worker's cached blocks never match the router's hashes",
            ("worker",),
            registry=registry,
        )
        self.checks = LoopCounter(
            "kvroute_hash_parity_checks",
            "Hash-parity evidence per worker",
            ("worker", "source", "result"),
            registry=registry,
        )
        self.workers: dict[int, WorkerParity] = {}

    # -- request path

    WARMUP_REQUESTS = 64
    """The first requests after start-up all collect evidence, so a deployment's mismatch shows at once."""

    def sample(self) -> bool:
        """Whether a request collects evidence (the engine asked for its stream's usage, a probe at
        dispatch): each of the first ``WARMUP_REQUESTS``, then one in ``sample_every``. The rest are
        relayed as the client sent them, with no usage event asked of the engine and nothing read per chunk."""
        n = self._requests
        self._requests = n + 1
        return n < self.WARMUP_REQUESTS or n % self.sample_every == 0

    def begin(self, entry: ModelEntry, decision: Decision, lease: Lease) -> RequestProbe:
        """At dispatch: snapshot the worker's event counters and hook the request's end."""
        listener = None
        reg = self.events()
        if reg is not None and entry.approx is None:
            inst = reg.instances.get(decision.worker.id)
            if inst is not None:
                listener = inst.listeners.get(decision.dp_rank)
        probe = RequestProbe(self, entry, decision, listener)
        lease.hooks.append(probe)
        return probe

    def finished(self, probe: RequestProbe) -> None:
        d = probe.decision
        entry = probe.entry
        bs = entry.block_size
        cached = probe.cached_tokens
        if cached is not None:
            isl = d.isl
            self.decomposition.observe(
                entry.name, isl, min(d.available_blocks * bs, isl), min(d.overlap_blocks * bs, isl), cached
            )
        if probe.listener is None:
            return  # no KV events from this worker: its cache cannot disagree with the router's index
        wp = self._worker(d.worker.id)
        self._usage_evidence(wp, probe, bs)
        if d.local_hashes and not d.overlap_blocks:  # a predicted overlap already proved parity: no second lookup
            self._events_check(wp, probe, final=False)

    def _usage_evidence(self, wp: WorkerParity, probe: RequestProbe, bs: int) -> None:
        d = probe.decision
        wid = str(wp.worker_id)
        if probe.prompt_tokens is not None and d.isl and probe.prompt_tokens != d.isl:
            wp.prompt_len_mismatch = (d.isl, probe.prompt_tokens)
            self.checks.labels(wid, "prompt_tokens", "mismatch").inc()
        cached = probe.cached_tokens
        if d.overlap_blocks > 0:  # the worker's own events carried the router's hashes
            self._evidence(wp, "usage", MATCH, bs)
        elif cached is not None and cached >= bs:
            if cached % bs:
                wp.cached_not_multiple = cached
            wp.usage_unpredicted += 1
            self._evidence(wp, "usage", MISMATCH, bs)

    def _events_check(self, wp: WorkerParity, probe: RequestProbe, final: bool) -> None:
        d = probe.decision
        index = probe.entry.index
        listener = probe.listener
        if index is None or listener is None:
            return
        matched = index.find_matches(d.local_hashes).get((d.worker.id, d.dp_rank), 0)
        bs = probe.entry.block_size
        if matched > 0:
            self._evidence(wp, "events", MATCH, bs)
            return
        applier = listener.applier
        rejected = applier.blocks_block_size_mismatch - probe.rejected_before
        stored = applier.blocks_applied - probe.stored_before
        if not final:
            if wp.pending >= self.max_pending:
                return
            wp.pending += 1
            asyncio.get_running_loop().call_later(self.grace, self._recheck, wp, probe)
            return
        if rejected > 0:
            wp.foreign_block_size = applier.last_foreign_block_size
            self._evidence(wp, "events", MISMATCH, bs)
        elif stored > 0:
            wp.stores_unmatched += 1
            self._evidence(wp, "events", MISMATCH, bs)
        # nothing stored since dispatch: no evidence either way

    def _recheck(self, wp: WorkerParity, probe: RequestProbe) -> None:
        wp.pending -= 1
        if self.workers.get(wp.worker_id) is not wp:
            return  # the worker was forgotten meanwhile
        try:
            self._events_check(wp, probe, final=True)
        except Exception:  # never let a diagnostic break the loop
            log.exception("hash-parity re-check failed")

    # -- state

    def _worker(self, worker_id: int) -> WorkerParity:
        wp = self.workers.get(worker_id)
        if wp is None:
            wp = self.workers[worker_id] = WorkerParity(worker_id, self.window, self.alarm_gauge.labels(str(worker_id)))
        return wp

    def record(self, worker_id: int, source: str, matched: bool, block_size: int) -> bool:
        """One piece of evidence for ``worker_id``; returns the worker's alarm state after it."""
        wp = self._worker(worker_id)
        self._evidence(wp, source, matched, block_size)
        return wp.alarm

    def _evidence(self, wp: WorkerParity, source: str, result: bool, block_size: int) -> None:
        key = "match" if result else "mismatch"
        wp.totals[key] += 1
        counter = wp.checks.get((source, key))
        if counter is None:
            counter = wp.checks[(source, key)] = self.checks.labels(str(wp.worker_id), source, key)
        counter.inc()
        wp.window.append(result)
        self._update_alarm(wp, block_size)

    def _update_alarm(self, wp: WorkerParity, block_size: int) -> None:
        mismatches = sum(1 for e in wp.window if not e)
        alarm = (mismatches >= self.min_mismatches and mismatches == len(wp.window)) or wp.render_cause is not None
        if alarm and not wp.alarm:
            wp.last_cause = wp.likely_cause(block_size)
            wp.last_kind = wp.cause_kind()
            log.warning(
                "hash parity: worker %s's cached blocks never match the router's hashes (%d checks): likely %s",
                wp.worker_id,
                mismatches,
                wp.last_cause,
            )
        elif wp.alarm and not alarm:
            log.info("hash parity: worker %s matches the router's hashes again", wp.worker_id)
        elif alarm:
            wp.last_cause = wp.likely_cause(block_size)
            kind = wp.cause_kind()
            if kind != wp.last_kind:  # better evidence arrived (e.g. the events' block size): say it once
                wp.last_kind = kind
                log.warning("hash parity: worker %s: likely %s", wp.worker_id, wp.last_cause)
        if alarm != wp.alarm:
            wp.alarm = alarm
            wp.gauge.set(1 if alarm else 0)

    def render_checked(self, worker_id: int, check: Any, block_size: int) -> None:
        """The engine-rendering check of a worker that (re)joined (``render_parity.RenderCheck``): a
        mismatch raises the alarm at once and holds it until a later check matches."""
        wp = self._worker(worker_id)
        wp.render = check.describe()
        for result in check.probes.values():
            if result in ("match", "mismatch"):
                self.checks.labels(str(worker_id), "render", result).inc()
        wp.render_cause = check.cause() if check.status == "mismatch" else None
        self._update_alarm(wp, block_size)

    def forget(self, worker_id: int) -> None:
        """A removed worker: drop its state and series (a new process starts from no evidence)."""
        if self.workers.pop(worker_id, None) is not None:
            try:
                self.alarm_gauge.remove(str(worker_id))
            except KeyError:
                pass

    def describe(self, worker_id: int) -> dict[str, Any] | None:
        wp = self.workers.get(worker_id)
        return None if wp is None else wp.describe()
