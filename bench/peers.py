"""Head-to-head: kvroute's router modes and the peer routers in front of the same engines, same schedule.

Every router runs alone in front of the same engines (fresh mockers per router, or real vLLM CPU engines
whose prefix caches are reset before each router) and replays the identical text schedule
(bench/sessions.py: multi-turn agentic sessions by default). The peers are the routers a team could
pick instead, installed from PyPI in their own environment (``bash .ci/peers-venv`` prints its bin
directory; ``KVROUTE_PEERS_BIN`` or ``--peers-bin`` names it), run with their default settings:

- the SGLang model gateway (``sglang-router``, ``smg launch``): ``cache_aware`` (a radix tree of request
  text per worker plus load-balance thresholds; no KV events) and ``power_of_two``;
- the same gateway's current package (``smg`` 1.13, linked as ``smg-1.13``: the name ``smg`` is
  sglang-router's in that directory): ``cache_aware`` and ``prefix_hash`` (a consistent-hash ring keyed
  by the request's first tokens, walked on when a worker's load is over the average by a factor);
- the vLLM router (``vllm-router``): ``kv_aware`` (fed by every engine's ZMQ KV events and replay,
  tokenizing each request with the model's tokenizer) and ``cache_aware`` (text tree, like SGLang's).

Per router: the engines' own prefix-cache hit rate (``vllm:prefix_cache_hits / queries`` deltas, which
the mocker exposes too), the oracle (bench/traces.py: reuse with one infinite shared cache), TTFT
p50/p90/p99, e2e p50, errors, and the router's CPU seconds per request (its whole process tree, from
/proc). The replay, counters and oracle are bench/replay.py's; the real-engine handling is
bench/real_engines.py's.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.peers_plot import plot_workload
from bench.real_engines import ENGINE_ENV, MODEL_POSITIONS, engine_workers, reset_caches, wait_idle, warm_up
from bench.replay import ModeSpec, RunOptions, failed_row, fmt, load_avg, measure, read_counter, write_report
from bench.sessions import WORKLOADS, Workload, session_trace
from bench.traces import Trace, distinct_blocks, oracle
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions, Worker
from kvroute_common.processes import session_cpu_s
from kvroute_common.real_engines import vllm_cpu
from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR

PEERS_BIN_ENV = "KVROUTE_PEERS_BIN"
REQUIRE_ENV = "KVROUTE_REQUIRE_PEERS"  # set (CI): missing peers fail the test instead of skipping it
# executable in the peers' bin directory -> the PyPI package it comes from
PEER_PACKAGES = {"smg": "sglang-router", "vllm-router": "vllm-router", "smg-1.13": "smg"}
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32; the mockers use the same
READY_TIMEOUT = 120.0
# vllm-router's kv_aware has a real vLLM engine render (tokenize) each request (POST /v1/completions/render)
# and routes without its KV index when that fails; vLLM 0.32 answers it (403 otherwise) only when started
# with --enable-scale-out. The mockers have no render routes: it asks their /tokenize instead (never in-process).
VLLM_ENGINE_ARGS = ("--enable-scale-out",)
# The router's own time tokenizing, where it exports it (histogram sums, read after the replay)
TOKENIZER_TIME = {"kvroute": ("dynamo_frontend_tokenizer_latency_ms_sum", 1.0),
                  "vllm-router": ("vllm_tokenizer_encode_duration_seconds_sum", 1000.0)}  # fmt: skip
# The peers' counters of how they routed (prefix hits and misses, KV index lookups, load balancing)
ROUTER_COUNTERS = {"vllm-router": ("vllm_router_kv_", "vllm_router_prefix_routing", "vllm_router_load_balancing"),
                   "smg": ("smg_router_cache", "smg_router_load_balanc", "smg_worker_selection"),
                   "smg-1.13": ("smg_router_cache", "smg_router_load_balanc", "smg_worker_selection")}  # fmt: skip
# kvroute, a peer's executable, Dynamo's selector behind the harness's thin gateway (bench/dynamo_gateway.py),
# or the floor: the cheapest relay Python can be (bench/relay_floor.py)
Kind = Literal["kvroute", "smg", "smg-1.13", "vllm-router", "dynamo-select", "relay-floor"]
# the kinds that run without the peers' environment
OWN_KINDS = ("kvroute", "dynamo-select", "relay-floor")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """A row: which router (kvroute or a peer's binary) with which policy or mode."""

    label: str
    kind: Kind
    policy: str  # kvroute's --router-mode, or the peer's --policy
    gateway: bool = False  # kvroute as the endpoint picker of an Envoy gateway (--epp-port), Envoy in front
    checkout: str | None = None  # kvroute: another checkout's frontend (--before), None = this one
    python: str | None = None  # kvroute: the interpreter its frontend runs on (--python), None = this one
    extra: tuple[str, ...] = ()  # more kvroute flags (a variant of a mode)
    gateway_options: tuple[tuple[str, Any], ...] = ()  # the gateway's envoy_config options (body modes)

    def describe(self) -> str:
        where = f" (checkout {self.checkout})" if self.checkout else ""
        on = f" (on {self.python})" if self.python else ""
        return self._describe() + where + on

    def _describe(self) -> str:
        if self.kind == "kvroute" and self.gateway:
            return f"Envoy (ext_proc, bodies full duplex) + python -m frontend --router-mode {self.policy} --epp-port P"
        if self.kind == "kvroute":
            return " ".join(("python -m frontend --router-mode", self.policy, *self.extra))
        if self.kind == "relay-floor":
            return "python -m bench.relay_floor (round robin, bytes passed through, nothing parsed or counted)"
        if self.kind == "dynamo-select":
            return "python -m bench.dynamo_gateway (python -m dynamo.select_service 1.6.1, temperature 0)"
        return f"{self.kind}{' launch' if self.kind.startswith('smg') else ''} --policy {self.policy}"


ROUTERS: dict[str, RouterSpec] = {
    r.label: r
    for r in (
        RouterSpec("kvroute-latency", "kvroute", "latency"),
        RouterSpec("kvroute-kv", "kvroute", "kv"),
        RouterSpec("sglang-cache_aware", "smg", "cache_aware"),
        RouterSpec("sglang-power_of_two", "smg", "power_of_two"),
        RouterSpec("smg-cache_aware", "smg-1.13", "cache_aware"),
        RouterSpec("smg-prefix_hash", "smg-1.13", "prefix_hash"),
        RouterSpec("vllm-kv_aware", "vllm-router", "kv_aware"),
        RouterSpec("vllm-cache_aware", "vllm-router", "cache_aware"),
        RouterSpec("dynamo-select", "dynamo-select", "kv"),
        # not a router: the floor of any router's data path on kvroute's stack (asked for by name)
        RouterSpec("relay-floor", "relay-floor", "round_robin"),
        RouterSpec("round_robin", "kvroute", "round_robin"),
        RouterSpec("kvroute-latency-gateway", "kvroute", "latency", gateway=True),
        # latency mode without its cache terms (what they bring, measured)
        RouterSpec("kvroute-latency-nocache", "kvroute", "latency", extra=("--router-latency-live-horizon", "0")),
        # latency mode as for engines that share compute (CPU engines on the same cores): a second copy of
        # a prefix costs everyone, so it is charged 4x its prefill instead of 1x
        RouterSpec("kvroute-latency-shared", "kvroute", "latency", extra=("--router-latency-recompute-weight", "4")),
        # latency mode booking only the rest of a prompt whose prefix it has just routed to the same rank
        RouterSpec("kvroute-latency-book", "kvroute", "latency", extra=("--router-latency-book-predicted",)),
        # latency mode sending every prompt as its text (by default a completions prompt goes to an engine as the
        # router's ids where the engine proved it tokenizes as the router does: --send-token-ids auto)
        RouterSpec("kvroute-latency-text", "kvroute", "latency", extra=("--send-token-ids", "never")),
        # latency mode without KV events (its own record of what it routed only): what the event ingest costs
        RouterSpec("kvroute-latency-noevents", "kvroute", "latency", extra=("--no-router-kv-events",)),
    )
}
# the rows of a plain run: the gateway and the variant rows are asked for by name
DEFAULT_ROUTERS = [
    label
    for label, spec in ROUTERS.items()
    if not spec.gateway and not spec.extra and spec.kind not in ("dynamo-select", "relay-floor")
]


# -- the peers' environment ---------------------------------------------------------------------------
def peers_bin(given: str | None = None) -> str | None:
    """The bin directory holding ``smg``, ``smg-1.13`` and ``vllm-router``, or None when it is not
    configured."""
    path = given or os.environ.get(PEERS_BIN_ENV)
    if path and all(os.access(os.path.join(path, b), os.X_OK) for b in PEER_PACKAGES):
        return path
    return None


def missing_reason() -> str:
    return (
        f"the peer routers are not configured: set {PEERS_BIN_ENV} to the bin directory of an environment "
        "with sglang-router and vllm-router, and smg 1.13 linked there as smg-1.13 (bash .ci/peers-venv creates "
        "it and prints it)"
    )


def peer_versions(bin_dir: str) -> dict[str, str]:
    """The installed versions, each from the environment its executable lives in (``smg-1.13`` is a
    link into an environment of its own)."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    versions = {}
    for program, package in PEER_PACKAGES.items():
        python = os.path.join(os.path.dirname(os.path.realpath(os.path.join(bin_dir, program))), "python")
        out = subprocess.run([python, "-c", code, package], capture_output=True, text=True, check=True, timeout=60)
        versions[package] = out.stdout.strip()
    return versions


# -- starting one router ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Testbed:
    """What every router is given: the engines' model name, tokenizer and block size."""

    model: str
    tokenizer_dir: str  # the engines' tokenizer (kv_aware tokenizes with it)
    model_path: str | None  # kvroute's --model-path (None: its built-in tokenizer, the mockers' own)
    block_size: int = BLOCK_SIZE


def start_router(cluster: Cluster, spec: RouterSpec, bed: Testbed, bin_dir: str | None) -> tuple[str, str]:
    """Start ``spec`` in front of ``cluster.workers``; returns its URL and its metrics URL once it serves
    a completion."""
    metrics_url = ""
    if spec.kind == "kvroute":
        epp = cluster.port() if spec.gateway else None
        extra = ("--kv-cache-block-size", str(bed.block_size), *spec.extra,
                 *(("--epp-port", str(epp)) if epp else ()))  # fmt: skip
        url = cluster.start_frontend(
            spec.policy, extra_args=extra, model_path=bed.model_path, checkout=spec.checkout, python=spec.python
        )
        cluster.wait_frontend_ready(bed.model, timeout=READY_TIMEOUT)
        if epp is not None:  # requests go through Envoy, which asks the frontend where each one goes
            metrics_url = f"{url}/metrics"
            url = cluster.start_gateway(epp, READY_TIMEOUT, **dict(spec.gateway_options))
    elif spec.kind == "relay-floor":
        port = cluster.port()
        url = f"http://127.0.0.1:{port}"
        args = ["-m", "bench.relay_floor", "--port", str(port)]
        for w in cluster.workers:
            args += ["--worker", w.url]
        cluster.start_router(spec.label, sys.executable, args, url)
    elif spec.kind == "dynamo-select":
        port = cluster.port()
        url = f"http://127.0.0.1:{port}"
        args = ["-m", "bench.dynamo_gateway", "--port", str(port), "--block-size", str(bed.block_size)]
        for w in cluster.workers:
            if not w.kv_events_endpoint:
                raise RuntimeError(f"worker {w.url} publishes no KV events: the selector needs them")
            spec_ = f"id={w.worker_id},url={w.url},kv_events_endpoint={w.kv_events_endpoint}"
            args += ["--worker", spec_ + (f",replay_endpoint={w.replay_endpoint}" if w.replay_endpoint else "")]
        cluster.start_router(spec.label, sys.executable, args, url)
    else:
        if bin_dir is None:
            raise RuntimeError(missing_reason())
        port, metrics_port = cluster.port(), cluster.port()
        url = f"http://127.0.0.1:{port}"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        urls = [w.url for w in cluster.workers]
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", spec.policy]
        common += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        env: dict[str, str] = {}
        if spec.kind in ("smg", "smg-1.13"):
            program, args = os.path.join(bin_dir, spec.kind), ["launch", *common]
        else:
            program, args = os.path.join(bin_dir, "vllm-router"), common
            if spec.policy == "kv_aware":
                args += kv_event_args(cluster.workers, bed)
                env["VLLM_ROUTER_TOKENIZER"] = bed.tokenizer_dir
        cluster.start_router(spec.label, program, args, url, env)
    wait_serving(cluster, url, bed.model)
    return url, metrics_url or f"{url}/metrics"


def kv_event_args(workers: Sequence[Worker], bed: Testbed) -> list[str]:
    """vllm-router's static KV event sources: every engine's publisher and replay endpoints."""
    args = ["--kv-event-block-size", str(bed.block_size), "--kv-event-model", bed.model]
    for w in workers:
        if not w.kv_events_endpoint:
            raise RuntimeError(f"worker {w.url} publishes no KV events: kv_aware needs them")
        args += ["--kv-event-source", f"{w.url}={w.kv_events_endpoint}"]
        if w.replay_endpoint:
            args += ["--kv-event-replay-source", f"{w.url}={w.replay_endpoint}"]
    return args


def wait_serving(cluster: Cluster, url: str, model: str, timeout: float = READY_TIMEOUT) -> None:
    """Until the router answers a one-token completion (a prompt unrelated to the schedule)."""
    body = {"model": model, "prompt": "router readiness probe", "max_tokens": 1}
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        cluster.check_alive()
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=10.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"router at {url} does not serve after {timeout:g} s (last: {last})")
        time.sleep(0.05)


