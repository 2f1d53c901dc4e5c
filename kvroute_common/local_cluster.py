"""A local kvroute cluster: start mocker workers and a frontend as real processes, wait until they serve, stop them
cleanly.

Used by the replay benchmark (fresh, cold workers for every router mode), the one-command demo and
any other benchmark that needs a running system. Every child runs in its own session (so a Ctrl-C in
the terminal reaches only the orchestrator, which then stops the children in order: frontend first,
then workers) and, on Linux, gets SIGTERM if the orchestrator dies without cleaning up (no orphans).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute_common.ports import free_port, free_port_block

DEFAULT_MODEL = "kvroute-demo"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class MockerOptions:
    """Flags of ``python -m mocker`` the benchmarks vary (``python -m mocker --help`` says what each does)."""

    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    dp_size: int = 1
    speedup_ratio: float = 1.0
    kv_events: bool = True
    seed: int = 0
    model_name: str = DEFAULT_MODEL
    model_path: str | None = None
    extra_args: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Child:
    """A started process with its log file (shown when it fails)."""

    name: str
    proc: subprocess.Popen
    log_path: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "<no log>"


@dataclass(slots=True)
class Worker:
    worker_id: int
    url: str
    dp_size: int
    kv_events_endpoint: str | None
    replay_endpoint: str | None
    child: Child
    role: str = "both"  # disaggregated serving: prefill | decode | both

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def frontend_spec(self) -> str:
        """This worker as the frontend's ``--worker`` value."""
        parts = [f"id={self.worker_id}", f"url={self.url}", f"dp_size={self.dp_size}"]
        if self.kv_events_endpoint:
            parts.append(f"kv_events_endpoint={self.kv_events_endpoint}")
        if self.replay_endpoint:
            parts.append(f"replay_endpoint={self.replay_endpoint}")
        if self.role != "both":
            parts.append(f"role={self.role}")
        return ",".join(parts)


