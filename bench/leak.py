"""Leak test: many requests through the frontend with client cancellations and worker faults; then
nothing may be left booked, queued or in flight, and the index must equal the engines' caches.

    python -m bench leak                       # 10,000 requests, 4 mockers (docs/benchmarks.md)
    python -m bench leak --requests 300        # the CI version (tests/test_leak.py)

``--cancel`` (10 %) of the requests are abandoned by the client at a random point: before the
response's first byte (the request task is cancelled after a random delay) or mid-stream (after a
random number of chunks). ``--faults`` (5 %) of the requests are fault requests: when its first byte
arrives, a random mocker that is up is killed (SIGKILL, its cache is lost) and restarted on the same
HTTP and ZMQ ports; at most ``--max-down`` mockers are down at once, so a fault request that finds
them all restarting injects nothing (the report counts faults injected and skipped). The frontend
runs with ``--migration-limit 3`` so streams on a killed worker continue elsewhere.

Afterwards (every mocker back and healthy in the frontend): every row of ``/loads`` is 0, the
frontend's queued / in-flight / active gauges are 0, and the embedded index (``/admin/kv_dump``)
equals the union of the mockers' caches (``/mocker/kv_blocks``) per worker and rank, exactly.
Writes ``leak.json`` under ``--out``; exits 1 if a check fails.

    python -m bench leak --engines vllm        # 2 vLLM CPU engines, 3 restarts (KVROUTE_VLLM_PYTHON)

``--engines vllm`` (``run_vllm``; CI: the last test of tests/test_vllm_e2e.py on its shared engines):
scripted multi-turn conversations (some abandoned by the client) go through the frontend while
``--restarts`` times an engine is SIGKILLed in the middle of a long witness stream and started again
on its ports; the witness must end as one complete stream (migrated), no other request may fail.
The same checks follow; vLLM has no cache dump, so the engines' caches are what their own KV events
say (``EventTap``: subscribed apart from the frontend, restarted with the engine), and requests of
the load are sent again pinned to each engine: the overlap kvroute predicts must equal the
``cached_tokens`` vLLM reports. The frontend's RSS is read after every cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

MODEL = "kvroute-demo"
GAUGES = ("dynamo_frontend_queued_requests", "dynamo_frontend_inflight_requests", "dynamo_frontend_active_requests")


def _prompt_pool(seed: int) -> tuple[list[str], list[str]]:
    import pydoc_data.topics as topics

    rng = random.Random(seed)
    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    systems = [text[o : o + 1500] for o in (rng.randrange(0, len(text) - 1500) for _ in range(24))]
    return systems, text.split()


class Faults:
    """Kills and restarts mockers on request, never more than ``max_down`` at once."""

    def __init__(self, cluster: Any, rng: random.Random, max_down: int) -> None:
        self.cluster = cluster
        self.rng = rng
        self.max_down = max_down
        self.down: set[int] = set()
        self.injected = 0
        self.skipped = 0
        self.port_retries = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def inject(self) -> None:
        up = [w for w in self.cluster.workers if w.worker_id not in self.down]
        if len(self.down) >= self.max_down or not up:
            self.skipped += 1
            return
        w = self.rng.choice(up)
        self.down.add(w.worker_id)
        self.injected += 1
        task = asyncio.get_running_loop().create_task(self._restart(w))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _restart(self, w: Any) -> None:
        try:
            # on this (the main) thread: the child's parent-death signal fires when the thread that
            # spawned it ends, and the executor's threads end with asyncio.run
            for attempt in range(5):
                self.cluster.restart_mocker(w)
                try:
                    await asyncio.to_thread(_wait_http, f"{w.url}/health", 90.0, w)
                    break
                except RuntimeError:  # a port still held (another process, or a TCP self-connect of a
                    if attempt == 4:  # client retrying the dead port): start it again a little later
                        raise
                    self.port_retries += 1
                    await asyncio.sleep(1.0)
        finally:
            self.down.discard(w.worker_id)


def _wait_http(url: str, timeout: float, worker: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if worker is not None and not worker.child.alive():
            raise RuntimeError(f"mocker {worker.worker_id} exited:\n{worker.child.log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} not ready after {timeout:g} s")
        time.sleep(0.1)


def _json(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        return {"error": f"not JSON: {text[:200]}"}
    return obj if isinstance(obj, dict) else {"error": f"not an object: {text[:200]}"}


async def _exchange(
    c: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    cut_chunks: int | None = None,
    on_first_byte: Callable[[], None] | None = None,
    headers: dict[str, str] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[str, str]:
    """One chat request read to its end (or to ``cut_chunks`` events, then abandoned): its outcome and
    the assistant's text (``on_event`` sees every streamed event). An error event inside a 200 stream
    is an error, not a completed answer."""
    req = c.build_request("POST", f"{url}/v1/chat/completions", json=body, headers=headers)
    resp = await c.send(req, stream=True)
    try:
        if on_first_byte is not None:
            on_first_byte()
        chunks = 0
        done = error = False
        text: list[str] = []
        unary: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if line == "data: [DONE]":
                    done = True
                else:
                    event = _json(line[6:])
                    error = error or "error" in event
                    if on_event is not None:
                        on_event(event)
                    text += [(ch.get("delta") or {}).get("content") or "" for ch in event.get("choices") or []]
                if cut_chunks is not None and chunks >= cut_chunks:
                    return "cancelled_mid_stream", ""
            elif not body.get("stream") and line:
                unary.append(line)
        if cut_chunks is not None:
            return "cancelled_mid_stream", ""  # the answer was shorter than the cut: closed at its end
        if resp.status_code != 200:
            return f"status_{resp.status_code}", ""
        if unary:
            done = True
            text += [
                (ch.get("message") or {}).get("content") or "" for ch in _json("".join(unary)).get("choices") or []
            ]
        if error:
            return "stream_error", ""
        return ("ok" if done else "incomplete"), "".join(text)
    finally:
        await resp.aclose()


async def _abandoned(url: str, body: dict[str, Any], delay: float) -> tuple[str, str]:
    """A request the client gives up on after ``delay`` seconds, before its first byte unless the
    answer was quicker. On a client of its own: cancelling httpx's ``send`` while it waits for the
    response head can leave its connection pool a slot short for good (httpcore 1.0.9), and a shared
    pool ran out after enough cancellations (every client then waited for a connection)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as own:
        try:
            return await asyncio.wait_for(_exchange(own, url, body), timeout=delay)
        except TimeoutError:
            return "cancelled_before_first_byte", ""


