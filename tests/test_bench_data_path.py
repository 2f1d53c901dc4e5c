"""bench data_path: its phase attribution and a short run through a real frontend and mockers."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

from bench import data_path


def test_a_sample_belongs_to_the_phase_of_its_innermost_known_frame() -> None:
    root = "_run_module_as_main (<frozen runpy>:198);Runner.run (asyncio/runners.py:118)"
    assert data_path.phase_of(root) == "loop"
    relay = root + ";StreamProxy._pump (frontend/dispatch/proxy.py:172)"
    assert data_path.phase_of(relay) == "relay"
    assert data_path.phase_of(relay + ";MutexValue.inc (prometheus_client/values.py:28)") == "metrics"
    assert data_path.phase_of(root + ";RequestPath._pipeline (frontend/dispatch/request_path.py:1)") == "request"
    assert data_path.phase_of("main (somewhere.py:1)") == "other"
    raw = f"{relay} 3\n{root} 1\n"
    assert data_path.phase_shares(raw) == {"relay": 0.75, "loop": 0.25}


def test_perfs_shared_objects_are_grouped_by_library() -> None:
    report = """# Samples: 1K of event 'cpu-clock'
# Overhead  Shared Object
#
    50.00%  /usr/lib/libpython3.11.so.1.0
    25.00%  [kernel.kallsyms]
     5.00%  /usr/lib/x86_64-linux-gnu/libc.so.6
     5.00%  /venv/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so
     5.00%  /venv/site-packages/httptools/parser/parser.cpython-311-x86_64-linux-gnu.so
     2.50%  /venv/site-packages/pyzmq.libs/libzmq-2f02442c.so.5.2.5
     2.50%  /venv/site-packages/orjson/orjson.cpython-311-x86_64-linux-gnu.so
     5.00%  /venv/site-packages/xxhash/_xxhash.cpython-311-x86_64-linux-gnu.so
"""
    assert data_path.native_shares(report) == {
        "interpreter": 0.5, "kernel": 0.25, "libc": 0.05, "uvloop": 0.05, "httptools": 0.05, "other": 0.05,
        "zmq": 0.025, "json": 0.025,
    }  # fmt: skip
    assert data_path.native_shares("# nothing sampled\n") == {}
    rust = "    60.00%  /venv/site-packages/smg/smg_rs.abi3.so\n    40.00%  [kernel.kallsyms]\n"
    assert data_path.native_shares(rust) == {"rust router": 0.6, "kernel": 0.4}


def test_perf_traces_summary_is_counted_by_system_call_over_all_threads() -> None:
    summary = """
 Summary of events:

 python (4593), 42138 events, 100.0%

   syscall            calls  errors  total       min       avg       max       stddev
                                     (msec)    (msec)    (msec)    (msec)        (%)
   --------------- --------  ------ -------- --------- --------- ---------     ------
   epoll_pwait         6832      0 12845.095     0.000     1.880   435.546      7.02%
   write               6087      0    88.839     0.003     0.015     0.115      0.77%
   connect               12     12     0.819     0.059     0.068     0.088      3.36%


 smg::router (4648), 80 events, 0.1%

   syscall            calls  errors  total       min       avg       max       stddev
                                     (msec)    (msec)    (msec)    (msec)        (%)
   --------------- --------  ------ -------- --------- --------- ---------     ------
   write                 40      0     0.539     0.003     0.013     0.089      0.73%
