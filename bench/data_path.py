"""Where a request's router time goes: CPU per request, TTFT, and kvroute's time by phase, per path.

    python -m bench data_path                                   # ~6 min: both tokenizers, both APIs, c 1/8/32
    python -m bench data_path --tokenizers hf --apis chat --output-tokens 256 --concurrency 32
    python -m bench data_path --pin                             # the router on a core of its own
    python -m bench data_path --routers kvroute-latency,smg-cache_aware --concurrency 12,32

Each cell is one router alone in front of four fresh mockers (4,096 KV blocks each, ``--speedup-ratio 4``)
replaying the ``agentic-dense`` sessions (48 x 6 turns on shared system prompts, 2-4k-token prompts;
each concurrency level replays its own sessions, so no router sees a prompt twice), with at most
``c`` requests in flight. Per cell: the router's CPU per request (its process tree, from /proc), its
threads' context switches per request (each voluntary one a sleep and a wake-up), TTFT p50 / p90 / p99,
and for kvroute a sampling profile (py-spy, 250 Hz, on its process for the replay
only) sorted into phases by the innermost frame of each sample that belongs to one:

- ``tokenize``: chat template, encoding (built-in encoder, HF backend, chunk cache, worker thread);
- ``hash``: block and sequence hashes; ``route+book``: router cores, slot tracker, footprint;
- ``kv-events``: the indexer (event decode and application); ``metrics``: Prometheus and the lifecycle
  listener; ``relay``: the upstream client, the stream pipeline, the lease;
- ``request``: parse, hints, validation, the request path; ``http``: uvicorn, Starlette, middleware;
- ``loop``: the event loop's own work (uvloop's C code: socket reads and writes, timers, callbacks).
  py-spy reads the stacks of the running process (``--nonblocking``: its pauses would be in the CPU figures),
  and a stack that changed while it was read keeps only its outermost frame and lands here too: at 32 in flight
  ``loop`` held ~70 % of the samples where a run sampling the stopped process put 46 % there (docs/benchmarks.md,
  "Idle CPU, what a request's Python time is made of"). Read the other phases as lower bounds.

The profile's shares are of the time the loop thread was busy (running, or runnable and waiting for a
core: py-spy skips idle samples), turned into ms per request with the measured CPU per request.

Before its first request each router is measured idle for ``--idle-seconds`` (its timers, health probes and
metrics refreshes, from the scheduler's nanosecond account): that rate is in every CPU-per-request figure
whatever the traffic, so each row also gives the CPU per request above it over the measured window.
Each row also splits the client's mean TTFT into the engines' own (their TTFT histograms) and what the
router added, beside the CPU the engines and this client spent per request: a TTFT gap between routers is
either the router's own path or the queues its decisions built on the engines.

``--tokenizers``: ``builtin`` (kvroute's own tokenizer, the mockers' too) and ``hf``: the same
vocabulary with Llama-3's split pattern, which Python's ``re`` cannot run, so kvroute encodes new text
with the Hugging Face backend (what a deployment's ``tokenizer.json`` gets); the mockers load it too.
``--pin``: the router on core 1 (all its threads), the mockers and this client on core 0, so the
router's decision latency is seen apart from contention for a core (needs 2 cores).
``--native`` (with ``--no-profile``): every router recorded with ``perf record -e cpu-clock`` over the same
window, its CPU per request by library below Python: the interpreter, the kernel (sockets, wake-ups), libc,
uvloop, httptools, orjson / msgspec, libzmq, tokenizers, a peer's own Rust code ("rust router"). py-spy and
cProfile see only Python frames (cProfile inflates small calls); the interpreter's share is what compiled
code could reduce.
``--syscalls``: every router traced with ``perf trace -s`` over the same window, its system calls per request
by name (all of them first): each is a kernel entry and exit, which a paravirtualized guest pays dearly
for. perf's own cost lands in the CPU figures of such a run: read them from a run without it.
``--python NAME=PATH``: each kvroute row also runs on another interpreter (a venv of it with kvroute
installed), labelled ``[NAME]``, in the same run.
``--runs N``: every cell N times, the routers' order rotated each run; the report adds, per cell, each
figure's median and min-max and kvroute ``latency`` against each router as the median of the per-run
ratios (one run's ratios spread 10-25 % on this machine).
Nothing here asserts: benchmarks measure. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx

from bench.peers import (
    PYTHON_HELP,
    ROUTERS,
    RouterSpec,
    Testbed,
    peers_bin,
    router_specs,
    runs_markdown,
    start_router,
)
from bench.replay import RunOptions, measure, read_counter
from bench.sessions import WORKLOADS, Workload, session_trace
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
from kvroute_common.processes import session_cpu_s, session_runtime_s, session_switches
from kvroute_common.text_chunks import LLAMA3_PATTERN
from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR

BLOCK_SIZE = 32
IDLE_SETTLE_S = 2.0  # after a router is ready, before its idle CPU is measured
READY_TIMEOUT = 120.0
SAMPLE_HZ = 250

# phase -> substrings of a frame ("function (path:line)"); a sample belongs to the phase of its innermost
# frame that matches one, in this order of precedence within a frame
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "tokenize",
        (
            "kvroute_common/tokenizer.py",
            "kvroute_common/text_chunks.py",
            "kvroute_common/tokenize_offload.py",
            "tokenizers/",
            "transformers/",
            "jinja2/",
            "frontend/routing/prompt.py",
        ),
    ),  # fmt: skip
    ("hash", ("kvroute_common/hashing.py", "xxhash")),
    ("metrics", ("prometheus_client/", "frontend/observability/")),
    (
        "kv-events",
        (
            "indexer/",
            "zmq/",
            "kvroute_common/zmq_recv.py",
            "kvroute_common/zmtp_sub.py",
            "kvroute_common/loop_turns.py",
        ),
    ),
    ("route+book", ("router/", "slot_tracker/", "frontend/routing/")),
    (
        "relay",
        (
            "frontend/dispatch/proxy.py",
            "frontend/dispatch/upstream.py",
            "frontend/dispatch/unary_stream.py",
            "frontend/dispatch/response_rewriter.py",
            "frontend/dispatch/migration.py",
            "frontend/dispatch/lifecycle.py",
            "frontend/dispatch/stream_dialect.py",
        ),
    ),  # fmt: skip
    ("request", ("frontend/dispatch/", "frontend/api/", "frontend/request/", "kvroute_common/openai_api.py")),
    (
        "http",
        (
            "uvicorn/",
            "starlette/",
            "kvroute_common/drain.py",
            "kvroute_common/fast_http.py",
            "kvroute_common/http.py",
            "frontend/app.py",
        ),
    ),  # fmt: skip
    ("loop", ("asyncio/", "uvloop", "selectors.py")),
)


# a router's CPU below Python: a library -> substrings of perf's shared-object paths, in this order
NATIVE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("interpreter", ("libpython",)),
    ("kernel", ("[kernel",)),
    ("libc", ("/libc.so", "/libm.so", "[vdso]")),
    ("uvloop", ("/uvloop/",)),
    ("httptools", ("/httptools/",)),
    ("json", ("/orjson/", "/msgspec/")),
    ("zmq", ("pyzmq", "/zmq/")),
    ("tokenizers", ("/tokenizers/",)),
    ("rust router", ("_rs.abi3.so",)),  # the peers' own code: smg_rs, vllm_router_rs, sglang_router_rs
)
NATIVE_HZ = 1000


def phase_of(stack: str) -> str:
    """The phase of one collapsed stack (frames root-first, ``;``-separated)."""
    for frame in reversed(stack.split(";")):
        for name, keys in PHASES:
            if any(k in frame for k in keys):
                return name
    return "other"


def phase_shares(raw: str) -> dict[str, float]:
    """Share of the samples per phase, from py-spy's raw (collapsed) output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            counts[phase_of(stack)] += int(n)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.most_common()} if total else {}


