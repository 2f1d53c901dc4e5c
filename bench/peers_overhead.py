"""What each router adds per request, and what it costs, in front of engines that cost nothing.

    python -m bench peers_overhead                     # ~4 min: every router of the peers benchmark
    python -m bench peers_overhead --routers kvroute-latency,vllm-kv_aware --duration 20

The engines are nginx answering the completion and chat routes with a canned vLLM-shaped stream
(``bench/frontend_scale.py``: a few microseconds of CPU per request), so the time and CPU measured are
the router's. Each router of ``python -m bench peers`` (same binaries, same flags) runs alone in front of
them, and ``wrk`` replays a peers workload's requests (``agentic`` by default: the sessions' turns in
order, each prompt the whole session so far) over and over. Every pass through the schedule is made new:
every message's text carries a mark at its start, before a word every ``MARK_EVERY`` characters and at its end,
which wrk replaces with the run's id and the pass number, so each pass's texts are new to a router, down
to every piece its tokenizer could have cached (kvroute caches the token ids of text chunks of 512
characters and more, and of whole segments of 256 and more: each holds a mark). Within a pass a session's
turns repeat its earlier turns marked alike, as in a real run.

Per router: latency p50 / p90 / p99 with one request at a time (``wrk -c1``: the time the router adds
to a request, no queueing), the router's CPU per request there (its whole process tree, from /proc),
req/s and latency with ``--connections`` in flight (default 16) and the CPU per request under that load,
and the router's own tokenizer wall time per request where it exports it. The ``direct`` row is the
engines without a router: the floor. Engines publish KV event sockets that stay silent, so the KV-aware
routers run with empty indexes (the cost of applying events is not in these figures). The vLLM router's
``kv_aware`` does not tokenize: it asks the engines (vLLM's render routes; ``/tokenize`` on the mocker),
each of them, for every request; here they answer canned ids of the schedule's mean prompt length, so
its figures hold those round trips and the hashing of the ids but not the tokenization (engine CPU).
Figures: docs/benchmarks.md. Nothing here asserts: benchmarks measure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from bench.frontend_scale import MODEL, NginxUpstream, cpu_seconds, run_wrk_script
from bench.gateway import _ms
from bench.peers import DEFAULT_ROUTERS, ROUTERS, RouterSpec, Testbed, peers_bin, router_metrics, start_router
from bench.sessions import WORKLOADS, session_trace
from bench.traces import Trace
from kvroute_common.local_cluster import Child, Cluster, Worker
from kvroute_common.processes import session_cpu_s
from kvroute_common.tokenizer import BUILTIN_TOKENIZER_DIR

PASS_MARK = "@@pass@@"  # replaced by wrk with the run's id and the pass number
# a mark at least this often: below kvroute's smallest cached text (a 256-character segment)
MARK_EVERY = 200

# Each wrk run loads the schedule (a route and a body per line) and sends it in order, again and
# again; every pass puts its own id where the marks are, so its texts are new to the router.
_LUA = """
local lines = {}
for line in io.lines(%(path)s) do
  local tab = line:find("\\t", 1, true)
  lines[#lines + 1] = {line:sub(1, tab - 1), line:sub(tab + 1)}
end
local i, pass = 0, 0
local headers = {["Content-Type"] = "application/json"}
request = function()
  if i == #lines then i, pass = 0, pass + 1 end
  i = i + 1
  local body = lines[i][2]:gsub(%(mark)s, %(run)s .. "-" .. pass)
  return wrk.format("POST", lines[i][1], headers, body)
end
"""


def marked(text: str) -> str:
    """``text`` with ``PASS_MARK`` at its start, before the first word at least ``MARK_EVERY`` characters after
    the previous mark, and at its end (a tokenizer's last chunk of a text ends with the text, so it is never
    reused by a longer one). Where the inner marks go depends only on the text before them, so a session's
    later prompt, which starts with an earlier one, carries the same marks there."""
    out = [PASS_MARK, " "]
    last = 0
    while (at := text.find(" ", last + MARK_EVERY)) >= 0:
        out += (text[last:at], " ", PASS_MARK)
        last = at
    out += (text[last:], " ", PASS_MARK)
    return "".join(out)


def _marked_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": marked(content)}
    if isinstance(content, list):
        parts = [{**p, "text": marked(p["text"])} if p.get("type") == "text" else p for p in content]
        return {**message, "content": parts}
    return message


def schedule_lines(trace: Trace, model: str) -> list[str]:
    """The trace's requests as ``route<TAB>body`` lines, streamed, every text marked (``marked``)."""
    lines = []
    for r in trace.requests:
        body: dict[str, Any] = {"model": model, "max_tokens": r.max_tokens, "stream": True}
        if r.messages:
            body["messages"] = [_marked_message(m) for m in r.messages]
            route = "/v1/chat/completions"
        else:
            assert r.text is not None, "the peers' workloads send text"
            body["prompt"], route = marked(r.text), "/v1/completions"
        lines.append(f"{route}\t{json.dumps(body, separators=(',', ':'))}")
    return lines


class SilentEngines:
    """nginx engines, each with a bound ZMQ publisher that never sends: what the KV-aware routers
    subscribe to."""

    def __init__(self, engines: int, render_tokens: int) -> None:
        self.nginx = NginxUpstream(engines, render_tokens)
        self.ctx = zmq.Context()
        self.publishers = []
        for _ in range(engines):
            sock = self.ctx.socket(zmq.PUB)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.publishers.append((sock, f"tcp://127.0.0.1:{port}"))

    def workers(self) -> list[Worker]:
        child = Child("nginx", self.nginx.proc, os.path.join(self.nginx.tmp, "error.log"))
        return [
            Worker(i, f"http://127.0.0.1:{port}", 1, endpoint, None, child)
            for i, (port, (_, endpoint)) in enumerate(zip(self.nginx.ports, self.publishers, strict=True), 1)
        ]

    def close(self) -> None:
        for sock, _ in self.publishers:
            sock.close(0)
        self.ctx.term()
        self.nginx.close()


def measure(url: str, schedule: str, cpu: Callable[[], float], duration: float, connections: int) -> dict[str, Any]:
    """One router (or the engines directly): warm-up, one request at a time, then ``connections``."""

    def wrk(seconds: float, conns: int) -> tuple[float, dict[str, Any], int, float]:
        script = _LUA % {
            "path": json.dumps(schedule),
            "mark": json.dumps(PASS_MARK),
            "run": json.dumps(uuid.uuid4().hex[:8]),
        }
        c0 = cpu()
        rps, lat, errors = run_wrk_script(url, script, seconds, conns, 1)
        return rps, lat, errors, (cpu() - c0) * 1e3 / max(1.0, rps * seconds)

    wrk(2.0, 1)  # warm-up: connections, tokenizer, first-request costs
    _, quiet, errors_quiet, cpu_quiet = wrk(duration, 1)
    rps, loaded, errors, cpu_loaded = wrk(duration, connections)
    q, lo = quiet["latency"], loaded["latency"]
    return {
        "p50_ms": _ms(q.get("50", "0")),
        "p90_ms": _ms(q.get("90", "0")),
        "p99_ms": _ms(q.get("99", "0")),
        "cpu_ms_per_request": round(cpu_quiet, 3),
        "rps_loaded": round(rps, 1),
        "p50_ms_loaded": _ms(lo.get("50", "0")),
        "p99_ms_loaded": _ms(lo.get("99", "0")),
        "cpu_ms_per_request_loaded": round(cpu_loaded, 3),
        "non_2xx": errors + errors_quiet,
    }


def run(
    specs: Sequence[RouterSpec], workload: str, duration: float, connections: int, engines: int, bin_dir: str | None
) -> list[dict[str, Any]]:
    """The direct row, then every router in turn in front of the same silent engines."""
    trace = session_trace(WORKLOADS[workload])
    bed = Testbed(MODEL, BUILTIN_TOKENIZER_DIR, None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-peers-overhead-") as tmp:
        schedule = os.path.join(tmp, "schedule.tsv")
        with open(schedule, "w", encoding="utf-8") as f:
            f.write("\n".join(schedule_lines(trace, MODEL)) + "\n")
        mean_prompt = round(sum(len(r.tokens) for r in trace.requests) / len(trace.requests))
        upstream = SilentEngines(engines, mean_prompt)
        try:
            workers = upstream.workers()

            def nginx_cpu() -> float:
                return sum(map(cpu_seconds, upstream.nginx.pids()))

            row = measure(workers[0].url, schedule, nginx_cpu, duration, connections)
            rows.append({"router": "direct", "command": "the first engine itself", **row, "loadavg_1m": _load()})
            print(json.dumps(rows[-1]), flush=True)
            for spec in specs:
                cluster = Cluster(log_dir=os.path.join(tmp, "logs", spec.label))
                cluster.workers = list(workers)  # the cluster empties its list when it stops
                try:
                    url, metrics_url = start_router(cluster, spec, bed, bin_dir)
                    assert cluster.frontend is not None
                    pid = cluster.frontend.proc.pid
                    t0 = time.perf_counter()
                    row = measure(url, schedule, functools.partial(session_cpu_s, pid), duration, connections)
                    requests = row["rps_loaded"] * duration  # the tokenizer histogram covers every run
                    tok, counters = router_metrics(spec, metrics_url, int(requests))
                    row["tokenizer_ms_per_request"], row["router_counters"] = tok, counters
                    row["wall_s"] = round(time.perf_counter() - t0, 1)
                finally:
                    cluster.stop()
                rows.append({"router": spec.label, "command": spec.describe(), **row, "loadavg_1m": _load()})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            upstream.close()
    return rows


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def table(rows: Sequence[dict[str, Any]]) -> str:
    direct = rows[0]
    lines = [
        "| router | one at a time: p50 / p90 / p99 ms | added p50 ms | CPU ms / request | "
        "at load: req/s, p50 / p99 ms | CPU ms / request at load | non-2xx | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        added = "" if r is direct else f"{r['p50_ms'] - direct['p50_ms']:.2f}"
        lines.append(
            f"| {r['router']} | {r['p50_ms']:g} / {r['p90_ms']:g} / {r['p99_ms']:g} | {added} "
            f"| {r['cpu_ms_per_request']:g} | {r['rps_loaded']:g}, {r['p50_ms_loaded']:g} / {r['p99_ms_loaded']:g} "
            f"| {r['cpu_ms_per_request_loaded']:g} | {r['non_2xx']} | {r['loadavg_1m']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench peers_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help="comma-separated rows of bench peers")
    p.add_argument("--workload", default="agentic", choices=sorted(WORKLOADS))
    p.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run [10]")
    p.add_argument("--connections", type=int, default=16, help="requests in flight for the loaded run [16]")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--bin-dir", default=None, help="the peers' bin directory (default: $KVROUTE_PEERS_BIN)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    labels = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in labels if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; choose from {', '.join(ROUTERS)}")
    rows = run([ROUTERS[r] for r in labels], args.workload, args.duration, args.connections, args.engines,
               peers_bin(args.bin_dir))  # fmt: skip
    print()
    print(table(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
