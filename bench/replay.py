"""Trace replay: send a fixed schedule of requests to a frontend and measure routing quality.

For each router mode the same schedule (same seed, same arrival times, same tokens) is replayed
against freshly started, cold workers (or once against an already running frontend with ``--url``).
Per mode it reports TTFT and end-to-end latency percentiles, throughput, and the prompt-token cache
hit rate read from the workers' ``/metrics`` (``vllm:prefix_cache_hits / vllm:prefix_cache_queries``
deltas, the same counters a real vLLM exposes), next to the trace's oracle: the best hit rate any
router could reach with infinite caches.

The client is open-loop (requests go out at their scheduled time, not when earlier ones finish),
bounded by a maximum number of requests in flight and a maximum run time. TTFT is measured from the
moment a request is sent; time spent waiting for a free concurrency slot is reported separately.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.synthetic import SyntheticConfig, synthetic_trace
from bench.traces import (
    DEFAULT_TRACES_DIR,
    MOONCAKE_TRACES,
    Oracle,
    Scaling,
    Trace,
    distinct_blocks,
    find_trace,
    load_mooncake,
    oracle,
    pooled_lru_hits,
)
from kvroute_common.local_cluster import DEFAULT_MODEL, MockerOptions, start_cluster

MODES = ("latency", "kv", "round_robin", "random")
DEFAULT_MODES = ("latency", "kv", "round_robin")  # random: --modes ...,random (always the worst; it costs a run)
# The reference's default overlap weight (1.0) lets the load term (every active request's KV blocks)
# move a conversation off the worker holding its history; prefix-heavy workloads raise it.
DEFAULT_VARIANTS = ("kv-w4=kv,--router-kv-overlap-score-weight=4",)
# Trace time replayed per Mooncake trace when --window is not given: synthetic_trace whole (17 min,
# the README's 64 % reuse), conversation_trace its first 10 minutes (the whole hour would take 6 min/mode).
DEFAULT_WINDOWS = {"conversation": 600.0, "mooncake_synthetic": 0.0}
DEFAULT_WINDOW = 600.0
# Per-worker KV blocks when --num-gpu-blocks is not given. The built-in generator keeps 6144 (its
# working set fits). Mooncake traces get "auto": all workers' caches together hold the scaled
# schedule's distinct blocks, so what is lost to eviction is the router's doing (duplicating prefixes
# across workers), not a cache too small for any router. Mocker blocks are bookkeeping, not memory.
SYNTHETIC_GPU_BLOCKS = 6144
AUTO_BLOCKS_ROUND = 1024
HIT_METRIC = "vllm:prefix_cache_hits"
QUERY_METRIC = "vllm:prefix_cache_queries"


@dataclass(slots=True)
class RequestResult:
    index: int
    scheduled_s: float
    slot_wait_s: float = 0.0  # waiting for a free concurrency slot (client side)
    sent: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_chunks: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None


# -- one request ----------------------------------------------------------------------------------
async def send_one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    tokens: list[int],
    max_tokens: int,
    result: RequestResult,
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> None:
    """Streamed completion of a token-id prompt (or of ``text``, or a chat of ``messages``); records TTFT,
    latency and the usage's cached tokens. A chat stream's role-only first chunk is not a token (the
    mocker sends it at once, vLLM with the first token), so TTFT is the first chunk with content."""
    path, prompt = (
        ("chat/completions", {"messages": messages}) if messages else ("completions", {"prompt": text or tokens})
    )
    body = {
        "model": model,
        **prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{url}/v1/{path}", content=orjson.dumps(body), headers={"content-type": "application/json"}
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")[:300]
                result.error = f"HTTP {resp.status_code}: {text}"
                return
            done = False
            async for line in resp.aiter_lines():  # to the stream's end, so the connection is kept alive
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                if _ROLE_ONLY.search(data):
                    continue
                if '"usage"' in data and not _NULL_USAGE.search(data):  # only the usage chunk is decoded
                    if not _read_usage(data, result):
                        continue  # the usage-only chunk (no choices) is not a token
                if messages and '"role"' in data and _role_only(data):
                    continue  # a chat stream's opening role delta (sent before the prefill) is not a token
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                result.output_chunks += 1
        result.e2e_s = time.perf_counter() - start
        if result.ttft_s is None:
            result.error = "no token streamed"
    except (httpx.HTTPError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]


_NULL_USAGE = re.compile(r'"usage"\s*:\s*null')
_ROLE_ONLY = re.compile(r'"delta"\s*:\s*\{\s*"role"\s*:\s*"assistant"\s*,\s*"content"\s*:\s*""\s*\}')


def _role_only(data: str) -> bool:
    """A chat chunk whose deltas carry the role and no generated text (the stream's first chunk)."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    deltas = [c.get("delta") or {} for c in chunk.get("choices") or []]
    return bool(deltas) and not any(
        d.get("content") or d.get("tool_calls") or d.get("reasoning_content") for d in deltas
    )


def _read_usage(data: str, result: RequestResult) -> bool:
    """Record the chunk's usage; returns whether the chunk also carries choices (a token)."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return True
    usage = chunk.get("usage") or {}
    with contextlib.suppress(TypeError, ValueError):
        result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])
    return bool(chunk.get("choices"))


# -- the schedule -----------------------------------------------------------------------------------
async def run_schedule(
    url: str,
    trace: Trace,
    model: str = DEFAULT_MODEL,
    max_concurrency: int = 64,
    max_duration_s: float = 300.0,
    request_timeout_s: float = 120.0,
    label: str = "",
    progress: Callable[[str], None] | None = print,
    progress_every_s: float = 5.0,
    fail_fast_errors: int = 20,
) -> tuple[list[RequestResult], float]:
    """Replay ``trace`` open-loop; returns per-request results and the wall time used.

    Requests not sent before ``max_duration_s`` are recorded with error "not sent (time limit)";
    requests still running at the limit are cancelled and recorded as "cancelled (time limit)".
    If the first ``fail_fast_errors`` finished requests all failed, the replay stops early.
    """
    sem = asyncio.Semaphore(max_concurrency)
    results = [RequestResult(r.index, r.arrival_s, prompt_tokens=len(r.tokens)) for r in trace.requests]
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    t0 = time.perf_counter()
    done = 0
    succeeded, aborted = asyncio.Event(), asyncio.Event()

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(req, res: RequestResult) -> None:
            nonlocal done
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            waited = time.perf_counter()
            async with sem:
                res.slot_wait_s = time.perf_counter() - waited
                res.sent = True
                await send_one(client, url, model, req.tokens, req.max_tokens, res, req.text, req.messages)
            done += 1
            if res.ok:
                succeeded.set()
            elif not succeeded.is_set() and sum(1 for r in results if r.error) >= fail_fast_errors:
                aborted.set()  # nothing works: stop now instead of waiting out the time limit

        tasks = [asyncio.create_task(one(req, res)) for req, res in zip(trace.requests, results, strict=True)]
        reporter = (
            asyncio.create_task(_report(lambda: done, results, len(tasks), t0, label, progress, progress_every_s))
            if progress
            else None
        )
        all_done = asyncio.ensure_future(asyncio.wait(tasks))
        abort_wait = asyncio.ensure_future(aborted.wait())
        await asyncio.wait([all_done, abort_wait], timeout=max_duration_s, return_when=asyncio.FIRST_COMPLETED)
        abort_wait.cancel()
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if reporter:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
    wall = time.perf_counter() - t0
    why = "aborted" if aborted.is_set() else "time limit"
    for res in results:
        if res.e2e_s is None and res.error is None:
            res.error = f"cancelled ({why})" if res.sent else f"not sent ({why})"
    if aborted.is_set() and progress:
        progress(
            f"[{label}] aborted: the first {fail_fast_errors} finished requests all failed, "
            f"e.g. {next(r.error for r in results if r.error)}"
        )
    if progress:
        errors = sum(1 for r in results if not r.ok)
        progress(
            f"[{label}] finished {len(results) - errors}/{len(results)} requests in {wall:.1f} s "
            f"({errors} failed or unsent)"
        )
    return results, wall


async def _report(done: Callable[[], int], results, total: int, t0: float, label: str, progress, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        errors = sum(1 for r in results if r.error)
        progress(f"[{label}] t={time.perf_counter() - t0:5.1f}s  done {done()}/{total}  errors {errors}")


# -- engine counters -----------------------------------------------------------------------------------
def read_counter(text: str, name: str) -> float | None:
    """Sum of a Prometheus counter over all label sets (``name`` or ``name_total``); None if absent."""
    total = None
    wanted = {name, name + "_total"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                total = (total or 0.0) + float(sample.value)
    return total


def scrape_cache_counters(metrics_urls: Sequence[str]) -> dict[str, tuple[float, float] | None]:
    """(prefix_cache_queries, prefix_cache_hits) per worker metrics URL; None when unreadable."""
    out: dict[str, tuple[float, float] | None] = {}
    for url in metrics_urls:
        try:
            text = httpx.get(url, timeout=5.0).text
            q, h = read_counter(text, QUERY_METRIC), read_counter(text, HIT_METRIC)
            out[url] = (q, h) if q is not None and h is not None else None
        except httpx.HTTPError:
            out[url] = None
    return out


def cache_delta(before: dict, after: dict) -> dict | None:
    queries = hits = 0.0
    per_worker = {}
    for url, b in before.items():
        a = after.get(url)
        if a is None or b is None:
            return None
        dq, dh = a[0] - b[0], a[1] - b[1]
        per_worker[url] = {"queries": dq, "hits": dh}
        queries += dq
        hits += dh
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None, "per_worker": per_worker}


# -- statistics ------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    cached = [r for r in ok if r.cached_tokens is not None]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
            examples.setdefault(key, r.error or "unknown")
    ms = lambda v: None if v is None else round(v * 1000.0, 1)  # noqa: E731
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": errors,
        "error_examples": examples,
        "wall_s": round(wall_s, 2),
        "ttft_ms": {f"p{p}": ms(percentile(ttft, p)) for p in (50, 90, 99)},
        "ttft_mean_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
        "e2e_ms": {f"p{p}": ms(percentile(e2e, p)) for p in (50, 90, 99)},
        "mean_slot_wait_ms": ms(sum(r.slot_wait_s for r in ok) / len(ok)) if ok else None,
        "throughput_rps": round(len(ok) / wall_s, 2) if wall_s > 0 else None,
        "output_tok_per_s": round(sum(r.output_chunks for r in ok) / wall_s, 1) if wall_s > 0 else None,
        "prompt_tok_per_s": round(sum(r.prompt_tokens for r in ok) / wall_s, 1) if wall_s > 0 else None,
        "usage_cached_share": round(
            sum(r.cached_tokens or 0 for r in cached) / max(1, sum(r.prompt_tokens for r in cached)), 4
        )
        if cached
        else None,
    }


# -- one mode, one trace --------------------------------------------------------------------------
@dataclass(slots=True)
class RunOptions:
    workers: int = 3
    mocker: MockerOptions | None = None
    max_concurrency: int = 64
    max_duration_s: float = 240.0
    request_timeout_s: float = 120.0
    frontend_args: tuple[str, ...] = ()
    log_dir: str | None = None
    model: str = DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """A row of the comparison: a router mode, optionally with extra frontend flags (a tuned variant)."""

    label: str
    router_mode: str
    frontend_args: tuple[str, ...] = ()
    prefill_workers: int = 0  # disaggregated: this many of the workers are prefill-role, the rest decode-role

    @classmethod
    def parse_variant(cls, text: str) -> ModeSpec:
        """``LABEL=MODE[,FLAG...][,prefill=N]``, e.g. ``kv-w4=kv,--router-kv-overlap-score-weight=4`` or
        ``kv-disagg=kv,prefill=2`` (2 prefill + the rest decode workers)."""
        label, sep, rest = text.partition("=")
        parts = [p.strip() for p in rest.split(",") if p.strip()]
        if not sep or not label.strip() or not parts:
            raise ValueError(f"variant {text!r}: expected LABEL=MODE[,FLAG...]")
        mode = parts[0].replace("-", "_")
        if mode not in MODES:
            raise ValueError(f"variant {text!r}: unknown router mode {parts[0]!r} (choose from {', '.join(MODES)})")
        prefill = [p for p in parts[1:] if p.startswith("prefill=")]
        flags = tuple(p for p in parts[1:] if not p.startswith("prefill="))
        n = int(prefill[-1].split("=", 1)[1]) if prefill else 0
        if n < 0:
            raise ValueError(f"variant {text!r}: prefill=N needs N >= 0")
        return cls(label.strip(), mode, flags, n)


def replay_mode(trace: Trace, mode: str | ModeSpec, opts: RunOptions, progress=print) -> dict:
    """Fresh cluster in ``mode``, replay, read counters, stop everything."""
    spec = mode if isinstance(mode, ModeSpec) else ModeSpec(mode, mode)
    mocker = opts.mocker or MockerOptions()
    t_start = time.perf_counter()
    log_dir = os.path.join(opts.log_dir, f"{trace.name}-{spec.label}") if opts.log_dir else None
    frontend_args = (*opts.frontend_args, *spec.frontend_args)
    if spec.prefill_workers and not 0 < spec.prefill_workers < opts.workers:
        raise RuntimeError(
            f"{spec.label}: prefill={spec.prefill_workers} needs at least one decode worker of {opts.workers}"
        )
    cluster = start_cluster(
        opts.workers,
        mocker,
        router_mode=spec.router_mode,
        frontend_args=frontend_args,
        log_dir=log_dir,
        prefill_workers=spec.prefill_workers,
    )
    try:
        if progress:
            progress(
                f"[{spec.label}] {opts.workers} cold workers + frontend ready in "
                f"{time.perf_counter() - t_start:.1f} s (logs: {cluster.log_dir})"
            )
        assert cluster.frontend_url is not None
        metrics_urls = [w.metrics_url for w in cluster.workers]
        summary = measure(trace, cluster.frontend_url, spec.label, metrics_urls, opts, progress, cluster.check_alive)
    finally:
        cluster.stop()
    summary["router_mode"] = spec.router_mode
    summary["frontend_args"] = list(frontend_args)
    if spec.prefill_workers:
        summary["prefill_workers"] = spec.prefill_workers
    return summary


def replay_mode_or_failure(trace: Trace, spec: ModeSpec, opts: RunOptions, progress=print) -> dict:
    """``replay_mode``, but a mode that cannot run becomes a failed row instead of losing the others."""
    try:
        return replay_mode(trace, spec, opts, progress)
    except (RuntimeError, TimeoutError, OSError) as exc:
        if progress:
            progress(f"[{spec.label}] run failed: {exc}")
        return failed_row(trace, spec, exc)


def failed_row(trace: Trace, spec: ModeSpec, exc: BaseException) -> dict:
    """The row of a mode that could not run: every request failed with the reason (the table keeps it)."""
    row = summarize([RequestResult(r.index, r.arrival_s, error=f"run failed: {exc}") for r in trace.requests], 0.0)
    row.update(
        {
            "mode": spec.label,
            "router_mode": spec.router_mode,
            "frontend_args": list(spec.frontend_args),
            "cache": None,
            "hit_rate": None,
        }
    )
    row["requests"] = len(trace.requests)
    return row


def measure(
    trace: Trace,
    url: str,
    label: str,
    metrics_urls: Sequence[str],
    opts: RunOptions,
    progress: Callable[[str], None] | None = print,
    settle: Callable[[], None] | None = None,
) -> dict:
    """Replay ``trace`` through the frontend at ``url`` between two reads of the workers' cache counters.

    The measurement every setup shares (mockers per mode, an external frontend, real vLLM engines);
    ``settle`` runs between the replay and the second read (check the workers, wait for them to idle).
    """
    before = scrape_cache_counters(metrics_urls)
    results, wall = asyncio.run(
        run_schedule(
            url, trace, opts.model, opts.max_concurrency, opts.max_duration_s, opts.request_timeout_s, label, progress
        )
    )
    if settle is not None:
        settle()
    after = scrape_cache_counters(metrics_urls)
    summary = summarize(results, wall)
    summary["mode"] = label
    summary["cache"] = cache_delta(before, after) if metrics_urls else None
    summary["hit_rate"] = summary["cache"]["hit_rate"] if summary["cache"] else None
    return summary


def replay_url(
    trace: Trace, url: str, label: str, metrics_urls: Sequence[str], opts: RunOptions, progress=print
) -> dict:
    """One replay against an already running frontend (its router mode is whatever it was started with)."""
    return measure(trace, url, label, metrics_urls, opts, progress)


# -- reporting --------------------------------------------------------------------------------------
def verdict(report: dict) -> list[str]:
    """Plain statements of where the cache-aware rows meet the goals and where they do not.

    kv rows (default and tuned): >= 90 % of the oracle and <= 0.5x round_robin's TTFT p50 (the first
    goal). latency rows (the goals set for latency mode): >= 95 % of the oracle, <= 0.45x round_robin's TTFT p50, and a
    lower TTFT p90 than every kv row of the same run."""
    lines = []
    rows = report["modes"]
    rr = next((m for m in rows if m.get("router_mode", m["mode"]) == "round_robin"), None)
    orc = report["oracle"]["token_share"]
    kv_rows = [m for m in rows if m.get("router_mode", m["mode"]) == "kv"]
    for row in [m for m in rows if m.get("router_mode", m["mode"]) in ("kv", "latency")]:
        latency = row.get("router_mode", row["mode"]) == "latency"
        hit_goal, ttft_goal = (0.95, 0.45) if latency else (0.9, 0.5)
        parts = []
        if row.get("hit_rate") is not None and orc:
            share = row["hit_rate"] / orc
            parts.append(
                f"hit rate {row['hit_rate']:.1%} = {share:.0%} of the oracle {orc:.1%} "
                f"(goal >= {hit_goal:.0%}: {'met' if share >= hit_goal else 'NOT met'})"
            )
        if rr and row["ttft_ms"]["p50"] and rr["ttft_ms"]["p50"]:
            ratio = row["ttft_ms"]["p50"] / rr["ttft_ms"]["p50"]
            parts.append(
                f"TTFT p50 = {ratio:.2f} x round_robin's "
                f"(goal <= {ttft_goal:g}: {'met' if ratio <= ttft_goal else 'NOT met'})"
            )
        if latency and kv_rows and row["ttft_ms"]["p90"]:
            p90s = {k["mode"]: k["ttft_ms"]["p90"] for k in kv_rows if k["ttft_ms"]["p90"]}
            best = min(p90s.values(), default=None)
            if best:
                ok = row["ttft_ms"]["p90"] < best
                parts.append(
                    f"TTFT p90 {row['ttft_ms']['p90']:g} ms vs best kv {best:g} ms "
                    f"({row['ttft_ms']['p90'] / best:.2f}x; goal < every kv weight: {'met' if ok else 'NOT met'})"
                )
        pooled = report.get("pooled_lru")
        if pooled and pooled.get("token_share") and row.get("hit_rate") is not None:
            parts.append(
                f"{row['hit_rate'] / pooled['token_share']:.0%} of the pooled-LRU estimate {pooled['token_share']:.1%}"
            )
        if parts:
            lines.append(f"{row['mode']}: " + "; ".join(parts))
    for m in rows:
        if m["completed"] < m["requests"]:
            example = next(iter(m.get("error_examples", {}).values()), "")[:160]
            lines.append(
                f"{m['mode']}: {m['requests'] - m['completed']} of {m['requests']} requests failed or were not sent: "
                f"{m['errors']} (e.g. {example})"
            )
    return lines


def fmt(v, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if unit == "%":
        return f"{v * 100:.1f} %"
    return f"{v:g}{unit}"


def markdown_table(report: dict) -> str:
    orc = report["oracle"]
    rows = [
        "| mode | TTFT p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (ms) | req/s | out tok/s "
        "| cache hit rate (workers' /metrics) | of oracle | completed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in report["modes"]:
        t, e = m["ttft_ms"], m["e2e_ms"]
        hit = m.get("hit_rate")
        of = f"{hit / orc['token_share']:.0%}" if hit is not None and orc["token_share"] else "n/a"
        rows.append(
            f"| {m['mode']} | {fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} "
            f"| {fmt(e['p50'])} / {fmt(e['p90'])} / {fmt(e['p99'])} "
            f"| {fmt(m['throughput_rps'])} | {fmt(m['output_tok_per_s'])} | {fmt(hit, '%')} | {of} "
            f"| {m['completed']}/{m['requests']} |"
        )
    pooled = report.get("pooled_lru")
    if pooled:
        rows.append(
            f"| pooled LRU ({pooled['capacity_blocks']} blocks = all workers' caches as one) | | | | "
            f"| {fmt(pooled['token_share'], '%')} of prompt tokens "
            f"| {pooled['token_share'] / orc['token_share']:.0%} | |"
            if orc["token_share"]
            else "| pooled LRU | | | | | n/a | | |"
        )
    rows.append(
        f"| oracle (infinite shared cache) | | | | | {fmt(orc['token_share'], '%')} of prompt tokens "
        f"({fmt(orc['block_share'], '%')} of full blocks) | 100% | |"
    )
    return "\n".join(rows)


def markdown_report(report: dict) -> str:
    s = report["trace"]
    lines = [
        f"### Trace `{report['trace']['name']}`",
        "",
        f"- Workload: {report['scaling'].get('description', '')}",
        f"- Schedule: {s['requests']} requests over {s['span_s']} s ({s['rate_rps']} req/s), "
        f"mean prompt {s['mean_prompt_tokens']} tokens "
        f"(max {s['max_prompt_tokens']}), mean output {s['mean_output_tokens']} tokens",
        f"- Workers: {report['setup']}",
        f"- Command: `{report['command']}`",
        "",
        markdown_table(report),
        "",
    ]
    for m in report["modes"]:
        if m.get("frontend_args"):
            lines.append(f"- `{m['mode']}` = router mode {m['router_mode']} with `{' '.join(m['frontend_args'])}`")
        if m.get("prefill_workers"):
            lines.append(
                f"- `{m['mode']}` = disaggregated: {m['prefill_workers']} prefill-role workers (prefill router) "
                "and the rest decode-role; the hit rate counts only local prefix hits "
                "(transferred prompts are not hits)"
            )
    lines += [f"- {v}" for v in report.get("verdict", [])]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: str, stem: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, f"{stem}.json"),
        "md": os.path.join(out_dir, f"{stem}.md"),
        "png": os.path.join(out_dir, f"{stem}.png"),
    }
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown_report(report))
    from bench.plot import plot_report  # matplotlib only when writing

    plot_report(report, paths["png"])
    return paths


# -- CLI ----------------------------------------------------------------------------------------------
def build_trace(name: str, args: argparse.Namespace) -> Trace:
    if name == "synthetic":
        cfg = SyntheticConfig(
            seed=args.seed, sessions=args.sessions, turns=args.turns, system_prompts=args.system_prompts,
            system_tokens=args.system_tokens, user_tokens=args.user_tokens, reply_tokens=args.reply_tokens,
            output_tokens=args.output_tokens, start_window_s=args.start_window, think_s=args.think_time,
            think_min_s=args.think_min,
        )  # fmt: skip
        return synthetic_trace(cfg)
    path = find_trace(name, args.traces_dir) if name in MOONCAKE_TRACES else name
    if path is None or not os.path.exists(path):
        where = os.path.join(args.traces_dir, MOONCAKE_TRACES[name]) + "[.gz]" if name in MOONCAKE_TRACES else name
        raise SystemExit(
            f"trace {name!r}: no such file {where!r} "
            f"(use --traces-dir or a path; built-ins: synthetic, {', '.join(MOONCAKE_TRACES)})"
        )
    stem = name if name in MOONCAKE_TRACES else os.path.basename(path).removesuffix(".gz").removesuffix(".jsonl")
    window = args.window if args.window is not None else DEFAULT_WINDOWS.get(name, DEFAULT_WINDOW)
    scaling = Scaling(
        start_s=args.start, window_s=window if window > 0 else None, rate_scale=args.rate_scale,
        tokens_per_block=args.tokens_per_block, max_prompt_tokens=args.max_prompt_tokens or None,
        output_scale=args.output_scale, max_output_tokens=args.max_output_tokens,
        max_requests=args.max_requests or None,
    )  # fmt: skip
    return load_mooncake(path, scaling, seed=args.seed, name=stem)


def gpu_blocks_for(trace: Trace, args: argparse.Namespace) -> int:
    """KV blocks per worker rank: as given, or sized from the schedule (see SYNTHETIC_GPU_BLOCKS)."""
    if str(args.num_gpu_blocks) != "auto":
        try:
            return int(args.num_gpu_blocks)
        except ValueError:
            raise SystemExit(f"--num-gpu-blocks: expected an integer or 'auto', got {args.num_gpu_blocks!r}") from None
    if trace.scaling.get("kind") != "mooncake":
        return SYNTHETIC_GPU_BLOCKS
    ranks = max(1, args.workers * args.data_parallel_size)
    per_rank = math.ceil(distinct_blocks([r.tokens for r in trace.requests], args.block_size) / ranks)
    return max(AUTO_BLOCKS_ROUND, math.ceil(per_rank / AUTO_BLOCKS_ROUND) * AUTO_BLOCKS_ROUND)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench replay",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--trace",
        default="synthetic",
        help=f"comma-separated: synthetic, {', '.join(MOONCAKE_TRACES)} or a Mooncake JSONL path",
    )
    p.add_argument(
        "--traces-dir",
        default=DEFAULT_TRACES_DIR,
        help="where the Mooncake traces are (.jsonl or .jsonl.gz; default: the copies vendored in bench/data/)",
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"router modes to compare (each on fresh workers), from {', '.join(MODES)}",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="LABEL=MODE[,FLAG...]",
        help="an extra row: a router mode with extra frontend flags "
        f"(repeat; default: {DEFAULT_VARIANTS[0]}; 'none' for no variant)",
    )
    p.add_argument(
        "--url", help="replay against this running frontend instead of starting one (one run, labelled --label)"
    )
    p.add_argument("--label", default="external", help="mode label for --url")
    p.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="with --url: a worker /metrics URL to read cache counters from (repeat)",
    )
    p.add_argument(
        "--out-dir", default="bench/out", help="where the JSON, markdown, PNG and logs go (bench/out/ is git-ignored)"
    )
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("client")
    g.add_argument("--max-concurrency", type=int, default=64)
    g.add_argument(
        "--max-duration", type=float, default=240.0, help="seconds per mode before outstanding requests are cancelled"
    )
    g.add_argument("--request-timeout", type=float, default=120.0)
    g = p.add_argument_group("workers (when the benchmark starts them)")
    g.add_argument("--workers", type=int, default=4)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--num-gpu-blocks",
        default="auto",
        help=f"KV blocks per worker rank; auto = {SYNTHETIC_GPU_BLOCKS} for the built-in generator, "
        "for Mooncake traces the scaled schedule's distinct blocks / (workers x DP), rounded up to a multiple of 1024",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--data-parallel-size", type=int, default=1)
    g.add_argument(
        "--speedup-ratio",
        default="0.5",
        help="engine speed (mocker speedup ratio); comma-separated for several load levels in one run, e.g. 0.5,0.35 "
        "(lower = slower engines = heavier load; outputs then named <trace>-s<ratio>, plus summary.md/.png)",
    )
    g.add_argument(
        "--frontend-arg",
        action="append",
        default=[],
        help="extra frontend flag (repeat), e.g. --frontend-arg=--router-temperature=0.1",
    )
    g = p.add_argument_group("Mooncake scaling")
    g.add_argument("--start", type=float, default=0.0, help="trace time (s) where the replayed window starts")
    g.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds of trace time replayed (0 = all); default: "
        f"{', '.join(f'{k} {v:g}' for k, v in DEFAULT_WINDOWS.items())}, others {DEFAULT_WINDOW:g}",
    )
    g.add_argument("--rate-scale", type=float, default=10.0, help="replay the window this many times faster")
    g.add_argument("--tokens-per-block", type=int, default=64, help="tokens generated per 512-token trace block")
    g.add_argument("--max-prompt-tokens", type=int, default=8192)
    g.add_argument("--output-scale", type=float, default=0.05)
    g.add_argument("--max-output-tokens", type=int, default=8)
    g.add_argument("--max-requests", type=int, default=0)
    add_synthetic_args(p, SyntheticConfig())
    return p


def add_synthetic_args(p: argparse.ArgumentParser, d: SyntheticConfig) -> None:
    """The built-in generator's flags (read back by ``build_trace``), with ``d``'s values as defaults:
    shared with the real-engine benchmark, which needs a smaller workload than the mockers."""
    g = p.add_argument_group("synthetic multi-turn generator")
    g.add_argument("--sessions", type=int, default=d.sessions)
    g.add_argument("--turns", type=int, default=d.turns)
    g.add_argument("--system-prompts", type=int, default=d.system_prompts)
    g.add_argument("--system-tokens", type=int, default=d.system_tokens)
    g.add_argument("--user-tokens", type=int, default=d.user_tokens)
    g.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    g.add_argument("--output-tokens", type=int, default=d.output_tokens)
    g.add_argument("--start-window", type=float, default=d.start_window_s)
    g.add_argument("--think-time", type=float, default=d.think_s, help="mean exponential part of the gap between turns")
    g.add_argument("--think-min", type=float, default=d.think_min_s, help="minimum gap between a session's turns")


def parse_loads(text: str) -> list[float]:
    """``--speedup-ratio 0.5,0.35``: one or more engine speeds (lower = slower engines = heavier load)."""
    try:
        loads = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--speedup-ratio: expected numbers separated by commas, got {text!r}") from None
    if not loads or any(v < 0 for v in loads):
        raise SystemExit(f"--speedup-ratio: expected one or more values >= 0, got {text!r}")
    return loads


def mode_rows(
    modes_text: str, variant_args: Sequence[str] | None, default_variants: Sequence[str] = DEFAULT_VARIANTS
) -> list[ModeSpec]:
    """The rows of a comparison: ``--modes`` in order, each ``--variant`` right after its base mode.

    ``variant_args`` None (no ``--variant`` given): ``default_variants``, kept only next to a base mode
    that runs; ``--variant none`` drops them. Errors exit with the reason.
    """
    modes: list[ModeSpec] = []
    for m in [m.strip().replace("-", "_") for m in modes_text.split(",") if m.strip()]:
        if m not in MODES:
            raise SystemExit(f"unknown router mode {m!r} (choose from {', '.join(MODES)})")
        modes.append(ModeSpec(m, m))
    variants = default_variants if variant_args is None else [v for v in variant_args if v.lower() != "none"]
    try:
        extra = [ModeSpec.parse_variant(v) for v in variants]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if variant_args is None:  # default variants only next to a base mode that runs
        extra = [v for v in extra if any(m.router_mode == v.router_mode for m in modes)]
    for v in extra:  # a variant sits right after its base mode
        at = max((i for i, m in enumerate(modes) if m.router_mode == v.router_mode), default=len(modes) - 1)
        modes.insert(at + 1, v)
    return modes


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    loads = parse_loads(args.speedup_ratio)
    modes = mode_rows(args.modes, args.variant)
    mocker = MockerOptions(
        block_size=args.block_size, num_gpu_blocks=SYNTHETIC_GPU_BLOCKS, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, dp_size=args.data_parallel_size,
        speedup_ratio=loads[0], seed=args.seed,
    )  # fmt: skip
    opts = RunOptions(
        workers=args.workers, mocker=mocker, max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout, frontend_args=tuple(args.frontend_arg),
        log_dir=os.path.join(args.out_dir, "logs"),
    )  # fmt: skip
    command = "python -m bench replay " + " ".join(argv if argv is not None else sys.argv[1:])
    reports: list[dict] = []
    for name in [t.strip() for t in args.trace.split(",") if t.strip()]:
        trace = build_trace(name, args)
        orc: Oracle = oracle([r.tokens for r in trace.requests], args.block_size)
        print(f"== trace {trace.name}: {trace.summary()}")
        print(f"   scaling: {trace.scaling.get('description')}")
        print(
            f"   oracle at block size {args.block_size}: {orc.token_share:.1%} of prompt tokens, "
            f"{orc.block_share:.1%} of full blocks"
        )
        pooled = None
        blocks = gpu_blocks_for(trace, args)
        if not args.url:
            print(
                f"   KV blocks per worker rank: {blocks} ({'given' if str(args.num_gpu_blocks) != 'auto' else 'auto'})"
            )
            capacity = args.workers * args.data_parallel_size * blocks
            pooled = {
                "capacity_blocks": capacity,
                **pooled_lru_hits([r.tokens for r in trace.requests], args.block_size, capacity).as_dict(),
            }
            print(
                f"   one pooled LRU cache of all workers' {capacity} blocks would reach "
                f"{pooled['token_share']:.1%} of prompt tokens"
            )
        for speed in loads if not args.url else loads[:1]:
            mode_opts = replace(opts, mocker=replace(mocker, num_gpu_blocks=blocks, speedup_ratio=speed))
            if len(loads) > 1:
                print(
                    f"-- {trace.name} at speedup ratio {speed:g} "
                    f"(load level {loads.index(speed) + 1} of {len(loads)}), {load_avg()}"
                )
            if args.url:
                results = [replay_url(trace, args.url.rstrip("/"), args.label, args.metrics_url, mode_opts)]
                setup = f"external frontend {args.url}"
            else:
                results = [replay_mode_or_failure(trace, mode, mode_opts) for mode in modes]
                setup = (
                    f"{args.workers} mockers x DP {args.data_parallel_size}, block size {args.block_size}, "
                    f"{blocks} KV blocks per rank, max_num_seqs {args.max_num_seqs}, "
                    f"max_num_batched_tokens {args.max_num_batched_tokens}, speedup {speed:g}; "
                    f"fresh (cold) workers and frontend per mode; client max concurrency {args.max_concurrency}"
                )
            report = {
                "trace": trace.summary(),
                "scaling": trace.scaling,
                "oracle": orc.as_dict(),
                "pooled_lru": pooled,
                "setup": setup,
                "speedup_ratio": speed,
                "command": command,
                "seed": args.seed,
                "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "load_after": load_avg()},
                "modes": results,
            }
            report["verdict"] = verdict(report)
            stem = trace.name if len(loads) == 1 else f"{trace.name}-s{speed:g}"
            paths = write_outputs(report, args.out_dir, stem)
            reports.append(report)
            print()
            print(markdown_report(report))
            print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    if len(reports) > 1:
        paths = write_summary(reports, args.out_dir)
        print(summary_table(reports))
        print(f"wrote {paths['md']}, {paths['png']}")
    return 0


def load_avg() -> str:
    """The machine's load average (the benchmarks share it with other work; stated with each result)."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average n/a"
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def summary_table(reports: Sequence[dict]) -> str:
    """One row per (trace, load): every mode's hit rate as a share of the oracle and its TTFT p50 / p90,
    with the ratio of p50 to round_robin's."""
    labels: list[str] = []
    for r in reports:
        for m in r["modes"]:
            if m["mode"] not in labels:
                labels.append(m["mode"])
    head = (
        "| trace | speedup | oracle | "
        + " | ".join(f"{label}: of oracle, TTFT p50 / p90 ms (p50 vs rr)" for label in labels)
        + " |"
    )
    rows = [head, "| " + " | ".join(["---"] * (3 + len(labels))) + " |"]
    for r in reports:
        by = {m["mode"]: m for m in r["modes"]}
        rr = next((m for m in r["modes"] if m.get("router_mode") == "round_robin"), None)
        orc = r["oracle"]["token_share"]
        cells = []
        for label in labels:
            m = by.get(label)
            if m is None or not m["ttft_ms"]["p50"]:
                cells.append("n/a")
                continue
            share = f"{m['hit_rate'] / orc:.0%}" if m.get("hit_rate") is not None and orc else "n/a"
            ratio = f" ({m['ttft_ms']['p50'] / rr['ttft_ms']['p50']:.2f}x)" if rr and rr["ttft_ms"]["p50"] else ""
            cells.append(f"{share}, {fmt(m['ttft_ms']['p50'])} / {fmt(m['ttft_ms']['p90'])}{ratio}")
        rows.append(
            f"| {r['trace']['name']} | {r.get('speedup_ratio', 'n/a')} | {orc:.1%} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


def write_summary(reports: Sequence[dict], out_dir: str) -> dict[str, str]:
    """summary.md (the side-by-side table and every run's verdict) and summary.png (one panel pair per run)."""
    paths = {
        "md": os.path.join(out_dir, "summary.md"),
        "png": os.path.join(out_dir, "summary.png"),
        "json": os.path.join(out_dir, "summary.json"),
    }
    lines = ["# Replay summary", "", f"Command: `{reports[0]['command']}`", "", summary_table(reports), ""]
    for r in reports:
        lines.append(f"- {r['trace']['name']} at speedup {r.get('speedup_ratio')}: " + "; ".join(r.get("verdict", [])))
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(list(reports), f, indent=2)
    from bench.plot import plot_summary

    plot_summary(list(reports), paths["png"])
    return paths


def write_report(stem: str, report: dict, text: str) -> None:
    """A run's report as ``stem.json`` and its markdown as ``stem.md``, printed with where they went."""
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print()
    print(text)
    print(f"wrote {stem}.md, {stem}.json ({report['total_s']:.0f} s)", flush=True)
