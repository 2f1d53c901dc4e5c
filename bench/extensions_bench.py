"""Per-request cost of the request extensions on the frontend's hot path.

    python -m bench extensions_bench [--n 200000]

Measures (µs per call, best of 3 rounds, one core): ``parse_request_hints`` for a plain request
(no nvext, typical OpenAI SDK headers), for one with nvext + routing headers + a session header,
``engine_priority``, a session-affinity lease + bind + release, and a router-queue push + pop.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from starlette.datastructures import Headers

from frontend.request.hints import engine_priority, parse_request_hints
from router.queue import PendingQueue
from router.session import SessionTable

SDK_HEADERS = {
    "host": "127.0.0.1:8000",
    "accept-encoding": "gzip, deflate",
    "connection": "keep-alive",
    "accept": "application/json",
    "content-type": "application/json",
    "user-agent": "OpenAI/Python 1.99.0",
    "x-stainless-lang": "python",
    "x-stainless-package-version": "1.99.0",
    "x-stainless-os": "Linux",
    "x-stainless-arch": "x64",
    "x-stainless-runtime": "CPython",
    "x-stainless-runtime-version": "3.11.7",
    "authorization": "Bearer unused",
    "x-stainless-async": "false",
    "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "600",
    "content-length": "120",
}


def timed(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench extensions_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    args = ap.parse_args(argv)
    n = args.n

    plain_headers = Headers(SDK_HEADERS)
    rich_headers = Headers(
        {
            **SDK_HEADERS,
            "x-dynamo-worker-instance-id": "3",
            "x-dynamo-dp-rank": "1",
            "x-dynamo-request-priority": "5",
            "x-dynamo-session-id": "session-0123456789",
        }
    )
    nvext = {
        "agent_hints": {"priority": 2, "osl": 256, "speculative_prefill": True},
        "extra_fields": ["worker_id", "timing"],
    }

    def plain() -> None:
        parse_request_hints({"model": "m", "messages": []}, plain_headers)

    def rich() -> None:
        parse_request_hints({"model": "m", "messages": [], "nvext": dict(nvext)}, rich_headers)

    hints = parse_request_hints({"model": "m", "nvext": dict(nvext)}, rich_headers)
    table = SessionTable(300)
    sids = [f"s{i}" for i in range(1024)]
    i = 0

    def session() -> None:
        nonlocal i
        lease = table.lease("m", sids[i & 1023])
        i += 1
        if lease.target is None:
            lease.bind(1, 0)
        lease.release()

    q: PendingQueue[int] = PendingQueue("fcfs")
    for k in range(256):  # a standing backlog
        q.push(k, float(k))
    t = [256.0]

    def queue() -> None:
        t[0] += 1.0
        q.push(0, t[0], priority_jump=1.0)
        q.pop()

    rows = [
        ("parse_request_hints: no nvext, SDK headers", timed(plain, n)),
        ("parse_request_hints: nvext + routing + session headers", timed(rich, n)),
        ("engine_priority", timed(lambda: engine_priority(hints), n)),
        ("session lease + bind + release (1024 sessions)", timed(session, n)),
        ("router queue push + pop (backlog 256)", timed(queue, n)),
    ]
    width = max(len(r[0]) for r in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
