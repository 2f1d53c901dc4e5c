"""The fleet testbed of ``bench peers`` (``--testbed fleet``): eight engines timed as H200s serving Qwen2.5-32B.

Eight mockers with ``--perf-profile h200-qwen2.5-32b`` (every prefill chunk by its new and cached tokens,
decodes by batch and context, measured on an H200) and KV caches as large as an H200 holds beside the
32B weights, slowed by ``--slowdown`` so the engines, the router and the client fit this 2-core machine:
every engine step takes ``slowdown`` times its H200 time, the client sends at ``1 / slowdown`` of the
workload's rate, and every time reported is divided by ``slowdown`` (the engines' simulated ms). The
router's own latency is divided by the same factor (it runs at real speed inside a slowed world, so the
TTFTs understate its share by ``slowdown``); its CPU per request is reported in real ms, unscaled.

Workloads (arrival times and rates in simulated seconds):

- ``shared-prefix``: llm-d's scenario for precise prefix-cache routing (its blog "KV-Cache Wins You Can
  See", 2025-09-24): 150 groups of 5 users, each group behind a 6,000-token system prompt, each user a
  1,200-token question, 1,000 output tokens, Poisson arrivals, the rate swept (llm-d: 3-60 QPS on 8 vLLM
  pods of 2 H100s with Qwen-32B, 307,328 KV tokens each; precise scheduling 8,730 output tokens/s against
  4,428.7 for random, TTFT p90 0.542 s against 92.6 s);
- ``conversation``: the Mooncake FAST'25 conversation trace (bench/data), its timing and 512-token block
  structure (each block id becomes fixed text), a window of it, the rate scaled;
- ``toolagent``: Mooncake's tool-agent trace, when ``bench/data/toolagent_trace.jsonl[.gz]`` is present;
- ``agentic``: kvroute's agentic sessions (bench/sessions.py) on seeds latency mode was not tuned on.

Method: each (workload, rate, router) cell is the median of ``--runs`` runs with the spread (min-max),
the routers' order rotated per run; TTFT p50 / p90 / p99; goodput = the highest swept rate at which the
median TTFT p90 stays under ``--slo-ms``; the engines' prefix-cache hit rate (their counters); the
router's CPU ms per request (its process tree). Engines are started once and their prefix caches reset
(and idle) before every run; every router starts fresh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import httpx
import numpy as np

from bench.peers import (
    BLOCK_SIZE,
    OWN_KINDS,
    READY_TIMEOUT,
    RECOMMENDED,
    RouterSpec,
    Testbed,
    failed,
    missing_reason,
    peer_versions,
    peers_bin,
    router_specs,
    run_router,
)
from bench.replay import RunOptions, fmt, load_avg
from bench.sessions import WORKLOADS, Words, session_trace
from bench.traces import (
    MOONCAKE_BLOCK_TOKENS,
    VENDORED_TRACES_DIR,
    Trace,
    TraceRequest,
    find_trace,
    oracle,
    read_mooncake,
)
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR, completion_prompt_token_ids, load_tokenizer
from mocker.gpu_profile import GpuProfile

PROFILE = "h200-qwen2.5-32b"
ENGINES = 8
SLOWDOWN = 2.0  # the eight engines, a router and the client fit 2 busy cores at this factor (the --quick run)
QUICK_SLOWDOWN = 2.0
SLO_MS = 2000.0  # TTFT p90 under this (simulated ms) counts toward goodput
MAX_OUTPUT_TOKENS = 64  # generated tokens per request at most (the client and router stream every one of them)
MAX_MODEL_LEN = 65536
FLEET_ROUTERS = ["kvroute-latency", "kvroute-kv", "smg-cache_aware", "smg-prefix_hash", "vllm-kv_aware",
                 "dynamo-select", "round_robin"]  # fmt: skip
AGENTIC_SEED = 101  # + --seed: latency mode's weights were tuned on seed 0


# -- workloads ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """llm-d's shared-prefix scenario: groups of users behind one long system prompt each."""

    groups: int = 150
    users_per_group: int = 5
    system_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 1000
    duration_s: float = 10.0  # simulated seconds of arrivals per run

    def describe(self, rate: float) -> str:
        return (
            f"{self.groups} groups x {self.users_per_group} users, {self.system_tokens}-token system prompt per "
            f"group, {self.question_tokens}-token question per user, {self.output_tokens} output tokens (capped at "
            f"{MAX_OUTPUT_TOKENS}); Poisson arrivals at {rate:g} QPS for {self.duration_s:g} s (simulated)"
        )

    def trace(self, rate: float, seed: int) -> Trace:
        tok = load_tokenizer(None)
        words = Words(tok, seed)
        rng = np.random.default_rng([seed, 112])
        systems = [words.about(rng, self.system_tokens) for _ in range(self.groups)]
        prompts = [
            f"{systems[g]}\n\nUser: {words.about(rng, self.question_tokens)}\n\nAssistant:"
            for g in range(self.groups)
            for _ in range(self.users_per_group)
        ]
        token_cache: dict[int, list[int]] = {}
        requests: list[TraceRequest] = []
        t = float(rng.exponential(1.0 / rate))
        while t < self.duration_s:
            k = int(rng.integers(len(prompts)))
            if k not in token_cache:
                token_cache[k] = completion_prompt_token_ids(tok, prompts[k])
            out = min(MAX_OUTPUT_TOKENS, self.output_tokens)
            requests.append(TraceRequest(len(requests), round(t, 6), token_cache[k], out, text=prompts[k]))
            t += float(rng.exponential(1.0 / rate))
        return Trace("shared-prefix", requests, {"kind": "shared-prefix", "description": self.describe(rate)})


