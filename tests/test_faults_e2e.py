"""Fault injection through real processes (loopback only, every wait bounded).

- a ZMQ proxy that drops KV-event batches between a mocker and the standalone indexer: the gaps are
  replayed from the mocker's replay socket and the index ends equal to the mocker's cache;
- a mocker killed and restarted on the same ports (its event sequence starts again at 0) while the
  indexer keeps its registration: the old blocks go, the new ones are learnt;
- the standalone indexer killed and restarted with ``--peers`` while traffic flows: its index ends
  identical to the peer's ``/dump`` (and to the mocker's cache);
- a client that leaves while still sending its body: a counted cancellation (499), not a logged 500;
- a worker that never answers behind the frontend's ``--request-timeout``: its requests get 504 and
  their bookings are freed while the other worker keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import httpx
import zmq
from test_mocker_events import BS, INSTANCE, MODEL, complete, indexer_blocks, mocker_blocks, prompt_text

from bench.leak import index_blocks
from support import free_port_block, free_ports, frontend_client, service, wait_until


def mocker_args(port: int, pub: int, rep: int, *extra: str) -> list[str]:
    return [
        "-m",
        "mocker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-gpu-blocks",
        "256",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{rep}",
        "--speedup-ratio",
        "10",
        "--seed",
        "1",
        *extra,
    ]


@contextlib.contextmanager
def mocker(port: int, pub: int, rep: int, *extra: str) -> Iterator[dict]:
    with service(mocker_args(port, pub, rep, *extra), ready_url=f"http://127.0.0.1:{port}/health", timeout=60) as proc:
        yield {"url": f"http://127.0.0.1:{port}", "pub": pub, "replay": rep, "proc": proc}


@contextlib.contextmanager
def indexer(port: int, *extra: str) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    with service(
        ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), *extra],
        ready_url=f"{url}/health",
        timeout=60,
        env={"KVROUTE_INDEXER_RECOVERY_DELAY": "0.2"},
    ):
        yield url


def register(indexer_url: str, endpoint: str, replay: int) -> None:
    r = httpx.post(
        indexer_url + "/register",
        json={
            "instance_id": INSTANCE,
            "endpoint": endpoint,
            "model_name": MODEL,
            "block_size": BS,
            "dp_rank": 0,
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        },
    )
    assert r.status_code == 201, r.text


def metric(url: str, name: str) -> float:
    """Sum of a metric family's samples in ``url``/metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def equal_to_cache(indexer_url: str, m: dict) -> bool:
    want = mocker_blocks(m, 0)
    return bool(want) and indexer_blocks(indexer_url, 0) == want


def kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class DroppingProxy:
    """SUB from the engine, PUB to the indexer, dropping every ``every``-th batch (a lossy link)."""

    def __init__(self, upstream: str, port: int, every: int = 3) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.every = every
        self.seen = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sub.poll(100):
                continue
            frames = self.sub.recv_multipart()
            self.seen += 1
            if self.seen % self.every == 0:
                self.dropped += 1
                continue
            self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sub.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def test_dropped_batches_are_replayed_and_the_index_matches_the_cache():
    port, ix_port, proxy_port = free_ports(3)
    pub, rep = free_port_block(1), free_port_block(1)
    with mocker(port, pub, rep) as m, indexer(ix_port) as ix:
        proxy = DroppingProxy(f"tcp://127.0.0.1:{pub}", proxy_port)
        try:
            register(ix, proxy.endpoint, rep)  # live events through the lossy proxy, replays straight from the engine
            for i in range(30):
                complete(m, prompt_text(40 + i), 0)
                if i % 10 == 9:  # some requests evict: the cache has 256 blocks
                    wait_until(lambda: proxy.seen > 0, timeout=30, what="the proxy forwarding")
            wait_until(lambda: proxy.dropped >= 3, timeout=30, what="batches dropped")
            complete(m, prompt_text(20), 0)  # a batch after the last drop reveals any trailing gap
            wait_until(lambda: equal_to_cache(ix, m), timeout=30, what="index equal to the mocker's cache")
            assert metric(ix, "kvroute_kv_event_gaps_total") >= 1 and metric(ix, "kvroute_kv_event_replays_total") >= 1
        finally:
            proxy.close()