async def _drive(url: str, n: int, concurrency: int, cancel: float, fault: float, seed: int, faults: Faults) -> Counter:
    """N requests over ``concurrency`` clients; returns outcome counts."""
    systems, words = _prompt_pool(seed)
    rng = random.Random(seed)
    out: Counter = Counter()
    todo = iter(range(n))

    async def one(c: httpx.AsyncClient) -> None:
        stream = rng.random() < 0.8
        body = {
            "model": MODEL,
            "stream": stream,
            "max_tokens": rng.randint(2, 24),
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))},
            ],
        }
        r = rng.random()
        kind = "cancel" if r < cancel else "fault" if r < cancel + fault else "normal"
        cut_chunks = rng.randint(1, 6) if kind == "cancel" and rng.random() < 0.5 else None  # mid-stream
        before_first_byte = kind == "cancel" and cut_chunks is None
        try:
            if before_first_byte:
                out[(await _abandoned(url, body, rng.uniform(0.0, 0.05)))[0]] += 1
            else:
                out[(await _exchange(c, url, body, cut_chunks, faults.inject if kind == "fault" else None))[0]] += 1
        except httpx.HTTPError as exc:
            out[f"client_error_{type(exc).__name__}"] += 1

    async def client(c: httpx.AsyncClient) -> None:
        for _ in todo:
            await one(c)

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
        if faults.tasks:
            await asyncio.gather(*list(faults.tasks))
    return out