# -- one router ---------------------------------------------------------------------------------------
def run_router(
    trace: Trace,
    spec: RouterSpec,
    cluster: Cluster,
    bed: Testbed,
    opts: RunOptions,
    bin_dir: str | None,
    settle: Callable[[], None],
) -> dict:
    """Start ``spec`` in front of the cluster's engines and replay (the caller stops the router with the
    cluster); the row adds the router's CPU seconds over the replay and its own counters."""
    t0 = time.perf_counter()
    url, metrics_url = start_router(cluster, spec, bed, bin_dir)
    assert cluster.frontend is not None
    pid = cluster.frontend.proc.pid
    print(f"[{spec.label}] ready in {time.perf_counter() - t0:.1f} s ({load_avg()})", flush=True)
    cpu0 = session_cpu_s(pid)
    metrics = [w.metrics_url for w in cluster.workers]
    row = measure(trace, url, spec.label, metrics, opts, print, settle)
    cpu = session_cpu_s(pid) - cpu0
    row.update(router=spec.label, kind=spec.kind, policy=spec.policy, command=spec.describe())
    row["router_cpu_s"] = round(cpu, 2)
    row["router_cpu_ms_per_request"] = round(1000.0 * cpu / max(1, row["completed"]), 2)
    row["tokenizer_ms_per_request"], row["router_counters"] = router_metrics(spec, metrics_url, row["completed"])
    return row