def test_engine_restart_resets_its_blocks_and_the_index_relearns():
    port, ix_port = free_ports(2)
    pub, rep = free_port_block(1), free_port_block(1)
    with indexer(ix_port) as ix:
        with mocker(port, pub, rep) as m:
            register(ix, f"tcp://127.0.0.1:{pub}", rep)
            for i in range(20):
                complete(m, prompt_text(60 + i), 0)
            wait_until(lambda: equal_to_cache(ix, m), timeout=30, what="index equal to the first engine's cache")
            old = indexer_blocks(ix, 0)
            kill(m["proc"])  # no clean-up: the cache is gone with the process
        with mocker(port, pub, rep) as m:  # same ports; the indexer keeps its registration and watermark
            n = iter(range(1000))

            def relearnt() -> bool:
                # the restart shows at the first batch the re-connected subscriber receives (ZMQ
                # reconnects with back-off): keep a slow trickle of requests until then
                if equal_to_cache(ix, m):
                    return True
                complete(m, prompt_text(30 + next(n)), 0)
                return False

            wait_until(relearnt, timeout=60, interval=0.5, what="index equal to the new engine's cache")
            assert not (indexer_blocks(ix, 0) & old)
            assert metric(ix, "kvroute_kv_event_engine_restarts_total") == 1


def restart_and_wait_read_again(
    fe: httpx.Client, m: dict, port: int, pub: int, rep: int, restarts: Callable[[], int]
) -> None:
    """Kill mocker ``m`` and start one with a cache twice as large on its ports; requests trickle in until
    the listener that follows it (``restarts``: the count it shows) has seen the new process. The frontend
    must then read the worker again (its new capacity, its tokenizer proven again), never unhealthy."""

    def row() -> dict:
        return fe.get("/admin/workers").json()["workers"][0]

    kill(m["proc"])
    with mocker(port, pub, rep, "--num-gpu-blocks", "512") as m2:
        n = iter(range(1000))

        def read_again() -> bool:
            r = row()
            if r["num_gpu_blocks"] == 512 and r["prompt_ids_proven"]:
                return True
            if restarts() == 0:  # the listener sees the new process at the first batch it receives
                complete(m2, prompt_text(30 + next(n)), 0)
            return False

        try:
            wait_until(read_again, timeout=60, interval=0.5, what="the restarted engine read again")
        except TimeoutError as exc:  # say which of the three conditions was missing
            raise AssertionError(f"{exc}: restarts seen {restarts()}, worker {row()}") from None
        assert row()["healthy"] and restarts() == 1
        body = {"model": MODEL, "prompt": prompt_text(7), "max_tokens": 2}
        assert fe.post("/v1/completions", json=body).status_code == 200


def test_an_engine_restarted_between_two_health_checks_is_read_again():
    """An engine that restarts faster than the health interval (no failed check, no failed dispatch) is a new
    process behind the same address: its KV-event stream starting again is how the frontend sees it. The
    worker is then read again (capacity, models, event sources) and its tokenizer proven again, instead
    of being routed on what the old process said (here: a cache twice as large)."""
    port = free_ports(1)[0]
    pub, rep = free_port_block(1), free_port_block(1)
    spec = f"id=1,url=http://127.0.0.1:{port},kv_events_endpoint=tcp://127.0.0.1:{pub},replay_endpoint=tcp://127.0.0.1:{rep}"
    with mocker(port, pub, rep) as m, frontend_client([spec], "--health-check-interval", "3600") as fe:
        row = lambda: fe.get("/admin/workers").json()["workers"][0]  # noqa: E731
        wait_until(lambda: row()["prompt_ids_proven"], timeout=30, what="the first engine's tokenizer proven")
        assert row()["num_gpu_blocks"] == 256
        for i in range(5):
            complete(m, prompt_text(40 + i), 0)
        health = lambda: row()["kv_events"]["health"]["0"]  # noqa: E731
        wait_until(lambda: health()["batches_applied"] >= 5, 30, what="the first engine's events")
        restart_and_wait_read_again(fe, m, port, pub, rep, lambda: health()["engine_restarts"])


