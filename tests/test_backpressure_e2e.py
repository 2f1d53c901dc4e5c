"""Router queue backpressure end to end : ``--router-queue-max`` and
``--router-queue-timeout-secs`` answer 529 + Retry-After instead of holding requests unboundedly.

The rank is made busy without timing: the mocker runs one sequence at a time (``--max-num-seqs
1``); an occupier stream keeps that slot, and a blocker sent next waits inside the engine, so
its prompt stays in flight as prefill for as long as the occupier runs. With threshold 0.001 x
8192 every later arrival would be held by the router queue.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import httpx

from support import free_port, service, wait_until

MODEL = "backpressure-model"


@contextlib.contextmanager
def cluster(*flags: str) -> Iterator[httpx.Client]:
    mport, fport = free_port(), free_port()
    murl = f"http://127.0.0.1:{mport}"
    margs = [
        "-m",
        "mocker",
        "--host",
        "127.0.0.1",
        "--port",
        str(mport),
        "--served-model-name",
        MODEL,
        "--no-kv-events",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "8192",
        "--seed",
        "5",
    ]
    fargs = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(fport),
        "--router-mode",
        "kv",
        "--router-queue-threshold",
        "0.001",
        "--worker",
        f"id=1,url={murl},max_num_batched_tokens=8192",
        *flags,
    ]
    furl = f"http://127.0.0.1:{fport}"

    def ready() -> bool:
        r = httpx.get(f"{furl}/v1/models", timeout=2)
        return r.status_code == 200 and any(m["id"] == MODEL for m in r.json().get("data", []))

    with service(margs, ready_url=f"{murl}/v1/models", timeout=90), service(fargs, ready=ready, timeout=90):
        with httpx.Client(base_url=furl, timeout=60.0) as client:
            yield client


def _prompt() -> str:
    return uuid.uuid4().hex + " alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima"


def _metric(client: httpx.Client, name: str, **labels: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _prefill_in_flight(client: httpx.Client) -> bool:
    return any(r["active_prefill_tokens"] > 0 for r in client.get("/loads").json())


class Busy:
    """Occupier stream + blocker: the only rank stays busy until :meth:`release`."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.release_evt = threading.Event()
        self.started = threading.Event()
        self.results: dict[str, httpx.Response] = {}
        self.threads: list[threading.Thread] = []

    def _occupy(self) -> None:
        body = {"model": MODEL, "prompt": _prompt(), "max_tokens": 20000, "ignore_eos": True, "stream": True}
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_raw():
                self.started.set()
                if self.release_evt.is_set():
                    break

    def send(self, name: str) -> None:
        body = {"model": MODEL, "prompt": _prompt(), "max_tokens": 1}
        t = threading.Thread(
            target=lambda: self.results.__setitem__(name, self.client.post("/v1/completions", json=body))
        )
        t.start()
        self.threads.append(t)

    def __enter__(self) -> Busy:
        t = threading.Thread(target=self._occupy)
        t.start()
        self.threads.append(t)
        assert self.started.wait(60)
        self.send("blocker")
        wait_until(lambda: _prefill_in_flight(self.client), 30, what="the blocker to wait in prefill")
        return self

    def release(self) -> None:
        self.release_evt.set()
        for t in self.threads:
            t.join(60)

    def __exit__(self, *exc) -> None:
        self.release()


def test_full_queue_answers_529_with_retry_after_at_once() -> None:
    with cluster("--router-queue-max", "1") as client:
        with Busy(client) as busy:
            busy.send("held")
            wait_until(
                lambda: _metric(client, "dynamo_frontend_router_queue_pending_requests") == 1,
                30,
                what="one held request",
            )
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": _prompt(), "max_tokens": 1})
            assert r.status_code == 529, r.text
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "Overloaded" and "full" in err["message"]
            assert _metric(client, "dynamo_frontend_router_queue_backpressure_total", reason="request_limit") == 1
            assert _metric(client, "dynamo_frontend_model_rejection_total") == 1
            assert _metric(client, "dynamo_frontend_router_queue_pending_requests") == 1  # the held one still waits
            busy.release()
            assert busy.results["blocker"].status_code == 200
            assert busy.results["held"].status_code == 200  # admitted once capacity came back
        wait_until(
            lambda: all(
                r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in client.get("/loads").json()
            ),
            30,
            what="every load in /loads back at 0",
        )
        assert _metric(client, "dynamo_frontend_router_queue_pending_requests") == 0


def test_request_held_past_the_queue_timeout_gets_529() -> None:
    with cluster("--router-queue-timeout-secs", "0.5") as client:
        with Busy(client) as busy:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": _prompt(), "max_tokens": 1})
            assert r.status_code == 529, r.text
            assert r.headers["retry-after"] == "1"
            assert "router queue" in r.json()["error"]["message"]
            assert _metric(client, "dynamo_frontend_router_queue_backpressure_total", reason="queue_timeout") == 1
            assert _metric(client, "dynamo_frontend_router_queue_pending_requests") == 0  # it left the queue
            busy.release()
            assert busy.results["blocker"].status_code == 200
        wait_until(
            lambda: all(
                r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in client.get("/loads").json()
            ),
            30,
            what="every load in /loads back at 0",
        )