def mooncake_text_trace(path: str, name: str, window_s: float, rate: float, seed: int, max_tokens: int) -> Trace:
    """A window of a Mooncake trace as text prompts: each 512-token block id becomes a fixed stretch of
    about 512 tokens of text (equal ids -> equal text, so the trace's prefix reuse survives in text and
    in tokens); arrivals ``rate`` times as dense; prompts cut to ``max_tokens`` whole blocks."""
    tok = load_tokenizer(None)
    words = Words(tok, seed)
    blocks: dict[int, str] = {}

    def block_text(hid: int) -> str:
        if hid not in blocks:
            blocks[hid] = words.about(np.random.default_rng([seed, hid, 512]), MOONCAKE_BLOCK_TOKENS) + " "
        return blocks[hid]

    rows = read_mooncake(path)
    t0 = rows[0]["timestamp"] if rows else 0.0
    requests: list[TraceRequest] = []
    for row in rows:
        at = (row["timestamp"] - t0) / 1000.0
        if at >= window_s:
            break
        ids = row["hash_ids"][: max(1, max_tokens // MOONCAKE_BLOCK_TOKENS)]
        text = "".join(block_text(h) for h in ids)
        out = min(MAX_OUTPUT_TOKENS, max(1, row["output_length"]))
        requests.append(
            TraceRequest(len(requests), round(at / rate, 6), completion_prompt_token_ids(tok, text), out, text=text)
        )
    desc = (
        f"Mooncake {name} trace, its first {window_s:g} s at {rate:g}x its rate, each 512-token block id -> fixed "
        f"text, prompts cut to {max_tokens} tokens of blocks, output tokens capped at {MAX_OUTPUT_TOKENS}"
    )
    return Trace(name, requests, {"kind": "mooncake-text", "description": desc})


@dataclass(frozen=True, slots=True)
class FleetWorkload:
    """A workload of the fleet: its rates (what the sweep varies) and how to build a run's schedule."""

    name: str
    rates: tuple[float, ...]
    quick_rates: tuple[float, ...]
    rate_unit: str
    build: Callable[[float, int, bool], Trace]  # (rate, seed, quick) -> schedule in simulated seconds
    available: Callable[[], str | None] = lambda: None  # a reason it cannot run, or None


# A run's arrivals last seconds, not llm-d's minutes: 24 groups (not 150) so that a group's users meet
# within a run, as they do over a long run with 150 groups
SHARED_PREFIX_QUICK = SharedPrefix(groups=24, duration_s=3.0)
SHARED_PREFIX_FULL = SharedPrefix(groups=24, duration_s=4.0)
TRACE_WINDOW_S = {True: 8.0, False: 4.0}  # quick, full: seconds of a Mooncake trace per run (at 1x)


def _shared_prefix(rate: float, seed: int, quick: bool) -> Trace:
    return (SHARED_PREFIX_QUICK if quick else SHARED_PREFIX_FULL).trace(rate, seed)


def _conversation(rate: float, seed: int, quick: bool) -> Trace:
    path = find_trace("conversation")
    assert path is not None
    return mooncake_text_trace(path, "conversation", TRACE_WINDOW_S[quick], rate, seed, 32768)


def _toolagent(rate: float, seed: int, quick: bool) -> Trace:
    path = find_trace("toolagent_trace.jsonl", VENDORED_TRACES_DIR)
    assert path is not None
    return mooncake_text_trace(path, "toolagent", TRACE_WINDOW_S[quick], rate, seed, 32768)


def _agentic(rate: float, seed: int, quick: bool) -> Trace:
    w = WORKLOADS["agentic"]
    w = (w.quick() if quick else w).at_load(rate)
    return session_trace(w, AGENTIC_SEED + seed)


WORKLOADS_FLEET: dict[str, FleetWorkload] = {
    w.name: w
    for w in (
        FleetWorkload("shared-prefix", (8.0, 16.0, 24.0), (12.0,), "QPS", _shared_prefix),
        FleetWorkload("conversation", (0.5, 1.0), (1.0,), "x trace rate", _conversation),
        FleetWorkload(
            "toolagent", (1.0, 2.0), (1.0,), "x trace rate", _toolagent,
            lambda: None if find_trace("toolagent_trace.jsonl", VENDORED_TRACES_DIR) else
            "bench/data/toolagent_trace.jsonl is not vendored (this machine could not retrieve it)",
        ),
        FleetWorkload("agentic", (8.0, 16.0), (3.0,), "x session load", _agentic),
    )
}  # fmt: skip


# -- the engines --------------------------------------------------------------------------------------
def engine_blocks(block_size: int = BLOCK_SIZE) -> int:
    """KV blocks per engine: what an H200 holds beside the 32B weights (the profile's figure)."""
    return GpuProfile.load(PROFILE).kv_capacity_tokens() // block_size + 1


def start_engines(args: argparse.Namespace, log_dir: str) -> Cluster:
    opts = MockerOptions(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=engine_blocks(),
        speedup_ratio=1.0 / args.slowdown,
        seed=args.seed,
        extra_args=["--perf-profile", PROFILE, "--max-model-len", str(MAX_MODEL_LEN)],
    )
    engines = Cluster(log_dir=log_dir)
    for _ in range(args.workers):
        engines.start_mocker(opts)
    engines.wait_workers_ready(READY_TIMEOUT)
    return engines


def reset_engines(engines: Cluster, timeout: float = 120.0) -> None:
    """Until every engine is idle and its prefix cache empty (a run's cancelled tail ends first)."""
    deadline = time.monotonic() + timeout
    for w in engines.workers:
        while True:
            engines.check_alive()
            r = httpx.post(f"{w.url}/reset_prefix_cache", timeout=10.0)
            if r.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{w.url}: prefix cache not reset: {r.status_code} {r.text[:200]}")
            time.sleep(0.05)


def scaled(trace: Trace, factor: float) -> Trace:
    """The schedule in real seconds: simulated arrivals times ``factor``."""
    reqs = [replace(r, arrival_s=round(r.arrival_s * factor, 6)) for r in trace.requests]
    return Trace(trace.name, reqs, trace.scaling)


# -- one run, one cell ----------------------------------------------------------------------------------
def run_once(trace: Trace, spec: RouterSpec, engines: Cluster, args: argparse.Namespace, tag: str) -> dict:
    """One router in front of the (reset) engines for one schedule; times in simulated ms."""
    t0 = time.perf_counter()
    reset_engines(engines)
    t_reset = time.perf_counter()
    router = Cluster(log_dir=os.path.join(args.out_dir, "logs", tag))
    router.workers = list(engines.workers)
    bed = Testbed(DEFAULT_MODEL, BUILTIN_TOKENIZER_DIR, None)
    opts = RunOptions(workers=args.workers, max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
                      request_timeout_s=args.request_timeout, model=DEFAULT_MODEL)  # fmt: skip
    try:
        row = run_router(scaled(trace, args.slowdown), spec, router, bed, opts, args.bin_dir, engines.check_alive)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
        row = failed(trace, spec, exc)
    finally:
        t_run = time.perf_counter()
        router.workers = []  # the engines are not this cluster's to stop
        stopping.stop(router)
    replay = float(row.get("wall_s") or 0.0)
    row["phases_s"] = {"reset": round(t_reset - t0, 2), "start": round(t_run - t_reset - replay, 2),
                       "replay": round(replay, 2)}  # fmt: skip
    for key in ("ttft_ms", "e2e_ms"):
        if isinstance(row.get(key), dict):
            row[key] = {p: (None if v is None else v / args.slowdown) for p, v in row[key].items()}
    return row


class Stopping:
    """Routers being stopped while the next run starts: SIGTERM, SIGKILL after ``grace`` s (some wait
    seconds for connections that are gone; nothing of theirs is read after their run). Everything
    measured of a router is read before it is stopped, and the next one runs on other ports."""

    def __init__(self, grace: float = 1.0) -> None:
        self.grace = grace
        self.threads: list[threading.Thread] = []

    def stop(self, cluster: Cluster) -> None:
        t = threading.Thread(target=cluster.stop, kwargs={"timeout": self.grace}, name="router-stop", daemon=True)
        t.start()
        self.threads = [x for x in self.threads if x.is_alive()] + [t]

    def join(self) -> None:
        for t in self.threads:
            t.join()
        self.threads = []


stopping = Stopping()


def median_spread(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return None, None, None
    return statistics.median(got), min(got), max(got)


def summarize_cell(label: str, runs: Sequence[dict]) -> dict:
    """A router's cell: medians over its runs with their spread."""

    def pick(get: Callable[[dict], float | None]) -> dict:
        med, lo, hi = median_spread([get(r) for r in runs])
        return {"median": med, "min": lo, "max": hi}

    return {
        "router": label,
        "kind": runs[0].get("kind"),
        "runs": len(runs),
        "errors": sum(r["requests"] - r["completed"] for r in runs),
        "ttft_p50": pick(lambda r: r["ttft_ms"]["p50"]),
        "ttft_p90": pick(lambda r: r["ttft_ms"]["p90"]),
        "ttft_p99": pick(lambda r: r["ttft_ms"]["p99"]),
        "hit_rate": pick(lambda r: r.get("hit_rate")),
        "router_cpu_ms_per_request": pick(lambda r: r.get("router_cpu_ms_per_request")),
    }


def run_workload(w: FleetWorkload, specs: Sequence[RouterSpec], engines: Cluster, args: argparse.Namespace) -> dict:
    rates = getattr(args, "rates", None) or (w.quick_rates if args.quick else w.rates)
    cells = []
    for rate in rates:
        trace = w.build(rate, args.seed, args.quick)
        orc = oracle([r.tokens for r in trace.requests], BLOCK_SIZE)
        print(f"== {w.name} at {rate:g} {w.rate_unit}: {trace.summary()} ({load_avg()})", flush=True)
        runs: dict[str, list[dict]] = {s.label: [] for s in specs}
        for k in range(args.runs):
            order = list(specs[k % len(specs) :]) + list(specs[: k % len(specs)])  # rotated per run
            for spec in order:
                tag = f"{w.name}-{rate:g}-{spec.label}-run{k + 1}"
                row = run_once(trace, spec, engines, args, tag)
                runs[spec.label].append(row)
                errors = row["requests"] - row["completed"]
                p90, hit = fmt(row["ttft_ms"]["p90"]), fmt(row.get("hit_rate"), "%")
                print(f"   run {k + 1} {spec.label}: TTFT p90 {p90} ms (sim), hit {hit}, errors {errors}; "
                      f"seconds {row['phases_s']}", flush=True)  # fmt: skip
        cells.append({
            "rate": rate,
            "trace": trace.summary(),
            "description": trace.scaling.get("description", ""),
            "oracle": orc.as_dict(),
            "routers": [summarize_cell(label, rows) for label, rows in runs.items()],
            "phases_s": [row["phases_s"] for rows in runs.values() for row in rows],
        })  # fmt: skip
    return {"workload": w.name, "rate_unit": w.rate_unit, "cells": cells, "goodput": goodput(cells, args.slo_ms)}


def goodput(cells: Sequence[dict], slo_ms: float) -> dict[str, float | None]:
    """Per router: the highest rate whose median TTFT p90 is under the SLO (None: not even the lowest)."""
    out: dict[str, float | None] = {}
    for cell in sorted(cells, key=lambda c: c["rate"]):
        for r in cell["routers"]:
            p90 = r["ttft_p90"]["median"]
            out.setdefault(r["router"], None)
            if p90 is not None and p90 <= slo_ms and not r["errors"]:
                out[r["router"]] = cell["rate"]
    return out


def overhead(workloads: Sequence[dict]) -> dict:
    """Seconds per run, averaged over every run: the engines' reset, the router's start until it serves
    (and the reads around the replay), the replay (arrivals and drain)."""
    phases = [p for wl in workloads for cell in wl.get("cells", ()) for p in cell.get("phases_s", ())]
    if not phases:
        return {"runs": 0}
    mean = {k: round(statistics.fmean(p[k] for p in phases), 2) for k in ("reset", "start", "replay")}
    return {"runs": len(phases), **mean}


# -- where the recommended mode stands ----------------------------------------------------------------
def behind(wl: dict, label: str = RECOMMENDED) -> list[str]:
    """Where ``label`` is behind another project's router or round robin (kvroute's other modes aside) in
    a workload: per cell, a higher median hit rate or a lower median TTFT p90 or p99; then a higher
    goodput. Routers with failed requests are not compared."""
    lost = []
    for cell in wl.get("cells", ()):
        rows = {r["router"]: r for r in cell["routers"]}
        ours = rows.get(label)
        if ours is None:
            return [f"{label} did not run"]
        where = f"{cell['rate']:g} {wl['rate_unit']}"
        for r in cell["routers"]:
            if r["router"].startswith("kvroute") or r["errors"]:
                continue
            theirs_hit, our_hit = r["hit_rate"]["median"], ours["hit_rate"]["median"]
            if theirs_hit is not None and our_hit is not None and theirs_hit > our_hit:
                lost.append(f"{where}: hit rate to {r['router']} ({theirs_hit:.1%} vs {our_hit:.1%})")
            for p in ("p90", "p99"):
                theirs, mine = r[f"ttft_{p}"]["median"], ours[f"ttft_{p}"]["median"]
                if theirs is not None and mine is not None and theirs < mine:
                    lost.append(f"{where}: TTFT {p} to {r['router']} ({theirs:,.0f} vs {mine:,.0f} ms)")
    gp = wl.get("goodput", {})
    mine_gp = gp.get(label)
    for router, theirs_gp in gp.items():
        if router.startswith("kvroute") or theirs_gp is None:
            continue
        if mine_gp is None or theirs_gp > mine_gp:
            ours_s = "< lowest" if mine_gp is None else f"{mine_gp:g}"
            lost.append(f"goodput to {router} ({theirs_gp:g} vs {ours_s} {wl['rate_unit']})")
    return lost


def goodput_gain(wl: dict, label: str = RECOMMENDED, base: str = "round_robin") -> str:
    """``label``'s goodput over ``base``'s, as the sweep resolves it."""
    gp = wl.get("goodput", {})
    mine, theirs = gp.get(label), gp.get(base)
    rates = sorted(c["rate"] for c in wl.get("cells", ()))
    if not rates or label not in gp or base not in gp:
        return "n/a"
    if mine is None and theirs is None:
        return f"neither met the SLO at the lowest rate ({rates[0]:g} {wl['rate_unit']})"
    if theirs is None:
        return f"{mine:g} against < {rates[0]:g} {wl['rate_unit']} (round robin met the SLO at no swept rate)"
    if mine is None:
        return f"< {rates[0]:g} against {theirs:g} {wl['rate_unit']}"
    more = " or more (the highest swept rate)" if mine == rates[-1] else ""
    return f"{mine:g} against {theirs:g} {wl['rate_unit']}: {mine / theirs - 1:+.0%}{more}"


# -- report -------------------------------------------------------------------------------------------
def _ms(d: dict, digits: int = 0) -> str:
    """median (min-max), ms to ``digits`` decimals."""
    if d["median"] is None:
        return "n/a"
    return f"{d['median']:,.{digits}f} ({d['min']:,.{digits}f}-{d['max']:,.{digits}f})"


def markdown(report: dict) -> str:
    lines = [f"## Fleet: {report['engines']}", "", f"- Command: `{report['command']}`",
             f"- Peers: {report['peers']}", f"- Machine: {report['machine']}",
             f"- SLO for goodput: TTFT p90 <= {report['slo_ms']:g} ms (simulated); median of {report['runs']} run(s) "
             "per cell, spread (min-max) in brackets, router order rotated per run"]  # fmt: skip
    over = report.get("overhead") or {}
    if over.get("runs"):
        lines.append(
            f"- Real seconds per run (mean of {over['runs']}): engines' reset {over['reset']:g}, router start "
            f"until it serves (and the reads around the replay) {over['start']:g}, replay {over['replay']:g}"
        )
    lines.append("")
    for wl in report["workloads"]:
        if wl.get("skipped"):
            lines += [f"### {wl['workload']}: not run ({wl['skipped']})", ""]
            continue
        lines += [f"### {wl['workload']}", ""]
        for cell in wl["cells"]:
            orc = cell["oracle"]["token_share"]
            lines += [f"{cell['rate']:g} {wl['rate_unit']}: {cell['description']}; {cell['trace']['requests']} "
                      f"requests; oracle hit rate {fmt(orc, '%')}", "",
                      "| router | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | hit rate | router CPU ms / req | errors |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
            for r in cell["routers"]:
                hit = r["hit_rate"]
                hit_s = (f"{fmt(hit['median'], '%')} ({hit['min']:.1%}-{hit['max']:.1%})"
                         if hit["median"] is not None else "n/a")  # fmt: skip
                lines.append(f"| {r['router']} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p90'])} | {_ms(r['ttft_p99'])} "
                             f"| {hit_s} | {_ms(r['router_cpu_ms_per_request'], 1)} | {r['errors']} |")  # fmt: skip
            lines.append("")
        gp = wl["goodput"]
        lines.append("Goodput (highest rate with TTFT p90 under the SLO): " + ", ".join(
            f"{k} {'< lowest' if v is None else f'{v:g}'}" for k, v in gp.items()))  # fmt: skip
        lines += ["", f"`{RECOMMENDED}`'s goodput over round robin: {goodput_gain(wl)}", ""]
        lost = behind(wl)
        lines.append(f"`{RECOMMENDED}` is " + ("behind: " + "; ".join(lost) if lost else "ahead of every other router"))
        lines.append("")
    return "\n".join(lines) + "\n"


def run_fleet(args: argparse.Namespace, command: str) -> int:
    """``bench peers --testbed fleet``: every asked workload through every router, one engine fleet."""
    args.workers = args.workers or ENGINES
    args.slowdown = args.slowdown or (QUICK_SLOWDOWN if args.quick else SLOWDOWN)
    args.runs = args.runs or (1 if args.quick else 3)
    args.slo_ms = args.slo_ms or SLO_MS
    args.max_concurrency = max(args.max_concurrency, 512)  # open loop: the schedule's rate decides
    try:
        args.rates = [float(x) for x in (args.rates or "").split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--rates: not numbers: {args.rates!r}") from None
    if any(r <= 0 for r in args.rates):
        raise SystemExit("--rates: every rate > 0")
    if args.runs < 1 or args.slowdown <= 0:
        raise SystemExit("--runs must be >= 1 and --slowdown > 0")
    args.bin_dir = peers_bin(args.bin_dir)
    specs = router_specs(args.routers or ",".join(FLEET_ROUTERS), args.before, args.python)
    if args.bin_dir is None and any(spec.kind not in OWN_KINDS for spec in specs):
        raise SystemExit(missing_reason())
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: engines stop
    names = list(WORKLOADS_FLEET) if args.workload == "all" else [w.strip() for w in args.workload.split(",")]
    bad = [n for n in names if n not in WORKLOADS_FLEET]
    if bad:
        raise SystemExit(f"unknown fleet workloads {bad}; choose from {', '.join(WORKLOADS_FLEET)} or all")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"fleet{'-quick' if args.quick else ''}")
    t0 = time.perf_counter()
    engines = start_engines(args, os.path.join(args.out_dir, "logs", "engines"))
    report: dict = {
        "engines": f"{args.workers} mockers timed by the {PROFILE} profile (H200), {engine_blocks()} KV blocks of "
        f"{BLOCK_SIZE} each (an H200's memory less the 32B weights), {args.slowdown:g}x slower than the H200 "
        "(times reported in simulated ms)",
        "command": command,
        "peers": ", ".join(f"{k} {v}" for k, v in peer_versions(args.bin_dir).items()) if args.bin_dir else "none",
        "machine": f"{os.cpu_count()} CPUs shared with other work ({load_avg()} at the start)",
        "slo_ms": args.slo_ms,
        "runs": args.runs,
        "workloads": [],
    }
    try:
        for name in names:
            w = WORKLOADS_FLEET[name]
            reason = w.available()
            if reason:
                print(f"== {name}: not run: {reason}")
                report["workloads"].append({"workload": name, "skipped": reason})
                continue
            report["workloads"].append(run_workload(w, specs, engines, args))
            with open(stem + ".partial.json", "w", encoding="utf-8") as f:  # what a stopped run leaves
                json.dump(report, f, indent=1)
    finally:
        stopping.join()
        engines.stop()
    report["overhead"] = overhead(report["workloads"])
    report["machine"] += f", {load_avg()} at the end; {time.perf_counter() - t0:.0f} s in all"
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    print(f"wrote {stem}.md, {stem}.json ({time.perf_counter() - t0:.0f} s in all)")
    return 0