def test_a_restart_a_remote_indexer_saw_between_two_health_checks_has_the_worker_read_again():
    """With ``--use-remote-indexer`` the KV listener that sees the new process runs in the indexer, not in
    the frontend: the frontend reads the indexers' engine-restart counts (``/workers``, every few seconds)
    and reads a worker whose count went up again, as it does with an embedded index."""
    port, iport = free_ports(2)
    pub, rep = free_port_block(1), free_port_block(1)
    with mocker(port, pub, rep) as m, indexer(iport) as shard:
        register(shard, f"tcp://127.0.0.1:{pub}", rep)
        flags = ("--health-check-interval", "3600", "--use-remote-indexer", shard)
        with frontend_client([f"id={INSTANCE},url={m['url']}"], *flags, events=False) as fe:
            row = lambda: fe.get("/admin/workers").json()["workers"][0]  # noqa: E731
            wait_until(lambda: row()["prompt_ids_proven"], timeout=30, what="the first engine's tokenizer proven")
            assert row()["num_gpu_blocks"] == 256 and not row().get("kv_events")  # no listener in the frontend
            for i in range(5):
                complete(m, prompt_text(40 + i), 0)
            wait_until(lambda: equal_to_cache(shard, m), 30, what="the indexer holding the first engine's blocks")
            shard_restarts = lambda: httpx.get(shard + "/workers", timeout=10).json()[0]["listeners"]["0"]  # noqa: E731
            restart_and_wait_read_again(fe, m, port, pub, rep, lambda: shard_restarts()["engine_restarts"])


def test_a_live_worker_removed_and_added_again_is_relearnt_from_its_replay_socket():
    """A worker taken out of the frontend while its engine keeps running (``DELETE /admin/workers``; a
    discovery lapse or a workers-file edit does the same) loses its blocks with its KV-event stream;
    given back, its new stream must start from no watermark, so the first batch it receives shows a
    gap from 0 and the engine's replay socket gives back every block it still holds. The watermark
    used to outlive the removal: the new stream went on after it and the older blocks were never
    learnt again (the index stayed short of the engine's cache for good)."""
    port = free_ports(1)[0]
    pub, rep = free_port_block(1), free_port_block(1)
    with mocker(port, pub, rep) as m:
        spec = {
            "id": 1,
            "url": m["url"],
            "kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep}",
        }
        with frontend_client([",".join(f"{k}={v}" for k, v in spec.items())]) as fe:

            def index_equals_cache() -> bool:
                cache = mocker_blocks(m, 0)
                return bool(cache) and index_blocks(fe.get("/admin/kv_dump").json()).get((1, 0)) == cache

            for i in range(5):
                complete(m, prompt_text(40 + i), 0)
            wait_until(index_equals_cache, timeout=30, what="index equal to the engine's cache")
            before = mocker_blocks(m, 0)
            assert fe.delete("/admin/workers/1").status_code == 200
            wait_until(lambda: not index_blocks(fe.get("/admin/kv_dump").json()), timeout=30, what="blocks forgotten")
            assert fe.post("/admin/workers", json=spec).status_code == 201
            n = iter(range(1000))

            def relearnt() -> bool:
                # the new subscriber misses what is published before it connects: a slow trickle of
                # requests until a batch arrives
                if index_equals_cache():
                    return True
                complete(m, prompt_text(30 + next(n)), 0)
                return False

            wait_until(relearnt, timeout=30, interval=0.5, what="index equal to the engine's cache again")
            assert before <= index_blocks(fe.get("/admin/kv_dump").json())[(1, 0)]


