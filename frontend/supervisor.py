"""``python -m frontend --workers N``: N frontend processes behind one port, under one supervisor.

One Python process saturates one core; the frontend's work per request (tokenize, hash, route, proxy)
is independent between requests, so N processes scale it. Each child is a complete frontend (its own
event loop, worker health checks, embedded indexer fed by its own KV-event subscriptions, embedded
slot tracker) listening on the same host:port with ``SO_REUSEPORT``: the kernel spreads new
connections over the children's accept queues. The children share active load (the slot tracker's
add / prefill-complete / free lifecycle) through replica sync over private ``ipc://`` sockets in a
temporary directory, each subscribed to all its siblings, so nobody lists peers by hand and every
child routes with the load the others booked.

The supervisor only starts, watches and stops children: it serves nothing itself. A child that dies
is started again (after a back-off); one that keeps dying within seconds of its start (a broken
configuration, the port taken) stops everything with an error. SIGTERM is forwarded to every child,
which drains as a single frontend does (``--drain-timeout``); SIGINT is forwarded too (uvicorn's
quick stop). Children die with the supervisor even if it is killed (``PR_SET_PDEATHSIG`` on Linux).

Per process, not shared: ``/metrics`` (a scrape sees the process that accepted it), the runtime
worker API (``POST /admin/workers`` reaches one process: use ``--worker`` or ``--workers-file``,
which every child reads) and the embedded tracker's HTTP routes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import FrameType

log = logging.getLogger("frontend.supervisor")

ENV_INDEX = "KVROUTE_FRONTEND_PROCESS"  # set in a child: its index (0..N-1); the child serves instead of supervising
ENV_REUSE_PORT = "KVROUTE_REUSE_PORT"  # set in a child: bind the HTTP port with SO_REUSEPORT

QUICK_EXIT_SECS = 10.0  # a child that exits sooner than this after its start counts as a crash loop
MAX_QUICK_EXITS = 5  # ... this many times in a row: stop everything
POLL_SECS = 0.2
KILL_GRACE_SECS = 10.0  # after the drain timeout, how long children get before SIGKILL

_PR_SET_PDEATHSIG = 1


def child_index() -> int | None:
    """This process's index when it is a child of the supervisor, else None."""
    raw = os.environ.get(ENV_INDEX)
    return int(raw) if raw not in (None, "") else None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port with SO_REUSEPORT, for uvicorn's ``sockets=``."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("--workers N > 1 needs SO_REUSEPORT (Linux, BSD, macOS)")
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setsid()  # the supervisor forwards signals itself: a terminal's Ctrl-C must not reach children twice


class Supervisor:
    """Start N children, restart the ones that die, forward SIGTERM/SIGINT and wait for all to exit."""

    def __init__(
        self, argv: list[str], processes: int, host: str, port: int, drain_timeout: float, peers: list[str]
    ) -> None:
        self.argv = argv
        self.n = processes
        self.host, self.port = host, port
        self.drain_timeout = drain_timeout
        self.extra_peers = peers
        self.dir = ""
        self.children: list[subprocess.Popen | None] = [None] * processes
        self.started_at = [0.0] * processes
        self.quick_exits = [0] * processes
        self.restart_at: list[float | None] = [None] * processes
        self.stopping: int | None = None  # the signal that started the stop
        self.stop_deadline = 0.0
        self.failed = False

    def endpoint(self, i: int) -> str:
        return f"ipc://{self.dir}/sync-{i}"

    def _child_argv(self, i: int) -> list[str]:
        peers = [self.endpoint(j) for j in range(self.n) if j != i] + self.extra_peers
        return [
            sys.executable,
            "-m",
            "frontend",
            *self.argv,
            "--router-replica-sync",
            "--replica-sync-bind",
            self.endpoint(i),
            "--replica-sync-peers",
            ",".join(peers),
        ]

    def _spawn(self, i: int) -> None:
        env = dict(os.environ)
        env[ENV_INDEX] = str(i)
        env[ENV_REUSE_PORT] = "1"
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        proc = subprocess.Popen(self._child_argv(i), env=env, preexec_fn=preexec, start_new_session=preexec is None)
        self.children[i] = proc
        self.started_at[i] = time.monotonic()
        self.restart_at[i] = None
        log.info("frontend process %d started (pid %d)", i, proc.pid)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping is None:
            self.stopping = sig
            self.stop_deadline = (
                time.monotonic() + (self.drain_timeout if sig == signal.SIGTERM else 0.0) + KILL_GRACE_SECS
            )
            log.warning("%s: stopping %d frontend process(es)", signal.Signals(sig).name, self.n)
        for proc in self.children:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def _check_port(self) -> None:
        """Fail before starting anything when the port is taken (a probe socket, closed at once)."""
        reuse_port_socket(self.host, self.port).close()

    def run(self) -> int:
        self._check_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-frontend-")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(self.n):
                self._spawn(i)
            while self._step():
                time.sleep(POLL_SECS)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._kill_all()
            shutil.rmtree(self.dir, ignore_errors=True)
        return 1 if self.failed else 0

    def _step(self) -> bool:
        """One supervision pass; False once every child has exited during a stop."""
        now = time.monotonic()
        alive = 0
        for i, proc in enumerate(self.children):
            if proc is None:
                at = self.restart_at[i]
                if self.stopping is None and at is not None and now >= at:
                    self._spawn(i)
                    alive += 1
                continue
            code = proc.poll()
            if code is None:
                alive += 1
                continue
            self.children[i] = None
            if self.stopping is not None:
                continue
            uptime = now - self.started_at[i]
            self.quick_exits[i] = self.quick_exits[i] + 1 if uptime < QUICK_EXIT_SECS else 0
            if self.quick_exits[i] >= MAX_QUICK_EXITS:
                log.error(
                    "frontend process %d exited with %s %d times in a row within %gs of its start: stopping",
                    i,
                    code,
                    MAX_QUICK_EXITS,
                    QUICK_EXIT_SECS,
                )
                self.failed = True
                self._on_signal(signal.SIGTERM, None)
                continue
            delay = min(30.0, 0.5 * 2 ** self.quick_exits[i])
            log.error(
                "frontend process %d (pid %d) exited with %s after %.1fs: restarting in %.1fs",
                i,
                proc.pid,
                code,
                uptime,
                delay,
            )
            self.restart_at[i] = now + delay
            alive += 1
        if self.stopping is not None:
            if alive and now >= self.stop_deadline:
                self._kill_all()
            return alive > 0
        return True

    def _kill_all(self) -> None:
        for proc in self.children:
            if proc is not None and proc.poll() is None:
                log.error("frontend process pid %d did not stop: SIGKILL", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)


def supervise(argv: list[str], processes: int, host: str, port: int, drain_timeout: float, peers: list[str]) -> int:
    """Run ``python -m frontend`` with ``argv`` as ``processes`` children on one port until stopped."""
    return Supervisor(argv, processes, host, port, drain_timeout, peers).run()
