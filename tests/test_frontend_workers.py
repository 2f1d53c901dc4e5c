"""``python -m frontend --workers 2``: two real frontend processes behind one port (SO_REUSEPORT) in
front of real mockers; both serve, each sees the load the other booked (replica sync on ipc://),
a killed process is restarted, and SIGTERM to the supervisor stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx

from support import REPO_ROOT, free_ports, service, wait_until

MODEL = "kvroute-demo"
START = 90.0
WAIT = 30.0


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _live_pid(url: str) -> tuple[int, httpx.Client]:
    """A new connection (the kernel picks the process) and the pid of the process that took it."""
    client = httpx.Client(base_url=url, timeout=30.0, limits=httpx.Limits(max_connections=1, keepalive_expiry=600))
    try:
        return client.get("/live").json()["pid"], client
    except Exception:
        client.close()
        raise


def _clients_per_process(url: str, want: int, tries: int = 100) -> dict[int, httpx.Client]:
    """One keep-alive client pinned to each of ``want`` processes (new connections until all were seen)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(tries):
        pid, client = _live_pid(url)
        if pid in found:
            client.close()
        else:
            found[pid] = client
        if len(found) == want:
            return found
    for c in found.values():
        c.close()
    raise AssertionError(f"{tries} connections reached only processes {sorted(found)}")


def _decode_blocks(client: httpx.Client) -> int:
    return sum(r["active_decode_blocks"] for r in client.get("/loads", params={"model_name": MODEL}).json())


def test_two_processes_serve_share_load_restart_and_stop_on_sigterm() -> None:
    with contextlib.ExitStack() as stack:
        m_port, ev, rp = free_ports(3)
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(m_port),
                    "--num-gpu-blocks",
                    "2048",
                    "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{ev}",
                    "--replay-endpoint",
                    f"tcp://127.0.0.1:{rp}",
                ],
                ready_url=f"http://127.0.0.1:{m_port}/health",
                timeout=START,
            )
        )
        (port,) = free_ports(1)
        url = f"http://127.0.0.1:{port}"
        worker = f"id=1,url=http://127.0.0.1:{m_port},kv_events_endpoint=tcp://127.0.0.1:{ev},replay_endpoint=tcp://127.0.0.1:{rp}"
        sup = stack.enter_context(
            service(
                [
                    "-m",
                    "frontend",
                    "--workers",
                    "2",
                    "--http-host",
                    "127.0.0.1",
                    "--http-port",
                    str(port),
                    "--router-mode",
                    "kv",
                    "--health-check-interval",
                    "0.5",
                    "--drain-timeout",
                    "5",
                    "--log-level",
                    "warning",
                    "--worker",
                    worker,
                ]
            )
        )
        clients = wait_until(lambda: _clients_per_process(url, 2), START, what="two frontend processes listening")
        stack.callback(lambda: [c.close() for c in clients.values()])
        pids = sorted(clients)
        assert sup.pid not in pids  # the supervisor serves nothing itself
        for pid, c in clients.items():
            wait_until(lambda c=c: c.get("/health").status_code == 200, START, what=f"process {pid} ready")
            # each process routes and proxies on its own connection
            r = c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"hello from {pid}"}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            assert c.get("/live").json()["pid"] == pid  # still the same process (keep-alive)

        # a booking made on process a (the embedded tracker's /add: the routing path books through the
        # same tracker) shows in process b's load view, and its free too; and the other way round
        a, b = pids
        for src, dst, rid in ((a, b, "share-1"), (b, a, "share-2")):
            # the chat requests above were freed locally; their frees reach the sibling over replica sync
            wait_until(
                lambda dst=dst: _decode_blocks(clients[dst]) == 0,
                WAIT,
                what=f"process {dst} to see earlier requests freed",
            )
            r = clients[src].post(
                "/add",
                json={
                    "model_name": MODEL,
                    "request_id": rid,
                    "worker_id": 1,
                    "dp_rank": 0,
                    "sequence_hashes": [11, 12, 13],
                    "new_isl_tokens": 48,
                },
            )
            assert r.status_code == 201, r.text
            wait_until(
                lambda dst=dst: _decode_blocks(clients[dst]) == 3, WAIT, what=f"process {dst} to see {src}'s booking"
            )
            assert clients[src].post("/free", json={"model_name": MODEL, "request_id": rid}).status_code == 200
            wait_until(
                lambda dst=dst: _decode_blocks(clients[dst]) == 0, WAIT, what=f"process {dst} to see the booking freed"
            )

        # a process that dies is started again
        os.kill(b, signal.SIGKILL)
        wait_until(lambda: not _pid_alive(b), WAIT, what="killed process gone")
        clients.pop(b).close()

        def replacement() -> int | None:
            found = _clients_per_process(url, 2)
            for c in found.values():
                c.close()
            return next((p for p in found if p not in pids), None)

        new_pid = wait_until(replacement, START, what="a replacement process")
        assert _pid_alive(a) and _pid_alive(new_pid)

        # SIGTERM to the supervisor: every process drains and exits, then the supervisor (status 0)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=60) == 0
        for pid in (a, new_pid):
            wait_until(lambda pid=pid: not _pid_alive(pid), WAIT, what=f"process {pid} gone")
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"{url}/live", timeout=2.0)
            raise AssertionError("something still answers on the port")


def test_workers_flag_rejects_fixed_replica_sync_endpoints_and_bad_counts() -> None:
    base = [sys.executable, "-m", "frontend", "--http-port", "1"]
    r = subprocess.run(
        [*base, "--workers", "2", "--replica-sync-bind", "tcp://127.0.0.1:9999"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "drop --replica-sync-bind" in r.stderr
    r = subprocess.run(
        [*base, "--workers", "2", "--replica-sync-peers", "tcp://10.0.0.1:1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "not supported yet" in r.stderr
    r = subprocess.run([*base, "--workers", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "between 1 and 64" in r.stderr