def test_indexer_restarted_with_peers_under_traffic_ends_identical_to_the_peer():
    port, a_port, b_port = free_ports(3)
    pub, rep = free_port_block(1), free_port_block(1)
    stop = threading.Event()

    def traffic(m: dict) -> int:
        n = 0
        while not stop.is_set() and n < 400:  # bounded even if the test fails before setting stop
            complete(m, prompt_text(30 + n % 40), 0)
            n += 1
        return n

    with mocker(port, pub, rep) as m, indexer(a_port) as a, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            with indexer(b_port, "--peers", a) as b:
                for ix in (a, b):
                    register(ix, f"tcp://127.0.0.1:{pub}", rep)
                complete(m, prompt_text(50), 0)
                wait_until(
                    lambda: equal_to_cache(a, m) and equal_to_cache(b, m), timeout=30, what="both indexers follow"
                )
                sent = pool.submit(traffic, m)
                applied = metric(a, "kvroute_kv_event_batches_applied_total")
                wait_until(
                    lambda: metric(a, "kvroute_kv_event_batches_applied_total") >= applied + 5,
                    timeout=30,
                    what="traffic flowing",
                )
            # B is gone while the engine keeps publishing; it comes back on the same port and recovers from A
            with indexer(b_port, "--peers", a) as b:
                assert index_blocks(httpx.get(b + "/dump", timeout=30).json()), "B recovered nothing from its peer"
                register(b, f"tcp://127.0.0.1:{pub}", rep)
                stop.set()
                assert sent.result(timeout=120) > 0
                complete(m, prompt_text(25), 0)
                wait_until(
                    lambda: equal_to_cache(a, m) and equal_to_cache(b, m), timeout=60, what="both equal to the cache"
                )
                assert index_blocks(httpx.get(b + "/dump", timeout=30).json()) == index_blocks(
                    httpx.get(a + "/dump", timeout=30).json()
                )
        finally:
            stop.set()


@contextlib.contextmanager
def frontend(port: int, workers: list[str], *extra: str) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--router-mode",
        "kv",
        "--log-level",
        os.environ.get("FE_LOG", "warning"),
    ]
    for w in workers:
        args += ["--worker", w]
    args += extra  # e.g. --request-timeout: dropped before, so the timeout test ran without one and hung
    with service(
        args,
        timeout=90,
        ready=lambda: (
            httpx.get(f"{url}/health", timeout=2).status_code == 200
            and len([i for i in httpx.get(f"{url}/health", timeout=2).json().get("instances", []) if i.get("healthy")])
            == len(workers)
        ),
    ):
        yield url


def chat(url: str, text: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        timeout=timeout,
        json={"model": MODEL, "max_tokens": 4, "ignore_eos": True, "messages": [{"role": "user", "content": text}]},
    )


def loads_zero(url: str) -> bool:
    rows = httpx.get(url + "/loads", timeout=10).json()
    return bool(rows) and all(r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in rows)


def test_a_worker_that_never_answers_times_out_and_the_other_keeps_serving():
    fe_port, slow_port, fast_port = free_ports(3)
    (sp, sr), (fp, fr) = (free_port_block(1), free_port_block(1)), (free_port_block(1), free_port_block(1))
    with (
        mocker(slow_port, sp, sr, "--stall-after-tokens", "0"),
        mocker(fast_port, fp, fr),
        frontend(
            fe_port,
            [f"id=1,url=http://127.0.0.1:{slow_port}", f"id=2,url=http://127.0.0.1:{fast_port}"],
            "--request-timeout",
            "2",
        ) as fe,
    ):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: chat(fe, prompt_text(30 + i), timeout=30), range(8)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) <= {200, 504} and 504 in codes and 200 in codes, codes
        for r in answers:
            if r.status_code == 504:
                assert "did not answer" in r.json()["error"]["message"]
        # the stalled worker's bookings were freed; the healthy one still answers
        wait_until(lambda: loads_zero(fe), timeout=30, what="every load back to 0")
        assert chat(fe, "still serving?", timeout=30).status_code in (200, 504)
        # ties between the two idle workers are broken at random: one answer in 24 tries is certain but
        # for a chance of 2**-24 (six tries failed about once in 64 runs)
        assert any(chat(fe, prompt_text(10 + i)).status_code == 200 for i in range(24))
        wait_until(lambda: loads_zero(fe), timeout=30, what="every load back to 0 again")


def test_a_client_that_leaves_while_sending_its_body_is_a_cancellation_not_an_error(tmp_path):
    import socket

    fe_port, m_port = free_ports(2)
    pub, rep = free_port_block(1), free_port_block(1)
    log = tmp_path / "frontend.log"
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(fe_port),
        "--router-mode",
        "kv",
        "--worker",
        f"id=1,url=http://127.0.0.1:{m_port}",
    ]
    fe = f"http://127.0.0.1:{fe_port}"
    with (
        mocker(m_port, pub, rep),
        service(args, ready=lambda: chat(fe, "ready?", timeout=5).status_code == 200, timeout=90, log_path=str(log)),
    ):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", fe_port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b'content-length: 1000\r\n\r\n{"model": '
                )  # then the client goes away mid-body
        wait_until(
            lambda: metric(fe, "dynamo_frontend_disconnected_clients") >= 3, timeout=30, what="3 disconnects counted"
        )
        assert chat(fe, "still serving?").status_code == 200
        assert (
            metric(fe, "dynamo_frontend_inflight_requests") == 0 and metric(fe, "dynamo_frontend_queued_requests") == 0
        )
    text = log.read_text()
    assert "request failed" not in text and "ClientDisconnect" not in text, text[-2000:]


