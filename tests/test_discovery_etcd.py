"""etcd discovery end to end: a real etcd server (Debian's etcd-server) on loopback, real mockers,
registering sidecars (``python -m frontend register``) and real frontend processes.

Join, leave by lease expiry after a kill -9, an etcd restart on the same data dir, and two frontend
replicas that find each other through etcd and share their load views.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from test_frontend_e2e import (
    Frontend,
    start_frontend,
    start_mockers,
    stream_until_first_chunk,
    unique_prompt,
    wait_ready,
)

from support import REPO_ROOT, free_ports, stop_process, wait_until

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
TTL = 3
WAIT = 60.0

if not os.path.exists(ETCD):
    if os.environ.get("CI"):
        raise RuntimeError("etcd is not installed (apt-get install -y etcd-server): the etcd discovery tests need it")
    pytest.skip("etcd is not installed (apt-get install -y etcd-server)", allow_module_level=True)


class EtcdServer:
    """One etcd member on loopback free ports; restartable on the same ports and data dir."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(self.data_dir + ".log"), "ab")
        self.proc = subprocess.Popen(
            [
                ETCD,
                "--name",
                "kvroute-test",
                "--data-dir",
                self.data_dir,
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"kvroute-test={peer}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(self._healthy, WAIT, what="etcd to serve")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.data_dir}.log")
        r = httpx.get(self.url + "/health", timeout=2.0)
        return r.status_code == 200 and r.json().get("health") == "true"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@pytest.fixture
def etcd(tmp_path) -> Iterator[EtcdServer]:
    server = EtcdServer(str(tmp_path / "etcd-data"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def register(etcd: EtcdServer, worker_arg: str, stack: contextlib.ExitStack) -> subprocess.Popen:
    """A registering sidecar for one worker (its own process group, so kill -9 takes only it)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "frontend",
            "register",
            "--etcd-endpoints",
            etcd.url,
            "--discovery-lease-ttl",
            str(TTL),
            "--worker",
            worker_arg,
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    stack.callback(stop_process, proc)
    return proc


def workers(fe: Frontend) -> dict[int, dict]:
    return {w["id"]: w for w in fe.http.get("/admin/workers").json()["workers"]}


def healthy_ids(fe: Frontend) -> set[int]:
    return {wid for wid, w in workers(fe).items() if w["healthy"]}


def etcd_keys(etcd: EtcdServer) -> int:
    import base64

    r = httpx.post(
        etcd.url + "/v3/kv/range",
        json={
            "key": base64.b64encode(b"/kvroute/").decode(),
            "range_end": base64.b64encode(b"/kvroute0").decode(),
            "count_only": True,
        },
    )
    return int(r.json().get("count") or 0)


def test_workers_join_leave_by_lease_and_survive_an_etcd_restart(etcd: EtcdServer) -> None:
    with contextlib.ExitStack() as stack:
        ms = start_mockers(3, stack)
        reg1 = register(etcd, ms[0].worker_arg(1), stack)
        reg2 = register(etcd, ms[1].worker_arg(2), stack)
        fe = start_frontend(["--router-mode", "kv", "--discovery", "etcd", "--etcd-endpoints", etcd.url], stack)
        wait_ready(ms, [fe])

        # join: both registered workers, owned by the etcd source, serving
        wait_until(lambda: healthy_ids(fe) == {1, 2}, WAIT, what="both etcd workers healthy")
        assert {w["source"] for w in workers(fe).values()} == {"etcd"}
        status = fe.http.get("/admin/workers").json()["discovery"]
        assert [s["backend"] for s in status] == ["static", "etcd"] and status[1]["watch"]["keys"] == 2
        assert {fe.chat(unique_prompt())[0] for _ in range(4)} <= {1, 2}

        # kill -9 the sidecar of worker 2: its lease expires and the frontend drops it (its engine is still up)
        os.killpg(reg2.pid, signal.SIGKILL)
        reg2.wait(timeout=10)
        killed = time.monotonic()
        wait_until(lambda: 2 not in workers(fe), TTL + 15.0, what="worker 2 to leave when its lease expires")
        gone_after = time.monotonic() - killed
        assert {fe.chat(unique_prompt())[0] for _ in range(6)} == {1}, "a worker whose lease expired still gets traffic"
        assert ms[1].proc.poll() is None  # the engine itself was never touched: only the registration left

        # restart etcd on the same data dir: the watch comes back and sees new registrations
        relists = status[1]["watch"]["relists"]
        etcd.stop()
        assert fe.http.get("/health").status_code == 200  # workers stay while the store is away
        etcd.start()
        register(etcd, ms[2].worker_arg(3), stack)
        wait_until(lambda: healthy_ids(fe) == {1, 3}, WAIT, what="worker 3 registered after the etcd restart")
        after = fe.http.get("/admin/workers").json()["discovery"][1]["watch"]
        assert after["relists"] > relists
        assert reg1.poll() is None  # worker 1's sidecar kept (or renewed) its registration through the restart
        assert {fe.chat(unique_prompt())[0] for _ in range(8)} <= {1, 3}
        print(f"worker 2 left {gone_after:.1f}s after its sidecar was killed (lease TTL {TTL}s)")


def test_sidecar_leaves_at_once_on_sigterm(etcd: EtcdServer) -> None:
    with contextlib.ExitStack() as stack:
        (m,) = start_mockers(1, stack)
        reg = register(etcd, m.worker_arg(5), stack)
        wait_until(lambda: etcd_keys(etcd) == 1, WAIT, what="the registration key")
        os.killpg(reg.pid, signal.SIGTERM)
        assert reg.wait(timeout=20) == 0
        assert etcd_keys(etcd) == 0  # revoked on the way out, not left to expire


def test_register_rejects_bad_input() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "frontend",
            "register",
            "--etcd-endpoints",
            "http://127.0.0.1:1",
            "--worker",
            "id=1,url=ftp://x",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "worker url must start with http://" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "frontend", "--discovery", "etcd"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "--discovery etcd needs --etcd-endpoints" in r.stderr


def test_two_frontends_find_each_other_and_share_load(etcd: EtcdServer) -> None:
    with contextlib.ExitStack() as stack:
        ms = start_mockers(2, stack)
        for i, m in enumerate(ms):
            register(etcd, m.worker_arg(i + 1), stack)
        pa, pb = free_ports(2)
        common = [
            "--router-mode",
            "kv",
            "--router-replica-sync",
            "--discovery",
            "etcd",
            "--etcd-endpoints",
            etcd.url,
            "--discovery-lease-ttl",
            str(TTL),
        ]
        a = start_frontend([*common, "--replica-sync-bind", f"tcp://127.0.0.1:{pa}"], stack)
        b = start_frontend([*common, "--replica-sync-bind", f"tcp://127.0.0.1:{pb}"], stack)
        wait_ready(ms, [a, b])
        for fe in (a, b):
            wait_until(lambda fe=fe: healthy_ids(fe) == {1, 2}, WAIT, what="both workers on each frontend")
        # no hand-listed peers: each found the other's replica-sync endpoint under /kvroute/peers/
        wait_until(lambda: a.http.get("/peers").json() == [f"tcp://127.0.0.1:{pb}"], WAIT, what="A to find B")
        wait_until(lambda: b.http.get("/peers").json() == [f"tcp://127.0.0.1:{pa}"], WAIT, what="B to find A")

        def views_converge() -> bool:  # the ZMQ subscription handshake is asynchronous: retry until it carries
            s = stream_until_first_chunk(a, unique_prompt())
            try:
                return wait_until(lambda: not a.idle() and b.loads() == a.loads(), 5.0, what="B's view to match A's")
            except TimeoutError:
                return False
            finally:
                s.close()

        wait_until(views_converge, WAIT, what="frontend B to see frontend A's in-flight request")
        wait_until(lambda: a.idle() and b.idle(), WAIT, what="both replicas idle after the stream ended")

        # a frontend that stops leaves the peers prefix: the other disconnects from it
        stop_process(b.proc)
        wait_until(lambda: a.http.get("/peers").json() == [], WAIT, what="A to drop the stopped B")
