"""What a thread running Python code costs the event loop's socket calls, by GIL switch interval.

    python -m bench gil_handback                       # CPython's 5 ms against the frontend's 0.5 ms
    python -m bench gil_handback --intervals 5,1,0.5 --rounds 3

The frontend's tokenizer threads run Python code for long prompts (their block hashes, the chat
template's render) while the loop serves other requests. The loop gives the GIL up at every socket
call (send, recv, epoll) and, while such a thread is running, gets it back only when the thread is
made to drop it: after the switch interval. Here the main thread makes socket round trips to an echo
process while a thread hashes a 128 k-token prompt over and over (the frontend's own hashing code);
reported is the round trip's latency per switch interval (the intervals alternate within one run).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import threading
import time
from array import array
from typing import Any

from bench.report import emit
from kvroute_common.hashing import local_block_hashes, sequence_hashes


def _hash_forever(tokens: array, stop: threading.Event) -> None:
    while not stop.is_set():
        sequence_hashes(local_block_hashes(tokens, 16))


def _echo(sock: socket.socket) -> None:
    while data := sock.recv(64):
        sock.send(data)


def _round_trips(interval_ms: float, n: int, tokens: array) -> dict[str, Any]:
    """``n`` socket round trips (0.5 ms apart) beside a hashing thread, at this switch interval."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1000)
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo side: another process, so only this process's GIL is measured
        ours.close()
        _echo(theirs)
        os._exit(0)
    theirs.close()
    stop = threading.Event()
    worker = threading.Thread(target=_hash_forever, args=(tokens, stop))
    worker.start()
    ms: list[float] = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            ours.send(b"x")
            ours.recv(64)
            ms.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.0005)
    finally:
        stop.set()
        worker.join()
        ours.close()
        os.waitpid(pid, 0)
        sys.setswitchinterval(before)
    ms.sort()
    return {
        "switch_interval_ms": interval_ms,
        "p50": round(ms[n // 2], 2),
        "p90": round(ms[int(n * 0.9)], 2),
        "p99": round(ms[int(n * 0.99)], 2),
        "max": round(ms[-1], 1),
        "mean": round(statistics.fmean(ms), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench gil_handback", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--intervals", default="5,0.5", help="switch intervals to compare, ms [5,0.5]")
    ap.add_argument("--rounds", type=int, default=2, help="times each interval is measured, alternating [2]")
    ap.add_argument("--n", type=int, default=3000, help="round trips per measurement [3000]")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    tokens = array("I", (rng.randrange(50_000) for _ in range(128_000)))
    result: dict[str, Any] = {"load_average": os.getloadavg(), "runs": []}
    for _ in range(args.rounds):
        for interval in (float(x) for x in args.intervals.split(",")):
            run = _round_trips(interval, args.n, tokens)
            print(run, flush=True)
            result["runs"].append(run)
    result["load_average_after"] = os.getloadavg()
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