"""
    assert data_path.syscall_counts(summary) == {"epoll_pwait": 6832, "write": 6127, "connect": 12}
    assert data_path.syscall_counts(" Summary of events:\n") == {}


def test_path_means_are_the_histograms_growth_between_two_scrapes() -> None:
    before = {"to_engine": (10.0, 4.0), "tokenize": (2.0, 4.0)}
    after = {"to_engine": (16.0, 6.0), "tokenize": (2.0, 4.0), "route": (1.5, 3.0)}
    assert data_path.path_means(before, after) == {"to_engine": 3.0, "route": 0.5}  # tokenize: no new requests


def test_a_short_run_reports_cpu_ttft_and_time_added(tmp_path) -> None:
    """Two routers, two runs, kvroute also on another interpreter (``--python``): every cell's row is complete
    (with the CPU by library, ``--native``), the routers' order is rotated each run, the ``[NAME]`` row's
    frontend ran on that interpreter, and the report gives both kvroute rows' per-run ratios."""
    out = str(tmp_path)
    # the other interpreter: this one behind a script that leaves a mark of what it was asked to run
    mark = tmp_path / "ran"
    other = tmp_path / "other-python"
    other.write_text(f'#!/bin/sh\necho "$@" >> {mark}\nexec {sys.executable} "$@"\n')
    other.chmod(0o755)
    argv = ["--routers", "kvroute-latency,round_robin", "--runs", "2", "--tokenizers", "builtin",
            "--apis", "completions", "--concurrency", "2", "--requests", "12", "--workers", "2",
            "--no-profile", "--native", "--syscalls", "--python", f"other={other}", "--idle-seconds", "0.5",
            "--idle-settle", "0.2", "--out-dir", out]  # fmt: skip
    assert data_path.main(argv) == 0
    with open(os.path.join(out, "data_path.json"), encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    ours, theirs, rr = "kvroute-latency", "kvroute-latency [other]", "round_robin"  # round robin is kvroute's too
    assert [(r["run"], r["router"]) for r in rows] == [
        (1, ours), (1, theirs), (1, rr), (1, f"{rr} [other]"), (2, theirs), (2, rr), (2, f"{rr} [other]"), (2, ours),
    ]  # fmt: skip
    started = mark.read_text().splitlines()
    assert len(started) == 4 and all(line.startswith("-m frontend ") for line in started)  # the [other] rows
    for row in rows:
        assert row["completed"] == row["requests"] == 12
        assert row["cpu_ms_per_request"] > 0 and row["ttft_added_ms"] is not None
        # the mean TTFT is the engines' own plus what the router added; the engines and the client worked
        assert 0 < row["engine_ttft_ms"] < row["ttft_mean_ms"]
        assert abs(row["engine_ttft_ms"] + row["ttft_added_ms"] - row["ttft_mean_ms"]) <= 0.02
        assert row["engines_cpu_ms_per_request"] > 0 and row["client_cpu_ms_per_request"] > 0
        assert len(row["engines"]) == 2 and sum(e["requests"] for e in row["engines"]) == 12
        took = [e["requests"] for e in row["engines"]]
        assert row["busiest_engine_share"] == round(max(took) / 12, 3) >= 0.5
        assert row["idle_engines"] == took.count(0)
        # idle: a router in front of two idle mockers (its probes and timers) uses under a tenth of a core
        assert 0 <= row["idle_cpu_ms_per_s"] < 100
        assert row["cpu_above_idle_ms_per_request"] <= row["cpu_ms_per_request"]
        assert row["switches_per_request"] >= 1  # a request wakes the router at least once
        p50, p90, p99 = row["ttft_ms"]
        assert 0 < p50 <= p90 <= p99
        # the frontend's own timing of its path to the engine holds its tokenize step and routing decision
        path = row["path_ms"]
        assert set(path) == {"to_engine", "tokenize", "route"}
        assert path["to_engine"] >= path["tokenize"] + path["route"] > 0
        # latency mode's embedded indexer applied the engines' KV-event batches (prefills store blocks);
        # round robin subscribes to none
        events = row["kv_events_per_request"]
        if row["router"].startswith(rr):
            assert events == {"event_batches": 0.0, "events": 0.0}
        else:
            assert events["events"] >= events["event_batches"] > 0
        # --native: the same CPU by library below Python, from perf (the interpreter's share is never nothing)
        native = row["native_ms_per_request"]
        assert native["interpreter"] > 0 and min(native.values()) >= 0  # a group of one sample can round to 0
        assert abs(sum(native.values()) - row["cpu_ms_per_request"]) <= 0.01 * len(native)
        # --syscalls: each request was read from the client and its answer written back, at least
        calls = row["syscalls_per_request"]
        assert calls["all"] >= calls["read"] + calls["write"] and calls["read"] >= 1 and calls["write"] >= 1
    with open(os.path.join(out, "data_path.md"), encoding="utf-8") as f:
        report = f.read()
    assert "2 runs, the routers' order rotated" in report
    assert "| router | idle CPU ms / s | CPU ms / request | CPU above idle ms / request |" in report
    split = report.split("| router | TTFT mean ms | engines' TTFT ms | added by the router ms |")[1].split("\n\n")[0]
    ours_split = [line for line in split.splitlines() if line.startswith(f"| {ours} | ")]
    assert len(ours_split) == 1 and ours_split[0].count(" (") == 7  # seven medians, each with its range
    assert f"`{ours}` against each router" in report and f"`{theirs}` against each router" in report
    ratios = [line for line in report.splitlines() if line.startswith("| round_robin |") and "x (" in line]
    assert len(ratios) == 2  # each kvroute latency row against round robin
    for line in ratios:
        # TTFT p50, p90, p99, CPU and CPU above idle: median (min-max) of the two runs' ratios
        assert line.count("x (") == 5


@contextlib.contextmanager
def _thread_that_worked(work: str, done: str) -> Iterator[int]:
    """A process in a session of its own whose second thread ran ``work`` (Python lines), printed ``done``
    and still lives (its threads' figures are read while it does); yields its pid, ends it after."""
    import subprocess

    body = "".join(f"    {line}\n" for line in work.splitlines())
    code = (
        "import sys, threading, time\n"
        "go = threading.Event()\n"
        f"def work():\n{body}"
        f"    print({done!r}, flush=True); go.wait()\n"
        "threading.Thread(target=work).start(); sys.stdin.readline(); go.set()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == done + "\n"
        yield proc.pid
    finally:
        proc.communicate("\n", timeout=30)


def test_a_sessions_context_switches_count_every_thread_that_slept() -> None:
    """``session_switches``: a process in a session of its own whose second thread has slept 200 times (and
    still runs) counts at least those 200 switches."""
    from kvroute_common.processes import session_switches

    with _thread_that_worked("for _ in range(200): time.sleep(0.0005)", "slept") as pid:
        assert session_switches(pid) >= 200
        assert session_switches(os.getpid() + 10**7) == 0  # no such session: nothing counted


def test_a_sessions_runtime_counts_a_threads_cpu_to_the_microsecond() -> None:
    """``session_runtime_s`` (schedstat): a process whose second thread spun for 0.2 s of CPU (and still lives)
    is counted at least that, and at most what the whole process spent (``session_cpu_s``, 10 ms ticks) plus
    a tick."""
    from kvroute_common.processes import session_cpu_s, session_runtime_s

    spin = "t = time.thread_time()\nwhile time.thread_time() - t < 0.2: pass"
    with _thread_that_worked(spin, "spun") as pid:
        assert 0.2 <= session_runtime_s(pid) <= session_cpu_s(pid) + 0.02
        assert session_runtime_s(os.getpid() + 10**7) == 0  # no such session: nothing counted