def router_metrics(spec: RouterSpec, metrics_url: str, requests: int) -> tuple[float | None, dict[str, float]]:
    """The router's own tokenizer time per request (wall time, which on a busy machine includes waiting
    for a core; None where the router does not export it) and its routing
    counters (``ROUTER_COUNTERS``, per label set): the run's totals, since every router starts fresh."""
    try:
        text = httpx.get(metrics_url, timeout=5.0).text
    except httpx.HTTPError:
        return None, {}
    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(ROUTER_COUNTERS.get(spec.kind, ())) and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                counters[f"{sample.name}{{{labels}}}"] = sample.value
    name, scale = TOKENIZER_TIME.get(spec.kind, ("", 0.0))
    total = read_counter(text, name) if name and requests else None
    return (None if total is None else round(total * scale / requests, 2)), counters


def busiest_share(cache: dict | None) -> float | None:
    """The largest share of the schedule's prompt tokens that one engine received: 1/engines is an even
    spread, 1.0 means every request went to one engine."""
    if not cache or not cache["queries"]:
        return None
    return round(max(w["queries"] for w in cache["per_worker"].values()) / cache["queries"], 3)


def failed(trace: Trace, spec: RouterSpec, exc: BaseException) -> dict:
    print(f"[{spec.label}] run failed: {exc}", flush=True)
    row = failed_row(trace, ModeSpec(spec.label, spec.policy), exc)
    row.update(router=spec.label, kind=spec.kind, policy=spec.policy, command=spec.describe())
    row["router_cpu_s"] = row["router_cpu_ms_per_request"] = row["tokenizer_ms_per_request"] = None
    return row