def tracker_loads(url: str) -> dict[int, int]:
    """Active prefill tokens + decode blocks per worker in a tracker's (or the frontend's) ``/loads``."""
    out: dict[int, int] = {}
    for r in httpx.get(url + "/loads", timeout=10).json():
        out[r["worker_id"]] = out.get(r["worker_id"], 0) + r["active_prefill_tokens"] + r["active_decode_blocks"]
    return out


@contextlib.contextmanager
def slot_tracker(port: int, pub: int, peer: str) -> Iterator[dict]:
    """A standalone tracker subscribed to the frontend's replica sync, with the frontend's two workers
    registered (replica events only apply to ranks the tracker knows; registration is its own state)."""
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "slot_tracker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--replica-sync-bind",
        f"tcp://127.0.0.1:{pub}",
        "--replica-sync-peers",
        peer,
    ]
    with service(args, ready_url=f"{url}/health", timeout=60) as proc:
        for wid in (1, 2):
            r = httpx.post(
                url + "/register",
                timeout=10,
                json={"worker_id": wid, "model_name": MODEL, "block_size": BS, "dp_start": 0, "dp_size": 1},
            )
            assert r.status_code == 201, r.text
        yield {"url": url, "proc": proc}


def test_standalone_tracker_restarted_under_load_converges_again_and_the_frontend_keeps_serving():
    fe_port, tr_port, m1, m2 = free_ports(4)
    fe_pub, tr_pub = free_port_block(1), free_port_block(1)
    (p1, r1), (p2, r2) = (free_port_block(1), free_port_block(1)), (free_port_block(1), free_port_block(1))
    fe_sync = f"tcp://127.0.0.1:{fe_pub}"
    stop = threading.Event()
    codes: list[int | str] = []

    def traffic() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(100_000):  # bounded by `stop`, and by the count
                if stop.is_set():
                    return
                try:
                    r = client.post(
                        fe + "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "max_tokens": 24,
                            "ignore_eos": True,
                            "messages": [{"role": "user", "content": prompt_text(40)}],
                        },
                    )
                    codes.append(r.status_code)
                except httpx.HTTPError as exc:
                    codes.append(repr(exc))

    with (
        mocker(m1, p1, r1),
        mocker(m2, p2, r2),
        frontend(
            fe_port,
            [f"id=1,url=http://127.0.0.1:{m1}", f"id=2,url=http://127.0.0.1:{m2}"],
            "--router-replica-sync",
            "--replica-sync-bind",
            fe_sync,
        ) as fe,
    ):
        threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
        try:
            with slot_tracker(tr_port, tr_pub, fe_sync) as tr:
                for t in threads:
                    t.start()
                wait_until(
                    lambda: any(tracker_loads(tr["url"]).values()),
                    timeout=60,
                    what="the frontend's bookings in the tracker",
                )
                kill(tr["proc"])
                served = len(codes)
            # the tracker is down: the frontend keeps serving
            wait_until(lambda: len(codes) >= served + 8, timeout=60, what="requests served while the tracker is down")
            with slot_tracker(tr_port, tr_pub, fe_sync) as tr:
                wait_until(
                    lambda: any(tracker_loads(tr["url"]).values()), timeout=60, what="bookings in the restarted tracker"
                )
                stop.set()
                for t in threads:
                    t.join(timeout=120)
                assert not any(t.is_alive() for t in threads)
                wait_until(lambda: loads_zero(fe), timeout=30, what="the frontend's loads back to 0")
                wait_until(
                    lambda: not any(tracker_loads(tr["url"]).values()), timeout=30, what="the tracker's loads back to 0"
                )
                assert set(tracker_loads(tr["url"])) == {1, 2}
        finally:
            stop.set()
    assert codes and all(c == 200 for c in codes), [c for c in codes if c != 200][:5]