def native_shares(report: str) -> dict[str, float]:
    """Share of the samples per library (``NATIVE_GROUPS``, else "other"), from ``perf report --sort dso
    --stdio -v``, whose rows are ``  57.53%  /path/to/libpython3.11.so.1.0``."""
    counts: dict[str, float] = {}
    for line in report.splitlines():
        percent, sign, dso = line.strip().partition("%")
        if not sign or line.lstrip().startswith("#"):
            continue
        try:
            value = float(percent)
        except ValueError:
            continue
        dso = dso.strip()
        group = next((name for name, keys in NATIVE_GROUPS if any(k in dso for k in keys)), "other")
        counts[group] = counts.get(group, 0.0) + value
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])} if total else {}


class NativeSampler:
    """``perf record -e cpu-clock`` of one process (its threads too) from construction until ``stop``: where
    its CPU goes below Python (the interpreter, the kernel's sockets and wake-ups, the C libraries), which
    neither py-spy nor cProfile sees. perf starts with its events off and turns them on and off through its
    control descriptors, each acknowledged, so the window is the one measured and perf is running in it."""

    def __init__(self, pid: int, out: str) -> None:
        self.out = out
        ctl_read, self._ctl = os.pipe()
        self._ack, ack_write = os.pipe()
        self.proc = subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", str(NATIVE_HZ), "-p", str(pid), "-o", out, "-D", "-1",
             "--control", f"fd:{ctl_read},{ack_write}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(ctl_read, ack_write),
        )  # fmt: skip
        os.close(ctl_read)
        os.close(ack_write)
        try:
            self._command(b"enable")
        except BaseException:
            os.close(self._ctl)
            os.close(self._ack)
            raise

    def _command(self, command: bytes) -> None:
        os.write(self._ctl, command + b"\n")
        ready, _, _ = select.select([self._ack], [], [], 30.0)
        if not ready or not os.read(self._ack, 64).startswith(b"ack"):
            self.proc.kill()
            raise RuntimeError(f"perf record did not acknowledge {command.decode()!r}")

    def stop(self) -> dict[str, float]:
        try:
            self._command(b"disable")
            self.proc.send_signal(signal.SIGINT)
            if self.proc.wait(30) not in (0, -signal.SIGINT):  # perf raises the signal again once its data is out
                raise RuntimeError(f"perf record exited with {self.proc.returncode}")
        finally:
            os.close(self._ctl)
            os.close(self._ack)
        report = subprocess.run(
            ["perf", "report", "-i", self.out, "--sort", "dso", "--stdio", "-v"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return native_shares(report.stdout)


class SyscallCounter:
    """``perf trace -s`` of one process (its threads too) from construction until ``stop``: its system calls by
    name. Each costs a kernel entry and exit, which in a paravirtualized guest is a trip through the
    hypervisor: a router's calls per request are part of its CPU figure that no Python profile shows.
    perf adds its own cost to each call, so a run counting them is not one to read CPU figures from."""

    def __init__(self, pid: int, out: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            ["perf", "trace", "-s", "-p", str(pid), "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30.0
        while not self._tracing():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("perf trace did not start (perf_event_paranoid, or no tracepoints?)")
            time.sleep(0.05)

    def _tracing(self) -> bool:
        """perf has opened its events (it does so once it has attached to every thread)."""
        fd_dir = f"/proc/{self.proc.pid}/fd"
        try:
            return any("perf_event" in os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir))
        except OSError:
            return False

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        with open(self.out, encoding="utf-8", errors="replace") as f:
            return syscall_counts(f.read())


def syscall_counts(summary: str) -> dict[str, int]:
    """Calls by system call name, summed over the threads of a ``perf trace -s`` summary."""
    counts: collections.Counter[str] = collections.Counter()
    for m in re.finditer(r"^\s+([a-z_0-9]+)\s+(\d+)\s+\d+\s+[\d.]+\s", summary, re.MULTILINE):
        counts[m.group(1)] += int(m.group(2))
    return dict(counts.most_common())


class Sampler:
    """py-spy recording one process (and its threads) until stopped; ``None`` shares without py-spy."""

    def __init__(self, pid: int, out: str) -> None:
        self.out = out
        exe = shutil.which("py-spy")
        self.proc = None
        if exe is not None:
            self.proc = subprocess.Popen(
                [exe, "record", "-p", str(pid), "-r", str(SAMPLE_HZ), "--format", "raw", "-o", out, "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> dict[str, float] | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None
        try:
            with open(self.out, encoding="utf-8") as f:
                return phase_shares(f.read())
        except OSError:
            return None


# kvroute's path to the engine, as the frontend times it: the whole path (pipeline start to the body written
# to the engine), its tokenize step and its routing decision (histograms in ms; means from their sums)
PATH_HISTOGRAMS = {
    "to_engine": "kvroute_dispatch_path_ms",
    "tokenize": "dynamo_frontend_tokenizer_latency_ms",
    "route": "dynamo_router_overhead_total_ms",
}


def path_sums(metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of ``PATH_HISTOGRAMS`` on a kvroute frontend's /metrics (absent ones left out)."""
    text = httpx.get(metrics_url, timeout=10.0).text
    out = {}
    for key, name in PATH_HISTOGRAMS.items():
        total, count = read_counter(text, name + "_sum"), read_counter(text, name + "_count")
        if total is not None and count is not None:
            out[key] = (total, count)
    return out


EVENT_COUNTERS = {"event_batches": "kvroute_kv_event_batches_applied", "events": "kvroute_kv_events_received"}


def event_counts(metrics_url: str) -> dict[str, float]:
    """The KV-event batches applied and events received so far by a kvroute frontend's embedded indexer."""
    text = httpx.get(metrics_url, timeout=10.0).text
    return {key: read_counter(text, name) or 0.0 for key, name in EVENT_COUNTERS.items()}


def path_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms per observation of each path histogram between two ``path_sums``."""
    out = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            out[key] = round((total - total0) / (count - count0), 3)
    return out


def hf_tokenizer_dir(root: str) -> str:
    """The built-in tokenizer with Llama-3's split pattern (``\\p`` classes: the encoder's fast path takes ASCII
    text only, through the ``regex`` module)."""
    out = os.path.join(root, "hf-tokenizer")
    shutil.copytree(BUILTIN_TOKENIZER_DIR, out)
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    for pre in spec["pre_tokenizer"]["pretokenizers"]:
        if pre["type"] == "Split":
            pre["pattern"] = {"Regex": LLAMA3_PATTERN}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    return out


def pin(pids: Sequence[int], core: int) -> None:
    """Every thread of ``pids`` on ``core`` (taskset -a)."""
    for pid in pids:
        subprocess.run(["taskset", "-a", "-cp", str(core), str(pid)], check=False, capture_output=True)


def idle_cpu_ms_per_s(pid: int, seconds: float, settle: float = IDLE_SETTLE_S) -> float:
    """The router's CPU per second with no request in flight (its timers, health probes, metrics
    refreshes): part of every CPU-per-request figure, whatever the traffic. The window is the
    measurement itself (no condition to wait on); the ``settle`` seconds before it let start-up work end."""
    time.sleep(settle)
    r0, t0 = session_runtime_s(pid), time.monotonic()
    time.sleep(seconds)
    return 1000.0 * (session_runtime_s(pid) - r0) / (time.monotonic() - t0)


def engine_ttft(metrics_urls: Sequence[str]) -> list[tuple[float, float]]:
    """Each engine's own time-to-first-token histogram: (seconds, requests)."""
    out = []
    for url in metrics_urls:
        text = httpx.get(url, timeout=5.0).text
        out.append(
            (
                read_counter(text, "vllm:time_to_first_token_seconds_sum") or 0.0,
                read_counter(text, "vllm:time_to_first_token_seconds_count") or 0.0,
            )
        )
    return out


def workload(api: str, output_tokens: int) -> Workload:
    base = WORKLOADS["agentic-dense"]
    chat = api == "chat"
    groups = tuple(replace(g, api="chat" if chat else "completions", output_tokens=output_tokens) for g in base.groups)
    return Workload(f"{base.name}-{api}-{output_tokens}", groups)


def run_cell(
    spec: RouterSpec, tokenizer: str, api: str, output_tokens: int, concurrency: Sequence[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One router in front of fresh mockers, each concurrency level in turn with sessions of its own."""
    label = spec.label
    model_path = args.hf_dir if tokenizer == "hf" else None
    bed = Testbed(DEFAULT_MODEL, model_path or BUILTIN_TOKENIZER_DIR, model_path, BLOCK_SIZE)
    mocker = MockerOptions(
        block_size=BLOCK_SIZE, num_gpu_blocks=args.num_gpu_blocks, speedup_ratio=args.speedup_ratio,
        model_path=model_path,
    )  # fmt: skip
    rows = []
    tag = label.replace(" ", "").replace("(", "-").replace(")", "")
    cluster = Cluster(log_dir=os.path.join(args.out_dir, "logs", f"{tag}-{tokenizer}-{api}-{output_tokens}"))
    try:
        for _ in range(args.workers):
            cluster.start_mocker(mocker)
        cluster.wait_workers_ready(READY_TIMEOUT)
        url, metrics_url = start_router(cluster, spec, bed, args.bin_dir)
        frontend_metrics = (metrics_url or f"{url}/metrics") if spec.kind == "kvroute" else None
        assert cluster.frontend is not None
        pid = cluster.frontend.proc.pid
        if args.pin:
            pin([c for c in cluster.pids() if c != pid] + [os.getpid()], 0)
            pin([pid], 1)
        idle = round(idle_cpu_ms_per_s(pid, args.idle_seconds, args.idle_settle), 2) if args.idle_seconds > 0 else None
        for i, c in enumerate(concurrency):
            trace = session_trace(workload(api, output_tokens), seed=args.seed + 100 * i + 1, tokenizer_path=model_path)
            if args.requests:
                trace = replace(trace, requests=trace.requests[: args.requests])
            opts = RunOptions(workers=args.workers, max_concurrency=c, max_duration_s=600.0, model=DEFAULT_MODEL)
            sampler = (
                Sampler(pid, os.path.join(args.out_dir, f"{tag}-{tokenizer}-{api}-{output_tokens}-c{c}.txt"))
                if spec.kind == "kvroute" and args.profile
                else None
            )
            native = (
                NativeSampler(pid, os.path.join(args.out_dir, f"{tag}-{tokenizer}-{api}-{output_tokens}-c{c}.perf"))
                if args.native
                else None
            )
            syscalls = (
                SyscallCounter(pid, os.path.join(args.out_dir, f"{tag}-{tokenizer}-{api}-{output_tokens}-c{c}.trace"))
                if args.syscalls
                else None
            )
            engine_urls = [w.metrics_url for w in cluster.workers]
            load_before = round(os.getloadavg()[0], 1)
            e0 = engine_ttft(engine_urls)
            path0 = path_sums(frontend_metrics) if frontend_metrics else {}
            events0 = event_counts(frontend_metrics) if frontend_metrics else {}
            engine_pids = [c for c in cluster.pids() if c != pid]
            cpu0, switches0, t0 = session_cpu_s(pid), session_switches(pid), time.monotonic()
            engines0, client0 = sum(map(session_cpu_s, engine_pids)), time.process_time()
            row = measure(trace, url, label, engine_urls, opts, None)
            cpu, switches = session_cpu_s(pid) - cpu0, session_switches(pid) - switches0
            engines_cpu = sum(map(session_cpu_s, engine_pids)) - engines0
            client_cpu = time.process_time() - client0
            window_s = time.monotonic() - t0
            path = path_means(path0, path_sums(frontend_metrics)) if frontend_metrics else {}
            events = (
                {
                    k: round((v - events0[k]) / max(1, row["completed"]), 2)
                    for k, v in event_counts(frontend_metrics).items()
                }
                if frontend_metrics
                else None
            )
            each = [(s1 - s0, n1 - n0) for (s0, n0), (s1, n1) in zip(e0, engine_ttft(engine_urls), strict=True)]
            engine = 1000.0 * sum(s for s, _ in each) / max(1.0, sum(n for _, n in each))
            took = [n for _, n in each]
            shares = sampler.stop() if sampler is not None else None
            libraries = native.stop() if native is not None else None
            calls = syscalls.stop() if syscalls is not None else None
            per_request = 1000.0 * cpu / max(1, row["completed"])
            rows.append(
                {
                    "router": label,
                    "tokenizer": tokenizer,
                    "api": api,
                    "output_tokens": output_tokens,
                    "concurrency": c,
                    "pinned": bool(args.pin),
                    "requests": row["requests"],
                    "completed": row["completed"],
                    "hit_rate": row["hit_rate"],
                    "ttft_ms": [row["ttft_ms"][f"p{q}"] for q in (50, 90, 99)],
                    "ttft_mean_ms": row["ttft_mean_ms"],
                    # the client's mean TTFT less the engines': what the router adds before the first token
                    "ttft_added_ms": None if row["ttft_mean_ms"] is None else round(row["ttft_mean_ms"] - engine, 2),
                    # the engines' own mean TTFT, and the CPU the engines and the client spent per request: what
                    # a router's requests and responses cost the other side (the other core under --pin)
                    "engine_ttft_ms": round(engine, 2),
                    # per engine, the requests it took and its own mean TTFT: how evenly the decisions spread
                    "engines": [
                        {"requests": int(n), "ttft_ms": round(1000.0 * s / n, 2) if n else None} for s, n in each
                    ],
                    # the busiest engine's share of the requests and the engines that got none (a system
                    # prompt's sessions doubled up on one engine while another idled)
                    "busiest_engine_share": round(max(took, default=0) / max(1, sum(took)), 3),
                    "idle_engines": took.count(0),
                    "engines_cpu_ms_per_request": round(1000.0 * engines_cpu / max(1, row["completed"]), 2),
                    "client_cpu_ms_per_request": round(1000.0 * client_cpu / max(1, row["completed"]), 2),
                    "cpu_ms_per_request": round(per_request, 2),
                    # its CPU per second before any request, and the CPU per request above that rate over the window
                    "idle_cpu_ms_per_s": idle,
                    "cpu_above_idle_ms_per_request": (
                        None if idle is None else round(per_request - idle * window_s / max(1, row["completed"]), 2)
                    ),
                    # its threads' context switches: how often it slept and was woken again, per request
                    "switches_per_request": round(switches / max(1, row["completed"]), 1),
                    # kvroute: mean ms of its path to the engine, of its tokenize step and of its routing decision
                    "path_ms": path or None,
                    # kvroute: the KV-event batches it applied and the events in them, per request (each
                    # engine step that stores blocks publishes a batch: more engines stepping, more batches)
                    "kv_events_per_request": events,
                    "phases_ms_per_request": (
                        {k: round(v * per_request, 3) for k, v in shares.items()} if shares else None
                    ),
                    # --native: the same CPU by library below Python (perf)
                    "native_ms_per_request": (
                        {k: round(v * per_request, 3) for k, v in libraries.items()} if libraries else None
                    ),
                    # --syscalls: its system calls per request, all and by name (perf trace)
                    "syscalls_per_request": (
                        {
                            name: round(n / max(1, row["completed"]), 2)
                            for name, n in {"all": sum(calls.values()), **calls}.items()
                        }
                        if calls is not None
                        else None
                    ),
                    "loadavg_1m_before": load_before,
                    "loadavg_1m": round(os.getloadavg()[0], 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.stop()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    phases = [name for name, _ in PHASES] + ["other"]
    head = ["router", "tokenizer", "api", "out", "c", "pinned", "TTFT p50 / p90 / p99 ms", "TTFT added ms",
            "CPU ms / req", "idle CPU ms / s", "CPU above idle ms / req", "switches / req",
            "path to engine ms (tokenize / route)", "below Python ms (perf)", "system calls / req (perf trace)",
            *phases]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ph = r["phases_ms_per_request"] or {}
        ttft = " / ".join("-" if v is None else f"{v:g}" for v in r["ttft_ms"])
        path = r.get("path_ms") or {}
        to_engine = (
            f"{path['to_engine']:.2f} ({path.get('tokenize', 0.0):.2f} / {path.get('route', 0.0):.2f})"
            if "to_engine" in path
            else ""
        )
        native = ", ".join(f"{k} {v:.2f}" for k, v in (r.get("native_ms_per_request") or {}).items())
        calls = ", ".join(f"{k} {v:g}" for k, v in list((r.get("syscalls_per_request") or {}).items())[:6])
        switches = r.get("switches_per_request")
        cells = [r["router"], r["tokenizer"], r["api"], str(r["output_tokens"]), str(r["concurrency"]),
                 "yes" if r["pinned"] else "no", ttft, f"{r['ttft_added_ms']}", f"{r['cpu_ms_per_request']:.2f}",
                 _fmt(r.get("idle_cpu_ms_per_s")), _fmt(r.get("cpu_above_idle_ms_per_request")),
                 "" if switches is None else f"{switches:g}", to_engine, native, calls,
                 *(f"{ph[p]:.2f}" if p in ph else "" for p in phases)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def runs_report(rows: Sequence[dict[str, Any]], command: str, engines: int) -> str:
    """Per cell (tokenizer, API, output length, concurrency) over the runs: each router's median figures
    with their min-max, and kvroute ``latency`` against each router as the median of the per-run ratios."""
    cells: dict[tuple, dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["tokenizer"], r["api"], r["output_tokens"], r["concurrency"], r["pinned"])
        cells.setdefault(key, {}).setdefault(r["run"], []).append(r)
    parts = []
    for (tokenizer, api, out, c, pinned), by_run in cells.items():
        setup = f"{engines} mockers, {tokenizer} tokenizer, {api}, {out} output tokens, {c} in flight" + (
            ", the router alone on core 1" if pinned else ""
        )
        runs = [
            {
                "workload": "agentic-dense",
                "testbed": "mocker",
                "setup": setup,
                "command": command,
                "machine": {"load_before": ms[0]["loadavg_1m_before"]},
                "routers": [
                    {
                        "router": m["router"],
                        "hit_rate": m["hit_rate"],
                        "ttft_ms": dict(zip(("p50", "p90", "p99"), m["ttft_ms"], strict=True)),
                        "router_cpu_ms_per_request": m["cpu_ms_per_request"],
                        "router_cpu_above_idle_ms_per_request": m.get("cpu_above_idle_ms_per_request"),
                    }
                    for m in ms
                ],
            }
            for _, ms in sorted(by_run.items())
        ]
        parts.append(runs_markdown(runs))
        cell_rows = [r for rs in by_run.values() for r in rs]
        parts.append(_idle_table(cell_rows))
        parts.append(_ttft_split_table(cell_rows))
    return "\n".join(parts)


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _median_table(rows: Sequence[dict[str, Any]], title: str, columns: Sequence[tuple[str, str]]) -> str:
    """Per router, the median (min-max) over the runs of each ``(header, row key)`` column; the rows without
    every key (another router kind, an option not used) are left out, and no table when none has them."""
    by_router: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if all(r.get(key) is not None for _, key in columns):
            by_router.setdefault(r["router"], []).append(r)
    if not by_router:
        return ""
    lines = [
        "",
        title,
        "",
        "| router | " + " | ".join(h for h, _ in columns) + " |",
        "|" + " --- |" * (1 + len(columns)),
    ]
    for router, rs in by_router.items():
        lines.append(f"| {router} | " + " | ".join(_spread([r[key] for r in rs]) for _, key in columns) + " |")
    return "\n".join(lines) + "\n"


def _idle_table(rows: Sequence[dict[str, Any]]) -> str:
    """Each router's idle CPU and its CPU per request above it."""
    return _median_table(
        rows,
        "Idle CPU (before the first request) and CPU per request above it, median (min-max) over the runs:",
        [
            ("idle CPU ms / s", "idle_cpu_ms_per_s"),
            ("CPU ms / request", "cpu_ms_per_request"),
            ("CPU above idle ms / request", "cpu_above_idle_ms_per_request"),
        ],
    )


def _ttft_split_table(rows: Sequence[dict[str, Any]]) -> str:
    """Each router's mean TTFT split into the engines' own TTFT and what the router added, beside the CPU
    the engines and the client spent per request: a TTFT gap between routers is either the router's path
    or the engines' queues its decisions built (how evenly: the busiest engine's share, engines left idle)."""
    return _median_table(
        rows,
        "The mean TTFT split into the engines' own and the router's addition, the CPU the engines and the "
        "client spent per request, and how the requests spread over the engines, median (min-max) over the runs:",
        [
            ("TTFT mean ms", "ttft_mean_ms"),
            ("engines' TTFT ms", "engine_ttft_ms"),
            ("added by the router ms", "ttft_added_ms"),
            ("engines' CPU ms / request", "engines_cpu_ms_per_request"),
            ("client CPU ms / request", "client_cpu_ms_per_request"),
            ("busiest engine's share of requests", "busiest_engine_share"),
            ("engines without a request", "idle_engines"),
        ],
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench data_path", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--routers", default="kvroute-latency", help=f"comma-separated, from {', '.join(ROUTERS)}")
    p.add_argument("--tokenizers", default="builtin,hf")
    p.add_argument("--apis", default="completions,chat")
    p.add_argument("--output-tokens", default="16")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=0, help="at most this many requests per level (0 = all 288)")
    p.add_argument("--pin", action="store_true", help="the router on core 1, engines and client on core 0")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the py-spy phase profile")
    p.add_argument("--native", action="store_true",
                   help="record each router with perf (cpu-clock) over each measured window: its CPU per "
                   "request by library below Python (interpreter, kernel, libc, uvloop, ...); needs perf and "
                   "--no-profile")  # fmt: skip
    p.add_argument("--syscalls", action="store_true",
                   help="trace each router with perf trace over each measured window: its system calls per "
                   "request, by name (perf's own cost is then in the CPU figures); needs perf")  # fmt: skip
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--speedup-ratio", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--bin-dir", default=None, help="the peers' bin directory (default: $KVROUTE_PEERS_BIN)")
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="seconds each router's idle CPU is measured for, before its first request (0: not measured)",
    )
    p.add_argument(
        "--idle-settle",
        type=float,
        default=IDLE_SETTLE_S,
        help="seconds after a router is ready before its idle CPU is measured (its start-up work ends) [%(default)s]",
    )
    p.add_argument("--runs", type=int, default=1,
                   help="runs of every cell, the routers' order rotated each run, with medians and "
                   "per-run ratios")  # fmt: skip
    p.add_argument("--out-dir", default="bench/out/data_path")
    p.add_argument("--before", default=None,
                   help="another checkout of kvroute (git worktree add DIR REV): each kvroute row also runs with its "
                   "frontend, just before this checkout's, in the same run")  # fmt: skip
    p.add_argument("--python", default=None, metavar="NAME=PATH", help=PYTHON_HELP)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    specs = router_specs(args.routers, args.before, args.python)
    args.bin_dir = peers_bin(args.bin_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    if args.native and args.profile:
        raise SystemExit("--native needs --no-profile (py-spy's sampling would be in perf's figures)")
    if (args.native or args.syscalls) and shutil.which("perf") is None:
        raise SystemExit("--native needs perf (Debian: apt-get install linux-perf)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-data-path-") as tmp:
        args.hf_dir = hf_tokenizer_dir(tmp)
        for run in range(1, args.runs + 1):
            order = specs[(run - 1) % len(specs) :] + specs[: (run - 1) % len(specs)]
            for tokenizer in args.tokenizers.split(","):
                for api in args.apis.split(","):
                    for out in (int(x) for x in args.output_tokens.split(",")):
                        for spec in order:
                            rows += [dict(r, run=run) for r in run_cell(spec, tokenizer, api, out, concurrency, args)]
    command = "python -m bench data_path " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n{table(rows)}\n"
    if args.runs > 1:
        text += "\n" + runs_report(rows, command, args.workers)
    with open(os.path.join(args.out_dir, "data_path.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out_dir, "data_path.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0