def run_mockers(trace: Trace, specs: Sequence[RouterSpec], args: argparse.Namespace, blocks: int) -> list[dict]:
    """Fresh (cold) mockers for every router, so no router inherits another's caches."""
    bed = Testbed(DEFAULT_MODEL, BUILTIN_TOKENIZER_DIR, None)
    mocker = MockerOptions(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, speedup_ratio=args.speedup_ratio,
                           seed=args.seed)  # fmt: skip
    opts = _run_options(args, DEFAULT_MODEL)
    rows = []
    for spec in specs:
        tag = getattr(args, "log_tag", trace.name)
        cluster = Cluster(log_dir=os.path.join(args.out_dir, "logs", f"{tag}-mocker-{spec.label}"))
        try:
            for _ in range(args.workers):
                cluster.start_mocker(mocker)
            cluster.wait_workers_ready(READY_TIMEOUT)
            rows.append(run_router(trace, spec, cluster, bed, opts, args.bin_dir, cluster.check_alive))
        except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
            rows.append(failed(trace, spec, exc))
        finally:
            cluster.stop()
    return rows


class VllmEngines:
    """The real vLLM CPU engines of a run, started on first use and kept while the cache size and context
    length asked for stay the same (the loads of one workload share them; caches reset per router)."""

    def __init__(self, args: argparse.Namespace) -> None:
        python = vllm_cpu.vllm_python()
        if python is None:
            raise SystemExit(vllm_cpu.missing_reason())
        self.python, self.args = python, args
        self.log_dir = os.path.join(args.out_dir, "logs")
        self.tmp = tempfile.mkdtemp(prefix="kvroute-tiny-")
        self.model_dir = ""
        self.engines: list[vllm_cpu.VllmEngine] = []
        self.shape: tuple[int, int] | None = None  # (blocks, max_model_len) of the running engines

    def ensure(self, trace: Trace, blocks: int) -> list[vllm_cpu.VllmEngine]:
        longest = max(len(r.tokens) + r.max_tokens for r in trace.requests)
        if longest > MODEL_POSITIONS:
            raise SystemExit(f"the longest request needs {longest} positions; the tiny model has {MODEL_POSITIONS}")
        max_len = min(MODEL_POSITIONS, max(2048, -(-longest // 1024) * 1024))
        if self.shape == (blocks, max_len):
            return self.engines
        self.stop()
        os.makedirs(self.log_dir, exist_ok=True)
        if not self.model_dir:
            self.model_dir = vllm_cpu.write_tiny_model(
                self.python, os.path.join(self.tmp, "model"), seed=self.args.seed
            )
        self.engines = [
            vllm_cpu.VllmEngine(self.python, self.model_dir, num_gpu_blocks=blocks, max_model_len=max_len,
                                env=dict(ENGINE_ENV), log_path=os.path.join(self.log_dir, f"vllm-{i}.log"),
                                extra_args=list(VLLM_ENGINE_ARGS))
            for i in range(1, self.args.workers + 1)
        ]  # fmt: skip
        t0 = time.perf_counter()
        vllm_cpu.start_engines(self.engines)
        self.shape = (blocks, max_len)
        print(
            f"   {len(self.engines)} vLLM engines ready in {time.perf_counter() - t0:.0f} s ({load_avg()})", flush=True
        )
        print(f"   warm-up {warm_up(self.engines, trace, self.args.seed):.0f} s", flush=True)
        return self.engines

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        self.engines, self.shape = [], None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_vllm(trace: Trace, specs: Sequence[RouterSpec], args: argparse.Namespace, blocks: int) -> list[dict]:
    """Real vLLM CPU engines (``args.vllm_engines``, or started for this call); before every router
    their prefix caches are reset."""
    own = getattr(args, "vllm_engines", None) is None
    pool: VllmEngines = VllmEngines(args) if own else args.vllm_engines
    rows = []
    try:
        engines = pool.ensure(trace, blocks)
        bed = Testbed(vllm_cpu.SERVED_NAME, pool.model_dir, pool.model_dir)
        opts = _run_options(args, vllm_cpu.SERVED_NAME)
        for spec in specs:
            tag = getattr(args, "log_tag", trace.name)
            cluster = Cluster(log_dir=os.path.join(pool.log_dir, f"{tag}-vllm-{spec.label}"))
            cluster.workers = engine_workers(engines)

            def settle(c: Cluster = cluster) -> None:
                c.check_alive()
                wait_idle(engines)

            try:
                reset_caches(engines)
                rows.append(run_router(trace, spec, cluster, bed, opts, args.bin_dir, settle))
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
                rows.append(failed(trace, spec, exc))
            finally:
                cluster.stop()
    finally:
        if own:
            pool.close()
    return rows


def _run_options(args: argparse.Namespace, model: str) -> RunOptions:
    return RunOptions(workers=args.workers, max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
                      request_timeout_s=args.request_timeout, model=model)  # fmt: skip


def blocks_per_engine(trace: Trace, args: argparse.Namespace) -> int:
    """KV blocks per engine: as given, or all engines together hold ``--cache-fraction`` of the schedule's
    distinct blocks (so caches evict), and never less than twice the longest request."""
    if args.num_gpu_blocks:
        return int(args.num_gpu_blocks)
    prompts = [r.tokens for r in trace.requests]
    share = math.ceil(args.cache_fraction * distinct_blocks(prompts, BLOCK_SIZE) / args.workers)
    longest = math.ceil(max(len(p) + r.max_tokens for p, r in zip(prompts, trace.requests, strict=True)) / BLOCK_SIZE)
    return max(share, 2 * longest + 1)


# -- report -------------------------------------------------------------------------------------------
def table(report: dict) -> str:
    orc = report["oracle"]["token_share"]
    lines = [
        "| router | hit rate (engines) | of oracle | TTFT p50 / p90 / p99 ms | e2e p50 ms | errors "
        "| router CPU ms / request (tokenizer wall ms) | busiest engine's share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in report["routers"]:
        hit = m.get("hit_rate")
        t = m["ttft_ms"]
        lines.append(
            f"| {m['router']} | {fmt(hit, '%')} | {f'{hit / orc:.1%}' if hit is not None and orc else 'n/a'} "
            f"| {fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | {fmt(m['e2e_ms']['p50'])} "
            f"| {m['requests'] - m['completed']} | {fmt(m.get('router_cpu_ms_per_request'))}"
            f"{f' ({fmt(tok)})' if (tok := m.get('tokenizer_ms_per_request')) is not None else ''} "
            f"| {fmt(busiest_share(m.get('cache')))} |"
        )
    lines.append(f"| oracle (one infinite shared cache) | {fmt(orc, '%')} | 100% | | | | | |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    s = report["trace"]
    machine = report.get("machine", {})
    lines = [
        f"### `{report['workload']}` at load {report.get('load', 1):g} on {report['testbed']}",
        "",
        f"- Workload: {report['description']}",
        f"- Schedule: {s['requests']} requests over {s['span_s']} s, mean prompt {s['mean_prompt_tokens']} tokens "
        f"(max {s['max_prompt_tokens']})",
        f"- Engines: {report['setup']}",
        f"- Peers: {report['peers']}",
        f"- Command: `{report['command']}`",
        f"- Machine: {machine.get('cpus')} CPUs, load average before {machine.get('load_before')}, "
        f"after {machine.get('load_after')}",
        "",
        table(report),
        "",
    ]
    lines += [f"- `{m['router']}` = `{m['command']}`" for m in report["routers"]]
    for m in report["routers"]:
        if m.get("router_counters"):
            lines.append(
                f"- {m['router']} counters: " + ", ".join(f"{k} {v:g}" for k, v in m["router_counters"].items())
            )
        if m["completed"] < m["requests"]:
            example = next(iter(m.get("error_examples", {}).values()), "")[:200]
            lines.append(f"- {m['router']}: {m['requests'] - m['completed']} failed, e.g. {example}")
    lost = lost_to_peers(report)
    lines.append(f"- `{RECOMMENDED}` " + (f"is behind: {'; '.join(lost)}" if lost else "is ahead of every peer"))
    return "\n".join(lines) + "\n"


RECOMMENDED = "kvroute-latency"  # the row every peer is compared with


def lost_to_peers(report: dict, label: str = RECOMMENDED) -> list[str]:
    """Where ``label`` is behind a peer (another project's router) on hit rate or TTFT p50 / p90."""
    rows = {m["router"]: m for m in report["routers"]}
    ours = rows.get(label)
    if ours is None or ours.get("hit_rate") is None:
        return [f"{label} did not run"]
    lost = []
    for m in report["routers"]:
        if m["kind"] == "kvroute" or m.get("hit_rate") is None or m["completed"] < m["requests"]:
            continue
        if m["hit_rate"] > ours["hit_rate"]:
            lost.append(f"hit rate to {m['router']} ({m['hit_rate']:.1%} vs {ours['hit_rate']:.1%})")
        for p in ("p50", "p90"):
            theirs, mine = m["ttft_ms"][p], ours["ttft_ms"][p]
            if theirs is not None and mine is not None and theirs < mine:
                lost.append(f"TTFT {p} to {m['router']} ({fmt(theirs)} vs {fmt(mine)} ms)")
    return lost


def runs_markdown(runs: Sequence[dict], label: str = RECOMMENDED) -> str:
    """One cell run several times: each router's median of every figure with its min-max, then
    ``label`` against each other router as the median of the per-run ratios (each run's routers saw
    the same machine)."""
    first = runs[0]
    labels = [m["router"] for m in first["routers"]]

    def spread(values: Sequence[float | None], pct: bool = False) -> str:
        xs = sorted(v for v in values if v is not None)
        if not xs:
            return "n/a"
        if pct:
            return f"{statistics.median(xs):.1%} ({xs[0]:.1%}-{xs[-1]:.1%})"
        return f"{fmt(statistics.median(xs))} ({fmt(xs[0])}-{fmt(xs[-1])})"

    rows = [{m["router"]: m for m in r["routers"]} for r in runs]
    # CPU above each router's idle CPU (bench data_path measures it): the idle timers of one router are
    # part of its whole-run figure, which the goals name; this column shows the request path apart
    above = any(m.get("router_cpu_above_idle_ms_per_request") is not None for r in runs for m in r["routers"])
    lines = [
        f"### `{first['workload']}` at load {first.get('load', 1):g} on {first['testbed']}: {len(runs)} runs, "
        "the routers' order rotated",
        "",
        f"- Engines: {first['setup']}",
        f"- Command: `{first['command']}`",
        "- Machine load average before each run: " + ", ".join(str(r["machine"]["load_before"]) for r in runs),
        "",
        "| router | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | router CPU ms / request |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for lb in labels:
        ms = [r[lb] for r in rows if lb in r]
        lines.append(
            f"| {lb} | {spread([m.get('hit_rate') for m in ms], pct=True)} "
            + " ".join(f"| {spread([m['ttft_ms'][p] for m in ms])}" for p in ("p50", "p90", "p99"))
            + f" | {spread([m.get('router_cpu_ms_per_request') for m in ms])} |"
        )
    # the recommended row, and the same row on another interpreter (--python) when there is one
    for ours in [lb for lb in labels if lb == label or lb.startswith(label + " [")]:
        lines += [
            "",
            f"`{ours}` against each router, the median of the per-run ratios (min-max); hit rate as the "
            "median difference in points:",
            "",
            "| against | hit rate points | TTFT p50 | TTFT p90 | TTFT p99 | router CPU |"
            + (" router CPU above idle |" if above else ""),
            "| --- | --- | --- | --- | --- | --- |" + (" --- |" if above else ""),
        ]
        for lb in labels:
            if lb == ours:
                continue
            pairs = [(r[ours], r[lb]) for r in rows if ours in r and lb in r]
            diffs = sorted(
                100.0 * (o["hit_rate"] - t["hit_rate"])
                for o, t in pairs
                if o.get("hit_rate") is not None and t.get("hit_rate") is not None
            )
            hit = f"{statistics.median(diffs):+.1f} ({diffs[0]:+.1f} to {diffs[-1]:+.1f})" if diffs else "n/a"
            lines.append(
                f"| {lb} | {hit} "
                + " ".join(f"| {_ratio(pairs, 'ttft_ms', p)}" for p in ("p50", "p90", "p99"))
                + f" | {_ratio(pairs, 'router_cpu_ms_per_request')} |"
                + (f" {_ratio(pairs, 'router_cpu_above_idle_ms_per_request')} |" if above else "")
            )
    return "\n".join(lines) + "\n"


def _ratio(pairs: Sequence[tuple[dict, dict]], key: str, sub: str | None = None) -> str:
    """The median (min-max) over runs of ours / theirs for one figure of two routers' rows."""

    def get(m: dict) -> float | None:
        v = m.get(key)
        return v.get(sub) if sub is not None and isinstance(v, dict) else v

    xs = sorted(a / b for o, t in pairs if (a := get(o)) is not None and (b := get(t)))
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.2f}x ({xs[0]:.2f}-{xs[-1]:.2f})"


def summary_markdown(reports: Sequence[dict]) -> str:
    """Every cell in one table: per router the hit rate as a share of the oracle and TTFT p50 / p90 (ms),
    then where the recommended mode is behind a peer."""
    labels: list[str] = []
    for r in reports:
        labels += [m["router"] for m in r["routers"] if m["router"] not in labels]
    lines = [
        "| workload, load (machine load before / after) | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    for r in reports:
        rows = {m["router"]: m for m in r["routers"]}
        orc = r["oracle"]["token_share"]
        cells = []
        for label in labels:
            m = rows.get(label)
            if m is None or m.get("hit_rate") is None:
                cells.append("n/a")
                continue
            errors = m["requests"] - m["completed"]
            cells.append(
                f"{m['hit_rate'] / orc:.1%}, {fmt(m['ttft_ms']['p50'])} / {fmt(m['ttft_ms']['p90'])}"
                + (f" ({errors} errors)" if errors else "")
            )
        machine = r.get("machine", {})
        lines.append(
            f"| {r['workload']} x{r['load']:g}{' quick' if r.get('quick') else ''} "
            f"({machine.get('load_before', '?')} / {machine.get('load_after', '?')}) | " + " | ".join(cells) + " |"
        )
    lines += ["", f"Where `{RECOMMENDED}` is behind a peer:", ""]
    for r in reports:
        lost = lost_to_peers(r)
        lines.append(f"- {r['workload']} x{r['load']:g}: " + ("; ".join(lost) if lost else "ahead of every peer"))
    return "\n".join(lines) + "\n"


# -- CLI ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--testbed", choices=("mocker", "vllm", "fleet"), default="mocker",
                   help="fleet: 8 engines timed as H200s serving Qwen2.5-32B, the published workloads, every "
                   "cell the median of --runs runs (bench/fleet.py)")  # fmt: skip
    p.add_argument("--workload", default="all", help=f"comma-separated, from {', '.join(WORKLOADS)}, or all")
    p.add_argument("--loads", default="1,2",
                   help="load factors, comma-separated: x = the sessions' starts and think times divided by x, "
                        "and x times --max-concurrency in flight")  # fmt: skip
    p.add_argument("--routers", default=None,
                   help=f"comma-separated, from {', '.join(ROUTERS)} (default: {', '.join(DEFAULT_ROUTERS)}; on the "
                   "fleet every peer and round robin)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a short run: a third of the sessions, at most 3 turns")
    p.add_argument("--workers", type=int, default=None, help="engines (default 4; 8 on the fleet)")
    p.add_argument("--runs", type=int, default=None,
                   help="runs per cell, the routers' order rotated each run, reported with the median of each "
                   "figure and its spread (fleet: 3, quick 1; otherwise 1)")  # fmt: skip
    p.add_argument("--rates", default=None,
                   help="fleet: the rates to sweep, comma-separated, for every asked workload (default: each "
                   "workload's own)")  # fmt: skip
    p.add_argument("--slowdown", type=float, default=None,
                   help="fleet: engines this many times slower than the H200 (default 2; times are "
                   "reported divided by it)")  # fmt: skip
    p.add_argument(
        "--slo-ms",
        type=float,
        default=None,
        help="fleet: goodput counts rates whose TTFT p90 stays under this, simulated ms (default 2000)",
    )
    p.add_argument("--num-gpu-blocks", type=int, default=0, help="KV blocks per engine (0 = from --cache-fraction)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="all engines' caches together hold this share of the schedule's distinct blocks")  # fmt: skip
    p.add_argument("--speedup-ratio", type=float, default=4.0, help="mocker engine speed")
    p.add_argument("--max-concurrency", type=int, default=12, help="client requests in flight at most, at load 1")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per router before cancelling")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--bin-dir", default=None, help=f"the peers' bin directory (default: ${PEERS_BIN_ENV})")
    p.add_argument("--out-dir", default="bench/out/peers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", default=None,
                   help="another checkout of kvroute (git worktree add DIR REV): each kvroute row also runs with its "
                   "frontend, just before this checkout's, in the same run")  # fmt: skip
    p.add_argument("--python", default=None, metavar="NAME=PATH", help=PYTHON_HELP)
    return p


PYTHON_HELP = (
    "another interpreter that imports kvroute (a venv's python): each kvroute row also runs on it, labelled "
    "[NAME], just after this one's, in the same run (kvroute's image runs a PGO + LTO CPython)"
)


def workloads_of(text: str) -> list[Workload]:
    names = list(WORKLOADS) if text.strip() == "all" else [w.strip() for w in text.split(",") if w.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)} or all")
    return [WORKLOADS[n] for n in names]


def loads_of(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--loads: not numbers: {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise SystemExit("--loads: one or more factors > 0")
    return loads


def load1() -> float | None:
    """The machine's 1-minute load average (shared with other work: stated with every figure)."""
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def run_cell(workload: Workload, load: float, specs: Sequence[RouterSpec], args: argparse.Namespace,
             command: str) -> dict:  # fmt: skip
    """One workload at one load through every router; the report of that cell."""
    shaped = (workload.quick() if args.quick else workload).at_load(load)  # quick first: load 2 stays 2x as dense
    trace = session_trace(shaped, args.seed)
    prompts = [r.tokens for r in trace.requests]
    orc = oracle(prompts, BLOCK_SIZE)
    blocks = blocks_per_engine(trace, args)
    cell = argparse.Namespace(**vars(args))
    cell.max_concurrency = max(1, round(args.max_concurrency * load))
    cell.log_tag = f"{trace.name}-load{load:g}"  # each cell's router logs in their own directory
    print(f"== {trace.name} at load {load:g} on {args.testbed}: {trace.summary()} ({load_avg()})")
    print(f"   {shaped.describe()}")
    print(
        f"   oracle {orc.token_share:.1%}; {distinct_blocks(prompts, BLOCK_SIZE)} distinct blocks of {BLOCK_SIZE}, "
        f"{blocks} per engine x {args.workers}; client max {cell.max_concurrency} in flight",
        flush=True,
    )
    load_before = load1()
    t0 = time.perf_counter()
    rows = (run_mockers if args.testbed == "mocker" else run_vllm)(trace, specs, cell, blocks)
    versions = peer_versions(args.bin_dir) if args.bin_dir else {}
    engine = (
        f"{args.workers} mockers, speedup ratio {args.speedup_ratio:g}, fresh per router"
        if args.testbed == "mocker"
        else f"{args.workers} vLLM {vllm_cpu.VERSION} CPU engines (tiny model), prefix caches reset per router"
    )
    return {
        "workload": trace.name,
        "load": load,
        "quick": bool(args.quick),
        "testbed": args.testbed,
        "description": shaped.describe(),
        "trace": trace.summary(),
        "oracle": orc.as_dict(),
        "setup": f"{engine}; block size {BLOCK_SIZE}, {blocks} KV blocks each; client max {cell.max_concurrency} "
        f"in flight; seed {args.seed}",
        "peers": ", ".join(f"{k} {v}" for k, v in versions.items()) + " (default settings)" if versions else "none",
        "command": command,
        "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load1()},
        "total_s": round(time.perf_counter() - t0, 1),
        "routers": rows,
    }


def router_specs(labels: str, before: str | None = None, python: str | None = None) -> list[RouterSpec]:
    """The rows ``--routers`` names (comma-separated); with ``--before DIR`` each kvroute row also runs
    with that checkout's frontend, just before this one's; with ``--python NAME=PATH`` each kvroute row
    also runs on that interpreter (labelled ``[NAME]``), just after this one's."""
    names = [r.strip() for r in labels.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; choose from {', '.join(ROUTERS)}")
    specs = [ROUTERS[r] for r in names]
    if before:
        checkout = os.path.abspath(before)
        specs = [
            x
            for s in specs
            for x in ((replace(s, label=f"{s.label} (before)", checkout=checkout), s) if s.kind == "kvroute" else (s,))
        ]
    if python:
        name, path = interpreter(python)
        specs = [
            x
            for s in specs
            for x in ((s, replace(s, label=f"{s.label} [{name}]", python=path)) if s.kind == "kvroute" else (s,))
        ]
    return specs


def interpreter(option: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--python``: a Python that imports kvroute (a venv it is installed in)."""
    name, sep, path = option.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--python wants NAME=PATH (e.g. pgo=/opt/venv/bin/python), not {option!r}")
    path = os.path.abspath(path)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"--python {option}: {path} is not an executable")
    return name, path


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = "python -m bench peers " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.testbed == "fleet":  # bench/fleet.py builds on this module: handed over by name, as bench/__main__ does
        return int(importlib.import_module("bench.fleet").run_fleet(args, command))
    args.workers = args.workers or 4
    specs = router_specs(args.routers or ",".join(DEFAULT_ROUTERS), args.before, args.python)
    workloads, loads = workloads_of(args.workload), loads_of(args.loads)
    args.bin_dir = peers_bin(args.bin_dir)
    if args.bin_dir is None and any(s.kind not in OWN_KINDS for s in specs):
        raise SystemExit(missing_reason())
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: engines stop
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    reports: list[dict] = []
    args.vllm_engines = VllmEngines(args) if args.testbed == "vllm" else None  # shared by a workload's loads
    try:
        ok = run_cells(workloads, loads, specs, args, command, reports)
    finally:
        if args.vllm_engines is not None:
            args.vllm_engines.close()
    summary = os.path.join(args.out_dir, f"summary-{args.testbed}{'-quick' if args.quick else ''}.md")
    with open(summary, "w", encoding="utf-8") as f:
        f.write(summary_markdown(reports))
    print()
    print(summary_markdown(reports))
    print(f"wrote {summary} ({time.perf_counter() - t0:.0f} s in all)")
    return 0 if ok else 1


def run_cells(workloads: Sequence[Workload], loads: Sequence[float], specs: Sequence[RouterSpec],
              args: argparse.Namespace, command: str, reports: list[dict]) -> bool:  # fmt: skip
    """Every workload at every load: a report per cell, a plot per workload; whether no request failed."""
    ok = True
    runs = max(1, args.runs or 1)
    for workload in workloads:
        cells = []
        for load in loads:
            repeats = []
            for run in range(runs):  # each run starts the rotation one router later
                order = [*specs[run % len(specs) :], *specs[: run % len(specs)]]
                report = run_cell(workload, load, order, args, command)
                report["run"] = run + 1
                stem = os.path.join(args.out_dir, cell_stem(report) + (f"-run{run + 1}" if runs > 1 else ""))
                write_report(stem, report, markdown(report))
                ok = ok and all(m["completed"] == m["requests"] for m in report["routers"])
                repeats.append(report)
            cells.append(repeats[-1])
            if runs > 1:
                stem = os.path.join(args.out_dir, cell_stem(repeats[0]) + f"-{runs}runs")
                total = round(sum(r["total_s"] for r in repeats), 1)
                write_report(stem, {"total_s": total, "runs": repeats}, runs_markdown(repeats))
        plot = os.path.join(args.out_dir, f"{cell_stem(cells[0], load=False)}.png")
        plot_workload(cells, plot)
        print(f"wrote {plot}")
        reports += cells
    return ok


def cell_stem(report: dict, load: bool = True) -> str:
    quick = "-quick" if report.get("quick") else ""
    at = f"-load{report['load']:g}" if load else ""
    return f"{report['workload']}-{report['testbed']}{at}{quick}"


if __name__ == "__main__":
    sys.exit(main())
