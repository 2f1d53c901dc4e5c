"""Running our services as real child processes and waiting on conditions with a deadline: shared by
the tests and the benchmarks (which must not import the test tree).

Nothing here sleeps to synchronise: callers poll a condition until a deadline (``wait_until``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import httpx

T = TypeVar("T")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the condition may not be checkable yet (server starting)
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else "")
            )
        time.sleep(interval)


def http_ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        return httpx.get(url, timeout=1.0).status_code < 500

    return check


@contextlib.contextmanager
def service(
    args: Sequence[str],
    ready_url: str | None = None,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    ready: Callable[[], object] | None = None,
    log_path: str | None = None,
) -> Iterator[subprocess.Popen]:
    """Run ``python <args>`` as a real process until the block ends; wait for ``ready_url``.

    Output goes to a temporary log (or ``log_path``, for tests that read it) that is printed if
    start-up fails, so a failing test says why.
    """
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    log = open(log_path or (os.devnull if os.environ.get("KVROUTE_TEST_QUIET") else _log_path(args)), "w+b")
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        check = ready or (http_ready(ready_url) if ready_url else None)
        if check is not None:
            try:
                wait_until(
                    lambda: proc.poll() is not None or check(), timeout=timeout, what=f"{' '.join(args)} to start"
                )
            except TimeoutError:
                raise RuntimeError(f"{' '.join(args)} did not become ready:\n{_tail(log)}") from None
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{_tail(log)}")
        yield proc
    finally:
        stop_process(proc)
        log.close()


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) spent so far by session ``sid``'s live processes, their descendants
    in sessions of their own (``python -m frontend --workers N`` starts each child in a new session),
    and the children they reaped: a service started with ``start_new_session`` is its own session, so
    this is its whole process tree (helpers and worker processes included)."""
    procs = _session_tree(sid)
    return sum(ticks for _, _, ticks in procs.values()) / os.sysconf("SC_CLK_TCK")


def session_runtime_s(sid: int) -> float:
    """Seconds on a CPU so far of every live thread of session ``sid``'s process tree (as ``session_cpu_s``
    counts it; threads that ended are not counted), from the scheduler's own nanosecond account
    (``/proc/PID/task/TID/schedstat``): a window of a few ms of CPU, below ``session_cpu_s``'s 10 ms tick."""
    return sum(_task_figures(sid, "schedstat", lambda text: int(text.split()[0]))) / 1e9


def session_switches(sid: int) -> int:
    """Context switches so far (voluntary and involuntary) of every thread of session ``sid``'s process
    tree (as ``session_cpu_s`` counts it; threads that ended are not counted): each voluntary one is a
    thread that went to sleep and was woken again, so their growth over a window is its wake-ups."""

    def switches(text: str) -> int:
        return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith(_SWITCHES))

    return sum(_task_figures(sid, "status", switches))


def _task_figures(sid: int, name: str, read: Callable[[str], int]) -> Iterator[int]:
    """``read`` of ``/proc/PID/task/TID/<name>`` for every live thread of session ``sid``'s process tree;
    threads gone since the listing, or whose file does not parse, are left out."""
    for pid in _session_tree(sid):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone since the listing
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                    yield read(f.read())
            except (OSError, ValueError, IndexError):
                continue


_SWITCHES = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")


def _session_tree(sid: int) -> dict[int, tuple[int, int, int]]:
    """pid -> (parent, session, CPU ticks with reaped children's) of session ``sid``'s processes and their
    descendants."""
    procs: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        # fields[0] is the state (stat's 3rd field): parent is stat's 4th, session its 6th
        procs[int(entry)] = (int(fields[1]), int(fields[3]), sum(int(v) for v in fields[11:15]))
    counted = {pid for pid, (_, session, _) in procs.items() if session == sid}
    for _ in range(len(procs)):  # bounded: each pass adds a generation of descendants or stops
        more = {pid for pid, (parent, _, _) in procs.items() if parent in counted and pid not in counted}
        if not more:
            break
        counted |= more
    return {pid: procs[pid] for pid in counted}


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL if it does not go."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)


def _log_path(args: Sequence[str]) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix="kvroute-test-", suffix=".log")
    os.close(fd)
    return path


def _tail(log, n: int = 4000) -> str:
    try:
        log.flush()
        log.seek(0)
        data = log.read()
        return data[-n:].decode("utf-8", "replace")
    except Exception:
        return "<no log>"