def _gauges(metrics_text: str) -> dict[str, float]:
    """Sum of each of GAUGES over its labels."""
    out = {g: 0.0 for g in GAUGES}
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def index_blocks(dump: dict[str, Any]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """The device-tier blocks of a ``/dump`` per (worker_id, dp_rank): {(block_hash, tokens_hash)}."""
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for part in dump.values():
        for ev in part["events"]:
            if ev.get("storage_tier", "device") != "device":
                continue
            stored = ev["event"]["data"].get("stored")
            if not stored:
                continue
            key = (int(ev["worker_id"]), int(ev["event"]["dp_rank"]))
            out.setdefault(key, set()).update((b["block_hash"], b["tokens_hash"]) for b in stored["blocks"])
    return out


def mocker_blocks(workers: list[Any]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """Every mocker rank's cached blocks, keyed like ``index_blocks``; ranks without blocks omitted."""
    out = {}
    for w in workers:
        for rank in range(w.dp_size):
            snap = httpx.get(f"{w.url}/mocker/kv_blocks", params={"dp_rank": rank}, timeout=30).json()
            blocks = {(b["block_hash"], b["tokens_hash"]) for b in snap["blocks"]}
            if blocks:
                out[(w.worker_id, rank)] = blocks
    return out


def index_diff(
    have: dict[tuple[int, int], set[tuple[int, int]]], want: dict[tuple[int, int], set[tuple[int, int]]]
) -> dict[str, dict[str, int]]:
    """Per ``worker:rank`` whose blocks differ: how many the index misses and how many it has extra."""
    return {
        f"{k[0]}:{k[1]}": {
            "missing": len(want.get(k, set()) - have.get(k, set())),
            "extra": len(have.get(k, set()) - want.get(k, set())),
        }
        for k in sorted(set(want) | set(have))
        if want.get(k, set()) != have.get(k, set())
    }


def check(
    cluster: Any,
    timeout: float = 60.0,
    cache_blocks: Callable[[], dict[tuple[int, int], set[tuple[int, int]]]] | None = None,
) -> dict[str, Any]:
    """Poll until the invariants hold or ``timeout`` passes; the last observation either way.
    ``cache_blocks`` reads the engines' caches (default: the mockers' ``/mocker/kv_blocks``)."""
    url = cluster.frontend_url
    read_caches = cache_blocks or (lambda: mocker_blocks(cluster.workers))
    deadline = time.monotonic() + timeout
    while True:
        loads = httpx.get(f"{url}/loads", timeout=10).json()
        busy = [row for row in loads if row["active_prefill_tokens"] or row["active_decode_blocks"]]
        gauges = _gauges(httpx.get(f"{url}/metrics", timeout=10).text)
        health = httpx.get(f"{url}/health", timeout=10).json()
        unhealthy = [i.get("worker_id") for i in health.get("instances", []) if not i.get("healthy")]
        want = read_caches()
        have = index_blocks(httpx.get(f"{url}/admin/kv_dump", timeout=30).json())
        diff = index_diff(have, want)
        result = {
            "loads_rows": len(loads),
            "loads_nonzero": busy,
            "gauges": gauges,
            "unhealthy_workers": unhealthy,
            "index_blocks": sum(len(v) for v in have.values()),
            "engine_blocks": sum(len(v) for v in want.values()),
            "index_diff": diff,
        }
        ok = not busy and not any(gauges.values()) and not unhealthy and not diff and len(loads) == len(cluster.workers)
        result["ok"] = ok
        if ok or time.monotonic() >= deadline:
            return result
        time.sleep(0.5)


# -- real engines (vLLM's CPU build) ----------------------------------------------------------------


class EventTap:
    """What each vLLM engine holds, read from its own KV events: one subscriber thread per engine
    rank applying them to an index of its own (the indexer's decoding and hashing, so its dump
    compares block for block with the frontend's). vLLM has no cache dump endpoint; its events are
    its own account of its cache. An engine that was already running is caught up from its replay
    socket (from batch 0); ``restart(i)`` (after the engine was killed, before it starts again)
    forgets the old process's blocks and subscribes afresh, so the new process's events are read
    from its first batch. A batch this tap cannot account for (a gap its replay did not fill, or a
    replay buffer that no longer starts at 0) is counted in ``incomplete``: then the comparison
    proves nothing and the check fails."""

    POLL_MS = 100
    REPLAY_TIMEOUT_MS = 5000

    def __init__(self, engines: list[Any], block_size: int) -> None:
        import zmq

        from indexer.core import KvIndex

        self.engines = engines
        self.ctx = zmq.Context()
        self.index = KvIndex(block_size)
        self.lock = threading.Lock()
        self.incomplete: list[str] = []
        self._threads: dict[int, tuple[threading.Thread, threading.Event]] = {}
        for i in range(len(engines)):
            self._start(i, catch_up=True)

    def _start(self, i: int, catch_up: bool) -> None:
        stop = threading.Event()
        ready = threading.Event()
        thread = threading.Thread(target=self._run, args=(i, stop, ready, catch_up), daemon=True)
        thread.start()
        ready.wait(10.0)  # subscribed (and caught up) before the caller goes on
        self._threads[i] = (thread, stop)

    def _run(self, i: int, stop: threading.Event, ready: threading.Event, catch_up: bool) -> None:
        import zmq

        from indexer.normalize import EventApplier
        from indexer.wire import decode_batch, parse_seq

        engine = self.engines[i]
        subs = []
        last: dict[int, int | None] = {}
        appliers = {}
        for rank in range(engine.dp_size):
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(engine.kv_endpoint(rank))
            subs.append(sub)
            last[rank] = None
            appliers[rank] = EventApplier(self.index, i + 1, rank)

        def apply(rank: int, seq: int, payload: bytes) -> None:
            with self.lock:
                appliers[rank].apply_batch(decode_batch(payload))
            last[rank] = seq

        def replay(rank: int, start: int) -> None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(engine.replay_endpoint(rank))
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                first = True
                while True:
                    if not dealer.poll(self.REPLAY_TIMEOUT_MS):
                        self.incomplete.append(f"worker {i + 1} rank {rank}: replay from {start} timed out")
                        return
                    *_, seq_frame, payload = dealer.recv_multipart()
                    if not payload:
                        return
                    seq = parse_seq(seq_frame)
                    if first and seq != start:
                        self.incomplete.append(f"worker {i + 1} rank {rank}: replay from {start} began at {seq}")
                    first = False
                    if last[rank] is None or seq > last[rank]:  # type: ignore[operator]
                        apply(rank, seq, payload)
            finally:
                dealer.close(0)

        try:
            if catch_up:
                for rank in range(engine.dp_size):
                    replay(rank, 0)
            ready.set()
            poller = zmq.Poller()
            for sub in subs:
                poller.register(sub, zmq.POLLIN)
            while not stop.is_set():
                for sock, _ in poller.poll(self.POLL_MS):
                    rank = subs.index(sock)
                    frames = sock.recv_multipart()
                    if len(frames) != 3:
                        continue
                    seq, prev = parse_seq(frames[1]), last[rank]
                    if prev is not None and seq <= prev:
                        continue  # already applied from a replay
                    expected = 0 if prev is None else prev + 1
                    if seq > expected:
                        replay(rank, expected)
                        prev = last[rank]
                        if prev is not None and seq <= prev:
                            continue
                        if seq != (0 if prev is None else prev + 1):
                            self.incomplete.append(f"worker {i + 1} rank {rank}: batches before {seq} lost")
                    apply(rank, seq, frames[2])
        finally:
            ready.set()
            for sub in subs:
                sub.close(0)

    def _stop(self, i: int) -> None:
        thread, stop = self._threads.pop(i)
        stop.set()
        thread.join(10.0)

    def restart(self, i: int) -> None:
        """Engine ``i`` (0-based) was killed: its cache is gone; read the next process from its start."""
        self._stop(i)
        with self.lock:
            for rank in range(self.engines[i].dp_size):
                self.index.apply_cleared(i + 1, rank)
        self._start(i, catch_up=False)

    def blocks(self) -> dict[tuple[int, int], set[tuple[int, int]]]:
        """The engines' blocks as ``index_blocks`` reads the frontend's dump."""
        with self.lock:
            return index_blocks({"tap": {"events": self.index.dump_events()}})

    def close(self) -> None:
        for i in list(self._threads):
            self._stop(i)
        self.ctx.term()


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (/proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _route(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /admin/route``: the decision ``body`` would get now (nothing booked or sent)."""
    r = httpx.post(f"{url}/admin/route", json=body, timeout=10)
    r.raise_for_status()
    return dict(r.json())


def _in_flight(record: dict[str, Any]) -> dict[int, int]:
    """The requests the frontend has booked on each worker (its slot tracker's count, summed over the
    worker's ranks) in an ``/admin/route`` record."""
    out: dict[int, int] = {}
    for c in record["candidates"]:
        out[int(c["worker_id"])] = out.get(int(c["worker_id"]), 0) + int(c["active_requests"])
    return out


class Gate:
    """Lets the conversations' requests through while open. ``close`` holds back the ones not yet sent
    and waits until those under way have ended (for the client: abandoned ones may still be on their
    way out of the frontend); ``open`` lets them go on."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        while not self._open.is_set():  # opened and closed again before this waiter ran: wait again
            await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def close(self, timeout: float) -> None:
        self._open.clear()
        await asyncio.wait_for(self._idle.wait(), timeout)

    def open(self) -> None:
        self._open.set()


class EngineRestarts:
    """Restart cycles of real engines under load. Each cycle streams a long witness request (a prompt
    of its own) while the conversations hold back their next requests, so the witness is the only
    request the frontend has in flight: the worker it is booked on serves it. The conversations go on,
    that engine is SIGKILLed mid-stream and started again on its ports; the witness must still end as
    one complete stream, on the other worker (migrated). The frontend's RSS is read after every
    cycle."""

    PORT_ATTEMPTS = 3

    def __init__(
        self, cluster: Any, engines: list[Any], tap: EventTap, witness_tokens: int, timeout: float = 600.0
    ) -> None:
        self.port_retries = 0
        self.unkilled: list[dict[str, Any]] = []  # why each witness that ended unkilled did
        self.cluster = cluster
        self.engines = engines
        self.tap = tap
        self.witness_tokens = witness_tokens
        self.timeout = timeout
        self.url = cluster.frontend_url

    def _restart(self, i: int) -> float:
        """Kill engine ``i``, start it again, wait until it and the frontend's view of it are healthy;
        the seconds it was down."""
        from kvroute_common.local_cluster import Child
        from kvroute_common.ports import free_port_block
        from kvroute_common.processes import wait_until

        engine, worker = self.engines[i], self.cluster.workers[i]
        t0 = time.monotonic()
        engine.kill()
        self.tap.restart(i)
        for attempt in range(self.PORT_ATTEMPTS):
            offset = os.path.getsize(engine.log_path) if os.path.exists(engine.log_path) else 0
            try:
                engine.start().wait_ready()
                break
            except RuntimeError:
                with open(engine.log_path, "rb") as f:
                    f.seek(offset)
                    log = f.read().decode("utf-8", "replace")
                # another process bound one of its KV-event ports while it was down (ports below the
                # ephemeral range are free for anyone to take): new ones, which the frontend reads
                # from the engine's /kv_event_sources (its workers are given by URL)
                if attempt == self.PORT_ATTEMPTS - 1 or "Address already in use (addr='tcp://" not in log:
                    raise
                engine.kv_port = free_port_block(engine.dp_size)
                engine.replay_port = free_port_block(engine.dp_size)
                self.tap.restart(i)
                self.port_retries += 1
        worker.child = Child(worker.child.name, engine.proc, engine.log_path)

        def back() -> bool:
            rows = httpx.get(f"{self.url}/admin/workers", timeout=5).json()["workers"]
            row = next(r for r in rows if r["id"] == worker.worker_id)
            listeners = row.get("kv_events", {}).get("listeners", {})
            return (
                bool(row["healthy"])
                and row.get("kv_events", {}).get("status") == "active"
                and listeners.get("0", {}).get("endpoint") == engine.kv_endpoint()
            )

        wait_until(back, self.timeout, 0.2, f"worker {worker.worker_id} healthy in the frontend again")
        return time.monotonic() - t0

    def _unkilled(self, tag: str, task: asyncio.Task[tuple[str, str]], **seen: Any) -> None:
        """A witness that ended before its engine was killed: None (try another, ``seen`` kept in
        ``unkilled``), or an error if it failed."""
        outcome = task.result()[0]
        if outcome != "ok":
            raise RuntimeError(f"witness {tag} failed before its engine was killed: {outcome}")
        self.unkilled.append({"witness": tag, **seen})

    async def cycle(self, c: httpx.AsyncClient, n: int, gate: Gate) -> dict[str, Any]:
        """One restart of the engine serving a witness stream (``gate``: the conversations' requests).
        A witness that ends before its engine is killed (every token generated and received by then:
        it ends on the killed worker, not migrated) was not killed mid-stream: a new witness, with a
        prompt of its own, is started instead (at most 3)."""
        for attempt in range(3):
            row = await self._witness_cycle(c, f"{n}.{attempt}", gate)
            if row is not None:
                return row
        raise RuntimeError(f"restart cycle {n}: three witnesses ended before their engine was killed: {self.unkilled}")

    async def _witness_cycle(self, c: httpx.AsyncClient, tag: str, gate: Gate) -> dict[str, Any] | None:
        from kvroute_common.processes import wait_until
        from kvroute_common.real_engines.vllm_cpu import SERVED_NAME

        system = " ".join(f"Witness {tag}, rule {k}: keep streaming through restarts." for k in range(24))
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell a long story."}],
            "max_tokens": self.witness_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            # the last attempt's worker and routing decision, on the chunk with the finish reason
            "nvext": {"extra_fields": ["worker_id", "routing"]},
        }
        route_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "nvext")}
        events: list[dict[str, Any]] = []
        first = asyncio.Event()

        def on_event(event: dict[str, Any]) -> None:
            events.append(event)
            if any((ch.get("delta") or {}).get("content") for ch in event.get("choices") or []):
                first.set()  # a generated token (a role-only event carries none)

        def frontend_idle() -> bool:
            return not any(_gauges(httpx.get(f"{self.url}/metrics", timeout=10).text).values()) and not any(
                _in_flight(_route(self.url, route_body)).values()
            )

        polls: list[dict[int, int]] = []  # the in-flight requests each poll saw, for a witness that ends unkilled

        def booked_alone() -> tuple[int, int] | None:
            """The witness's worker and its prompt length once the frontend has booked it (before it
            sends it to the engine; the index learns the prompt only from the engine's KV events)."""
            record = _route(self.url, route_body)
            busy = {w: k for w, k in _in_flight(record).items() if k}
            polls.append(busy)
            if len(busy) == 1 and sum(busy.values()) == 1:
                return next(iter(busy)), int(record["isl"])
            return None

        loop = asyncio.get_running_loop()
        task: asyncio.Task[tuple[str, str]] | None = None
        try:
            await gate.close(self.timeout)
            await asyncio.to_thread(
                wait_until, frontend_idle, 60.0, 0.1, "no request in the frontend but the witness's (gate closed)"
            )
            task = loop.create_task(_exchange(c, self.url, body, on_event=on_event))
            started = loop.time()
            deadline = started + self.timeout
            while True:  # the only request in flight: the worker it is booked on serves it
                found = await asyncio.to_thread(booked_alone)
                if found is not None:
                    victim, isl = found
                    break
                if task.done():  # over before its worker was read: no mid-stream kill to see
                    self._unkilled(
                        tag, task, stage="before booked alone", s=round(loop.time() - started, 2),
                        events=len(events), polls=len(polls), last_polls=polls[-3:],
                    )  # fmt: skip
                    return None
                if loop.time() >= deadline:
                    raise TimeoutError(f"witness {tag}: not booked alone after {self.timeout:g} s")
                await asyncio.sleep(0.01)  # the poll's interval, under the deadline above
            # killed at its first token, here on the loop: a tiny model generates the whole witness in
            # well under a second, and a client reading the stream can lag the engine by much of it
            first_token = loop.create_task(first.wait())
            await asyncio.wait([task, first_token], timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            first_token.cancel()
            if not first.is_set():
                if task.done():
                    self._unkilled(
                        tag, task, stage="before a token", s=round(loop.time() - started, 2), events=len(events)
                    )
                    return None
                raise TimeoutError(f"witness {tag}: no first token after {self.timeout:g} s")
            self.engines[victim - 1].kill()
        except BaseException:
            if task is not None:
                task.cancel()
            raise
        finally:
            gate.open()
        events_at_kill = len(events)
        down_s = await asyncio.to_thread(self._restart, victim - 1)
        outcome, _ = await asyncio.wait_for(task, self.timeout)
        ends = [e["nvext"] for e in events if isinstance(e.get("nvext"), dict)]
        finished_on = ends[-1].get("worker_id", {}).get("decode_worker_id") if ends else None
        if finished_on == victim:
            # nothing was cut: the engine had generated the whole witness (its tail still on its way to a
            # slow client) when it was killed
            self.unkilled.append(
                {"witness": tag, "stage": "whole stream sent before the kill", "events": events_at_kill}
            )
            return None
        # a continuation is routed with the prompt and the text generated so far: a longer input
        last_isl = ends[-1].get("routing", {}).get("isl") if ends else None
        finishes = [ch.get("finish_reason") for e in events for ch in e.get("choices") or [] if ch.get("finish_reason")]
        usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None) or {}
        return {
            "victim": victim,
            "finished_on": finished_on,
            "isl": isl,
            "last_isl": last_isl,
            "killed_after_events": events_at_kill,
            # it began on the victim (the only request booked anywhere) and was continued on another worker
            "mid_stream": finished_on is not None and finished_on != victim and (last_isl or 0) > isl,
            "down_s": round(down_s, 1),
            "witness": outcome,
            "witness_complete": outcome == "ok"
            and len({e.get("id") for e in events}) == 1
            and finishes == ["length"]
            and usage.get("completion_tokens") == self.witness_tokens,
            "frontend_rss_mb": round(rss_mb(self.cluster.frontend.proc.pid), 1),
        }


async def _converse(
    c: httpx.AsyncClient,
    url: str,
    stop: asyncio.Event,
    concurrency: int,
    cancel: float,
    seed: int,
    scripts: int = 16,
    think: float = 0.2,
    gate: Gate | None = None,
) -> tuple[Counter, list[dict[str, Any]]]:
    """Multi-turn conversations on ``concurrency`` clients until ``stop``: each picks one of ``scripts``
    scripted conversations (4 shared system prompts, 2-5 user turns, each turn the whole conversation
    so far with the engine's greedy answers) and pauses up to ``think`` seconds between turns (the
    pace of a user, so the engines restarting are not starved of CPU). A bounded set of scripts keeps
    the engines' caches, and so the index, at a steady size once each has run: the frontend's memory
    is then comparable from cycle to cycle. A conversation ends early when its client abandons a
    request. Each request is sent through ``gate`` (held back while it is closed). Returns outcome
    counts and the completed requests (the last of each script's turns)."""
    from kvroute_common.real_engines.vllm_cpu import SERVED_NAME

    gate = gate or Gate()
    systems, words = _prompt_pool(seed)
    rng = random.Random(seed)
    script_rng = random.Random(seed + 1)
    script_turns = [
        [" ".join(script_rng.choice(words) for _ in range(script_rng.randint(10, 40))) for _ in range(2 + k % 4)]
        for k in range(scripts)
    ]
    out: Counter = Counter()
    served: dict[tuple[int, int], dict[str, Any]] = {}

    async def conversation(k: int) -> None:
        messages = [{"role": "system", "content": systems[k % 4]}]
        for turn, user in enumerate(script_turns[k]):
            messages = [*messages, {"role": "user", "content": user}]
            body = {
                "model": SERVED_NAME,
                "messages": messages,
                "stream": rng.random() < 0.8,
                "max_tokens": 4 + (7 * k + turn) % 13,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            r = rng.random()
            cut_chunks = rng.randint(1, 4) if r < cancel / 2 else None
            async with gate.request():
                try:
                    if cancel / 2 <= r < cancel:
                        outcome, text = await _abandoned(url, body, rng.uniform(0.0, 0.05))
                    else:
                        outcome, text = await _exchange(c, url, body, cut_chunks)
                except httpx.HTTPError as exc:
                    outcome, text = f"client_error_{type(exc).__name__}", ""
            out[outcome] += 1
            if outcome != "ok":
                return
            served[(k, turn)] = body
            messages = [*messages, {"role": "assistant", "content": text or "ok"}]
            await asyncio.sleep(rng.uniform(0.0, think))  # think time: pacing, not synchronisation

    async def client() -> None:
        while not stop.is_set():
            await conversation(rng.randrange(scripts))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, list(served.values())


def probe(url: str, bodies: list[dict[str, Any]], workers: list[int], tap: EventTap, n: int) -> dict[str, Any]:
    """Requests of the load sent again, unary, pinned to each worker in turn: the overlap kvroute
    predicted must equal the tokens vLLM reports cached. Before each, the index equals the tap (the
    previous probe's blocks learnt), so the prediction is exact."""
    from kvroute_common.real_engines.vllm_cpu import expected_cached

    rng = random.Random(len(bodies))
    picked = rng.sample(bodies, min(n, len(bodies)))
    rows = []
    for worker in workers:
        for body in picked:
            _wait_index_equals(url, tap)
            probe_body = {**body, "stream": False, "max_tokens": 1, "nvext": {"extra_fields": ["routing"]}}
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json=probe_body,
                headers={"x-dynamo-worker-instance-id": str(worker)},
                timeout=120,
            )
            r.raise_for_status()
            out = r.json()
            overlap = int(out["nvext"]["routing"]["overlap_blocks"])
            prompt = int(out["usage"]["prompt_tokens"])
            cached = int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            rows.append({"worker": worker, "overlap_blocks": overlap, "prompt_tokens": prompt, "cached_tokens": cached,
                         "match": cached == expected_cached(overlap, prompt)})  # fmt: skip
    _wait_index_equals(url, tap)
    return {
        "probes": len(rows),
        "matches": sum(r["match"] for r in rows),
        "with_overlap": sum(r["overlap_blocks"] > 0 for r in rows),
        "mismatches": [r for r in rows if not r["match"]],
    }


def _wait_index_equals(url: str, tap: EventTap, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        diff = index_diff(index_blocks(httpx.get(f"{url}/admin/kv_dump", timeout=30).json()), tap.blocks())
        if not diff:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the index differs from the engines' caches after {timeout:g} s: {diff}")
        time.sleep(0.2)


async def _vllm_load(
    restarts: EngineRestarts, cycles: int, concurrency: int, cancel: float, seed: int
) -> tuple[Counter, list[dict[str, Any]], list[dict[str, Any]], float]:
    """The conversations run while ``cycles`` restart cycles happen one after the other."""
    stop = asyncio.Event()
    gate = Gate()
    limits = httpx.Limits(max_connections=concurrency * 2 + 2, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as c:
        load = asyncio.get_running_loop().create_task(
            _converse(c, restarts.url, stop, concurrency, cancel, seed, gate=gate)
        )
        try:
            baseline = rss_mb(restarts.cluster.frontend.proc.pid)
            done = [await restarts.cycle(c, n, gate) for n in range(cycles)]
        except BaseException:
            load.cancel()
            raise
        stop.set()
        outcomes, served = await load
    return outcomes, served, done, baseline


def run_vllm(
    engines: list[Any],
    model_dir: str,
    cycles: int = 3,
    concurrency: int = 3,
    cancel: float = 0.1,
    seed: int = 0,
    probes: int = 4,
    witness_tokens: int = 1000,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """The leak test against running vLLM engines (each becomes worker index+1): a frontend (kv,
    ``--migration-limit 3``), conversations through it while ``cycles`` engines are killed mid-stream
    and restarted, then ``check`` against the engines' own KV events and the probes. The engines are
    left running (restarted ones on their ports)."""
    from bench.real_engines import engine_workers
    from kvroute_common.local_cluster import Cluster
    from kvroute_common.real_engines.vllm_cpu import SERVED_NAME

    cluster = Cluster(log_dir=log_dir)
    cluster.workers = engine_workers(engines)
    tap = EventTap(engines, engines[0].block_size)
    try:
        fe_args = ["--log-level", "warning", "--migration-limit", "3", "--health-check-interval", "0.5"]
        fe_args += ["--kv-cache-block-size", str(engines[0].block_size)]
        # workers given by URL: the frontend reads each engine's KV-event endpoints from it, again
        # after a restart (an engine restarted on other event ports is followed)
        cluster.start_frontend("kv", extra_args=fe_args, model_path=model_dir, kv_events=False)
        cluster.wait_frontend_ready(SERVED_NAME, 120)
        t0 = time.monotonic()
        restarts = EngineRestarts(cluster, engines, tap, witness_tokens)
        outcomes, served, done, rss_baseline = asyncio.run(_vllm_load(restarts, cycles, concurrency, cancel, seed))
        load_s = time.monotonic() - t0
        cluster.wait_frontend_ready(SERVED_NAME, 120)
        result = check(cluster, cache_blocks=tap.blocks)
        result["probes"] = probe(
            cluster.frontend_url or "", served, [w.worker_id for w in cluster.workers], tap, probes
        )
        result["migrations"] = _migrations(cluster.frontend_url or "")
        result["tap_incomplete"] = list(tap.incomplete)
        url = cluster.frontend_url or ""
        result["hash_parity"] = {
            "alarm": _metric(url, "kvroute_hash_parity_mismatch"),
            "matches": _metric(url, "kvroute_hash_parity_checks_total", result="match"),
            "mismatches": _metric(url, "kvroute_hash_parity_checks_total", result="mismatch"),
        }
        rss = [rss_baseline] + [c["frontend_rss_mb"] for c in done]
        cluster.check_alive()
    finally:
        tap.close()
        cluster.stop()
    result["ok"] = bool(
        result["ok"]
        and not result["tap_incomplete"]
        and not result["probes"]["mismatches"]
        and not result["hash_parity"]["alarm"]
        and all(c["mid_stream"] and c["witness_complete"] for c in done)
        and set(outcomes) <= {"ok", "cancelled_before_first_byte", "cancelled_mid_stream"}
    )
    return {
        "engines": "vllm",
        "outcomes": dict(sorted(outcomes.items())),
        "restart_cycles": done,
        "restart_port_retries": restarts.port_retries,
        "frontend_rss_mb": [round(x, 1) for x in rss],
        "load_seconds": round(load_s, 1),
        **result,
        "loadavg": os.getloadavg(),
    }


def _metric(url: str, name: str, **labels: str) -> float:
    """Sum of the frontend's samples of ``name`` with ``labels``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def _migrations(url: str) -> float:
    return _metric(url, "dynamo_frontend_model_migration_total")


def _main_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """``--engines vllm``: start the engines (the tiny model), run ``run_vllm``, stop them."""
    import shutil
    import tempfile

    from kvroute_common.real_engines import vllm_cpu

    python = vllm_cpu.vllm_python()
    if python is None:
        raise SystemExit(vllm_cpu.missing_reason())
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvroute-tiny-")
    engines = []
    try:
        model_dir = vllm_cpu.write_tiny_model(python, os.path.join(tmp, "model"), seed=args.seed)
        engines = [
            vllm_cpu.VllmEngine(python, model_dir, log_path=os.path.join(log_dir, f"vllm-{i}.log"))
            for i in range(1, args.workers + 1)
        ]
        t0 = time.monotonic()
        vllm_cpu.start_engines(engines)
        startup_s = time.monotonic() - t0
        report = run_vllm(engines, model_dir, args.restarts, args.concurrency, args.cancel, args.seed, log_dir=log_dir)
        report["engine_startup_s"] = round(startup_s, 1)
        return report
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench leak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engines",
        choices=("mocker", "vllm"),
        default="mocker",
        help="mocker: --requests through mockers with --faults; vllm: vLLM CPU engines (KVROUTE_VLLM_PYTHON) "
        "restarted --restarts times under a multi-turn load (default %(default)s)",
    )
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=None, help="engines (default 4 mockers, 2 vLLM)")
    p.add_argument("--concurrency", type=int, default=None, help="clients (default 16 with mockers, 3 with vLLM)")
    p.add_argument(
        "--cancel", type=float, default=0.10, help="share of requests the client abandons (default %(default)s)"
    )
    p.add_argument(
        "--faults",
        type=float,
        default=0.05,
        help="share of requests that kill and restart a mocker (default %(default)s)",
    )
    p.add_argument("--max-down", type=int, default=1, help="mockers down at once at most (default %(default)s)")
    p.add_argument("--restarts", type=int, default=3, help="vllm: restart cycles (default %(default)s)")
    p.add_argument("--speedup-ratio", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="leak-out")
    args = p.parse_args(argv)
    vllm = args.engines == "vllm"
    args.workers = args.workers or (2 if vllm else 4)
    args.concurrency = args.concurrency or (3 if vllm else 16)
    if vllm and (args.workers < 2 or args.restarts < 1 or not 0 <= args.cancel <= 1):
        p.error(
            "--engines vllm needs workers >= 2 (one serves while the other restarts), restarts >= 1, 0 <= cancel <= 1"
        )
    if not vllm and (
        args.requests <= 0
        or args.concurrency <= 0
        or not 0 <= args.cancel + args.faults <= 1
        or not 0 < args.max_down < args.workers
    ):
        p.error("need requests > 0, concurrency > 0, 0 <= cancel + faults <= 1, 0 < max-down < workers")
    os.makedirs(args.out, exist_ok=True)
    if vllm:
        report = {"args": vars(args), **_main_vllm(args)}
        ok = bool(report["ok"])
    else:
        report, ok = _main_mocker(args)
    with open(os.path.join(args.out, "leak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1), flush=True)
    return 0 if ok else 1


def _main_mocker(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from kvroute_common.local_cluster import MockerOptions, start_cluster

    opts = MockerOptions(speedup_ratio=args.speedup_ratio, num_gpu_blocks=1024)
    fe_args = ["--log-level", "warning", "--migration-limit", "3"]
    t0 = time.monotonic()
    with start_cluster(args.workers, opts, frontend_args=fe_args, log_dir=os.path.join(args.out, "logs")) as cluster:
        faults = Faults(cluster, random.Random(args.seed + 1), args.max_down)
        outcomes = asyncio.run(
            _drive(
                cluster.frontend_url or "", args.requests, args.concurrency, args.cancel, args.faults, args.seed, faults
            )
        )
        load_s = time.monotonic() - t0
        cluster.wait_workers_ready(90)
        cluster.wait_frontend_ready(MODEL, 90)
        result = check(cluster)
        result["migrations"] = _migrations(cluster.frontend_url or "")
        cluster.check_alive()
    report = {
        "args": vars(args),
        "outcomes": dict(sorted(outcomes.items())),
        "faults_injected": faults.injected,
        "faults_skipped_all_restarting": faults.skipped,
        "restart_port_retries": faults.port_retries,
        "load_seconds": round(load_s, 1),
        **result,
        "loadavg": os.getloadavg(),
    }
    return report, bool(result["ok"] and sum(outcomes.values()) == args.requests)


if __name__ == "__main__":
    sys.exit(main())