class Cluster:
    """Mocker workers + one frontend as child processes. Use as a context manager or call ``stop()``."""

    def __init__(self, log_dir: str | None = None, python: str = sys.executable, quiet_logs: bool = False) -> None:
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvroute-run-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.python = python
        self.workers: list[Worker] = []
        self.frontend: Child | None = None
        self.gateway: Child | None = None  # Envoy, when start_gateway ran
        self.frontend_url: str | None = None
        self._children: list[Child] = []
        self._reserved: set[int] = set()  # ports handed to children that may not have bound them yet

    def port(self) -> int:
        """A free port not yet handed to a child of this cluster."""
        for _ in range(100):
            port = free_port()
            if port not in self._reserved:
                self._reserved.add(port)
                return port
        raise RuntimeError("no free port found")

    def _port_block(self, n: int) -> int:
        for _ in range(100):
            base = free_port_block(n)
            block = set(range(base, base + n))
            if not block & self._reserved:
                self._reserved |= block
                return base
        raise RuntimeError(f"no block of {n} free ports found")

    # -- starting ---------------------------------------------------------------------------------
    def _spawn(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        program: str | None = None,
        cwd: str | None = None,
    ) -> Child:
        """``program`` (default: our python) with ``args``, logging to ``<log_dir>/<name>.log`` (``cwd``:
        where it starts; ``python -m`` imports from there first)."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [program or self.python, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        child = Child(name, proc, log_path)
        self._children.append(child)
        return child

    def start_mocker(
        self, opts: MockerOptions, worker_id: int | None = None, port: int | None = None, role: str = "both"
    ) -> Worker:
        worker_id = worker_id if worker_id is not None else len(self.workers) + 1
        port = port or self.port()
        args = [
            "-m", "mocker", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", opts.model_name,
            "--block-size", str(opts.block_size), "--num-gpu-blocks", str(opts.num_gpu_blocks),
            "--max-num-seqs", str(opts.max_num_seqs), "--max-num-batched-tokens", str(opts.max_num_batched_tokens),
            "--data-parallel-size", str(opts.dp_size), "--speedup-ratio", str(opts.speedup_ratio),
            "--seed", str(opts.seed + worker_id),
        ]  # fmt: skip
        kv_ep = replay_ep = None
        if opts.kv_events:
            base = self._port_block(2 * opts.dp_size)
            args += [
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{base}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{base + opts.dp_size}",
            ]
            kv_ep, replay_ep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + opts.dp_size}"
        else:
            args.append("--no-kv-events")
        if opts.model_path:
            args += ["--model-path", opts.model_path]
        args += list(opts.extra_args)
        if role != "both":
            args += ["--role", role]
        child = self._spawn(f"mocker-{worker_id}", args)
        worker = Worker(worker_id, f"http://127.0.0.1:{port}", opts.dp_size, kv_ep, replay_ep, child, role)
        self.workers.append(worker)
        return worker

    def start_frontend(
        self,
        router_mode: str = "kv",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        model_path: str | None = None,
        kv_events: bool = True,
        checkout: str | None = None,
        python: str | None = None,
    ) -> str:
        """``checkout``: run the frontend of that checkout of kvroute (a before/after comparison);
        ``python``: on that interpreter (one that imports kvroute) instead of the cluster's."""
        port = port or self.port()
        args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", router_mode]
        for w in self.workers:
            spec = (
                w.frontend_spec()
                if kv_events
                else f"id={w.worker_id},url={w.url},dp_size={w.dp_size}"
                + (f",role={w.role}" if w.role != "both" else "")
            )
            args += ["--worker", spec]
        if model_path:
            args += ["--model-path", model_path]
        args += list(extra_args)
        env = {"PYTHONPATH": checkout} if checkout else None
        self.frontend = self._spawn("frontend", args, env, program=python, cwd=checkout)
        self.frontend_url = f"http://127.0.0.1:{port}"
        return self.frontend_url

    def start_gateway(self, picker_port: int, timeout: float = 60.0, **options: Any) -> str:
        """A real Envoy in front of the workers with the frontend's endpoint picker (``--epp-port
        picker_port``) as its ext_proc service, as inference gateways run it (``options``: the
        ``local_gateway.envoy_config`` options, e.g. body modes); its URL once ready."""
        from .local_gateway import write_config

        gateway = write_config(self.log_dir, picker_port, **options)
        self.gateway = self._spawn("gateway", [*gateway.args(), "--concurrency", "1"])
        _wait(functools.partial(_get_ok, gateway.ready_url), timeout, f"gateway at {gateway.url}", self.gateway)
        return gateway.url

    def start_router(
        self, name: str, program: str, args: Sequence[str], url: str, env: dict[str, str] | None = None
    ) -> Child:
        """Another router in the frontend's place (a peer's binary, benchmarked against kvroute): it is
        stopped first like the frontend, and ``wait_router_ready`` waits for it."""
        self.frontend = self._spawn(name, args, env, program)
        self.frontend_url = url
        return self.frontend

    def restart_mocker(self, worker: Worker, sig: int = signal.SIGKILL, extra_args: Sequence[str] = ()) -> None:
        """Fault injection: kill ``worker``'s process (SIGKILL: no clean-up, its cache is lost) and
        start a new one with the same flags (then ``extra_args``, which win), so on the same HTTP and
        ZMQ ports; returns at once (wait with ``wait_workers_ready``). Call it from the main thread:
        the child's parent-death signal fires when the spawning thread ends."""
        old = worker.child
        _signal_group(old.proc, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.proc.wait(timeout=10.0)
        if old in self._children:
            self._children.remove(old)
        args = [str(a) for a in list(old.proc.args)[1:]]  # type: ignore[arg-type]
        worker.child = self._spawn(old.name, [*args, *extra_args])

    # -- readiness --------------------------------------------------------------------------------
    def wait_workers_ready(self, timeout: float = 90.0) -> None:
        for w in self.workers:
            _wait(functools.partial(_get_ok, f"{w.url}/health"), timeout, f"worker {w.worker_id} at {w.url}", w.child)

    def wait_frontend_ready(self, model: str = DEFAULT_MODEL, timeout: float = 90.0) -> None:
        """Ready = the frontend lists ``model`` and reports every started worker healthy.

        (A benchmark that starts while some workers are still unknown to the router would measure
        start-up, not routing.)
        """
        assert self.frontend is not None and self.frontend_url is not None
        expected = {w.worker_id for w in self.workers}

        def has_model() -> bool:
            r = httpx.get(f"{self.frontend_url}/v1/models", timeout=2.0)
            if r.status_code != 200 or not any(m.get("id") == model for m in r.json().get("data", [])):
                return False
            health = httpx.get(f"{self.frontend_url}/health", timeout=2.0)
            instances = (
                health.json().get("instances")
                if health.headers.get("content-type", "").startswith("application/json")
                else None
            )
            if instances is None:  # a frontend that does not list instances: the model is enough
                return health.status_code == 200
            healthy = {i.get("worker_id") for i in instances if i.get("healthy")}
            return health.status_code == 200 and expected <= healthy

        _wait(has_model, timeout, f"frontend at {self.frontend_url}", self.frontend)

    def check_alive(self) -> None:
        for c in self._children:
            if not c.alive():
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.log_tail()}")

    # -- stopping ---------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    def stop(self, timeout: float = 10.0) -> None:
        """Frontend first (no new work reaches workers), then workers; SIGTERM, then SIGKILL."""
        order = [c for c in self._children if c is self.frontend] + [
            c for c in self._children if c is not self.frontend
        ]
        for c in order:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in order:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(c.proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5.0)
            # a child's own helpers (same session) must not outlive it either
            _signal_group(c.proc, signal.SIGKILL)
        self._children.clear()
        self.workers.clear()
        self.frontend = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_cluster(
    n_workers: int,
    opts: MockerOptions,
    router_mode: str = "kv",
    frontend_port: int | None = None,
    frontend_args: Sequence[str] = (),
    log_dir: str | None = None,
    timeout: float = 120.0,
    attempts: int = 3,
    prefill_workers: int = 0,
) -> Cluster:
    """N mockers + a frontend, all ready to serve; stops whatever started if start-up fails.

    ``prefill_workers`` > 0: disaggregated serving, the first that many mockers are prefill-role
    workers and the others decode-role (``role=`` in the frontend's worker specs).

    Ports are picked free just before the children bind them, so on a busy machine another process
    can take one in between: a start-up that fails is retried on fresh ports (``attempts`` times).
    """
    for attempt in range(1, attempts + 1):
        cluster = Cluster(log_dir=log_dir)
        try:
            for i in range(n_workers):
                role = "both" if not prefill_workers else ("prefill" if i < prefill_workers else "decode")
                cluster.start_mocker(opts, role=role)
            cluster.wait_workers_ready(timeout)
            cluster.start_frontend(
                router_mode,
                port=frontend_port,
                extra_args=frontend_args,
                model_path=opts.model_path,
                kv_events=opts.kv_events,
            )
            cluster.wait_frontend_ready(opts.model_name, timeout)
            return cluster
        except (RuntimeError, TimeoutError) as exc:
            cluster.stop()
            if attempt == attempts or "in use" not in str(exc):
                raise
            print(
                f"start-up failed on a port conflict (attempt {attempt}/{attempts}); retrying on fresh ports",
                file=sys.stderr,
                flush=True,
            )
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _get_ok(url: str) -> bool:
    return httpx.get(url, timeout=2.0).status_code == 200


def _wait(check: Callable[[], bool], timeout: float, what: str, child: Child | None) -> None:
    """Poll ``check`` until true; fail fast (with the child's log) if the child exits."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if child is not None and not child.alive():
            raise RuntimeError(f"{what} exited with {child.proc.returncode} before it was ready:\n{child.log_tail()}")
        try:
            if check():
                return
        except Exception as exc:  # not listening yet
            last = exc
        if time.monotonic() >= deadline:
            tail = child.log_tail() if child is not None else ""
            raise TimeoutError(f"{what} not ready after {timeout:g} s (last error: {last!r})\n{tail}")
        time.sleep(0.1)
