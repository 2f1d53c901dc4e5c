"""Graceful drain on SIGTERM: real frontend / service processes, a real mocker streaming.

The mocker runs slowed down (``--speedup-ratio``) so a stream is still running when the signal
arrives; every wait is a condition with a deadline, and each stream lasts far longer (seconds) than
the checks made while it runs.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import httpx

from support import free_ports, service, wait_until

MODEL = "kvroute-demo"


class StreamReader(threading.Thread):
    """Streams one chat completion in the background: chunks, whether [DONE] came, the error if cut."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.max_tokens = max_tokens
        self.chunks: list[dict] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "drain me"}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120.0) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
        except BaseException as exc:  # the cut stream: the connection ends mid-body
            self.error = exc


def _frontend(fport: int, wport: int, drain_timeout: float) -> list[str]:
    return [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(fport),
        "--worker",
        f"id=1,url=http://127.0.0.1:{wport}",
        "--drain-timeout",
        str(drain_timeout),
    ]


def _slow_mocker(wport: int) -> list[str]:
    # ~115 ms per decode step: a stream of 40 tokens lasts ~5 s, one of 2000 tokens minutes
    return ["-m", "mocker", "--port", str(wport), "--no-kv-events", "--speedup-ratio", "0.05"]


def _ready(url: str):
    return lambda: httpx.get(f"{url}/health", timeout=1.0).status_code == 200


def test_sigterm_drains_the_stream_in_flight_then_exits_0() -> None:
    fport, wport = free_ports(2)
    url = f"http://127.0.0.1:{fport}"
    with (
        service(_slow_mocker(wport), ready_url=f"http://127.0.0.1:{wport}/health"),
        service(_frontend(fport, wport, 60), ready=_ready(url)) as proc,
    ):
        stream = StreamReader(url, 40)
        stream.start()
        wait_until(lambda: stream.chunks, 30, what="the first streamed chunk")
        proc.send_signal(signal.SIGTERM)
        # /health turns 503 at once (the listener stays open); new /v1 requests are refused OpenAI-style
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2.0).status_code == 503, 30, what="/health 503")
        assert httpx.get(f"{url}/health").json()["status"] == "shutting_down"
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "late"}], "max_tokens": 2},
        )
        assert r.status_code == 503 and r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == 503 and "shutting down" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models").status_code == 503
        assert not stream.done and proc.poll() is None  # the stream was in flight all along
        stream.join(60)
        assert stream.error is None and stream.done
        assert stream.chunks[-1]["choices"][0]["finish_reason"] == "length"
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream.chunks if c.get("choices"))
        assert content
        assert proc.wait(timeout=30) == 0


def test_a_stream_longer_than_the_drain_timeout_is_cut_and_the_process_exits_0() -> None:
    fport, wport = free_ports(2)
    url = f"http://127.0.0.1:{fport}"
    with (
        service(_slow_mocker(wport), ready_url=f"http://127.0.0.1:{wport}/health"),
        service(_frontend(fport, wport, 1), ready=_ready(url)) as proc,
    ):
        stream = StreamReader(url, 2000)
        stream.start()
        wait_until(lambda: stream.chunks, 30, what="the first streamed chunk")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 25  # the 2000-token stream would take minutes
        stream.join(30)
        assert not stream.done and not stream.is_alive()
        assert len(stream.chunks) < 2000


def _raw_partial_post(port: int, path: str, body: bytes, sent: int) -> socket.socket:
    """A request whose body is only partly sent: in flight until the rest follows."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:sent])
    return sock


def test_slot_tracker_drains_a_request_in_flight_and_exits_0() -> None:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}).encode()
    with service(
        ["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", "60"],
        ready_url=f"{url}/health",
    ) as proc:
        sock = _raw_partial_post(port, "/register", body, 10)
        try:
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health", timeout=2.0).status_code == 503, 30, what="/health 503")
            assert proc.poll() is None  # waiting for the request in flight
            sock.sendall(body[10:])
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(4096)
                assert chunk, "connection closed without an answer"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 201")
        finally:
            sock.close()
        assert proc.wait(timeout=30) == 0


def test_indexer_exits_0_promptly_on_sigterm() -> None:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    with service(["-m", "indexer", "--host", "127.0.0.1", "--port", str(port)], ready_url=f"{url}/health") as proc:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 20  # nothing in flight: no drain wait


def test_sigint_keeps_uvicorns_behaviour() -> None:
    """Ctrl-C (the demo, a terminal) is not a drain: the process stops at once, as before."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    # a test run started as a background job ignores SIGINT, and an ignored signal stays ignored across exec:
    # the service is started as from a terminal, with Ctrl-C's default action
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        args = ["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(port)]
        with service(args, ready_url=f"{url}/health") as proc:
            signal.signal(signal.SIGINT, previous)
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError("SIGINT did not stop the service") from None
            assert code != 0  # uvicorn re-raises the signal after its shutdown
    finally:
        signal.signal(signal.SIGINT, previous)
