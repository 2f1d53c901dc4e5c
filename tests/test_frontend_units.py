"""Frontend building blocks without processes: approximate index, worker specs, busy rules,
the upstream HTTP client against a real in-process uvicorn server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from types import SimpleNamespace

import pytest

from frontend.pool.workers import (
    WorkerSpec,
    parse_cache_config_info,
    parse_worker_arg,
    parse_workers_document,
    url_worker_id,
)
from frontend.routing.eligibility import rank_overloaded
from frontend.routing.models import BusyThresholds, validate_update
from indexer.approx import ApproxIndex
from kvroute_common.hashing import block_hashes


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _prompt(n_blocks: int, salt: int = 0, bs: int = 4) -> tuple[list[int], list[int]]:
    return block_hashes([salt * 100_000 + i for i in range(n_blocks * bs)], bs)


def test_approx_records_prefixes_and_expires_after_ttl() -> None:
    clock = Clock()
    ax = ApproxIndex(4, ttl_secs=10.0, clock=clock)
    local, seq = _prompt(3)
    ax.record(1, 0, local, seq)
    assert ax.find_matches(local) == {(1, 0): 3}
    assert ax.find_matches(local[:2]) == {(1, 0): 2}
    other_local, other_seq = _prompt(2, salt=1)
    clock.t += 6
    ax.record(2, 1, other_local, other_seq)
    ax.record(1, 0, local[:1], seq[:1])  # refreshes only the first block of worker 1
    clock.t += 5  # 11 s after the first record: blocks 2 and 3 of worker 1 expired, block 1 refreshed
    assert ax.find_matches(local) == {(1, 0): 1}
    assert ax.find_matches(other_local) == {(2, 1): 2}
    assert ax.size == 3
    clock.t += 100
    assert ax.find_matches(local) == {} and ax.find_matches(other_local) == {}
    assert ax.size == 0 and ax.index.size == 0


def test_approx_prunes_least_recently_used_children_first() -> None:
    clock = Clock()
    ax = ApproxIndex(4, ttl_secs=1000.0, max_tree_size=10, prune_target_ratio=0.5, clock=clock)
    a_local, a_seq = _prompt(4, salt=1)
    b_local, b_seq = _prompt(4, salt=2)
    c_local, c_seq = _prompt(3, salt=3)
    ax.record(1, 0, a_local, a_seq)
    clock.t += 1
    ax.record(1, 0, b_local, b_seq)
    clock.t += 1
    assert ax.size == 8
    ax.record(2, 0, c_local, c_seq)  # 11 > 10: prune down to 5, oldest (deepest of A first)
    assert ax.size == 5 and ax.index.size == 5
    assert ax.find_matches(a_local) == {}
    assert ax.find_matches(b_local) == {(1, 0): 2}  # B lost its two deepest blocks
    assert ax.find_matches(c_local) == {(2, 0): 3}


def test_approx_shared_prefix_and_remove_worker() -> None:
    ax = ApproxIndex(4, clock=Clock())
    local, seq = _prompt(4)
    ax.record(1, 0, local[:2], seq[:2])
    ax.record(1, 0, local, seq)  # extends the existing prefix
    ax.record(3, 0, local[:3], seq[:3])
    assert ax.find_matches(local) == {(1, 0): 4, (3, 0): 3}
    ax.remove_worker(1)
    assert ax.find_matches(local) == {(3, 0): 3}
    assert ax.size == 3


def test_approx_moves_a_slice_of_blocks_per_step_however_long_the_prompt_or_large_the_expiry() -> None:
    """A long prompt enters the prediction a slice per step, first blocks first (what is recorded is a
    prefix at once); a mass expiry and a prune past the size bound leave a slice per step too, until
    ``settle`` says nothing is left: the index ends as the unsliced prediction would."""
    clock = Clock()
    ax = ApproxIndex(4, ttl_secs=10.0, max_tree_size=60, prune_target_ratio=0.5, clock=clock, slice_blocks=8)
    local, seq = _prompt(50)
    ax.record(1, 0, local, seq)
    first = ax.index.size
    assert ax.unsettled and 0 < first <= 8 and ax.find_matches(local) == {(1, 0): first}
    steps = 0
    for _ in range(100):  # bounded: each step records a slice
        before = ax.index.size
        steps += 1
        more = ax.settle()
        assert 0 < ax.index.size - before <= 8 and ax.find_matches(local) == {(1, 0): ax.index.size}
        if not more:
            break
    assert steps == 6 and ax.find_matches(local) == {(1, 0): 50} and ax.size == 50
    other_local, other_seq = _prompt(20, salt=1)
    clock.t += 1
    ax.record(2, 0, other_local, other_seq)  # 70 > 60: pruned to 30, the first prompt's tail first
    for _ in range(100):
        before = ax.index.size
        if not ax.settle():
            break
        assert abs(ax.index.size - before) <= 8
    assert ax.size == ax.index.size == 30
    assert ax.find_matches(local) == {(1, 0): 10} and ax.find_matches(other_local) == {(2, 0): 20}
    clock.t += 100  # everything expired: removed a slice per call
    sizes = [ax.size]
    for _ in range(100):
        ax.expire()
        sizes.append(ax.size)
        if not ax.size:
            break
    assert sizes == [30, 22, 14, 6, 0] and ax.index.size == 0 and not ax.unsettled


def test_worker_arg_parsing_and_rank_endpoints() -> None:
    spec = parse_worker_arg(
        "id=1,url=http://127.0.0.1:8001/,dp_size=2,kv_events_endpoint=tcp://127.0.0.1:5557,replay_endpoint=tcp://127.0.0.1:5567"
    )
    assert spec.id == 1 and spec.url == "http://127.0.0.1:8001" and list(spec.ranks) == [0, 1]
    assert spec.rank_endpoint(spec.kv_events_endpoint, 1) == "tcp://127.0.0.1:5558"
    assert spec.rank_endpoint(spec.replay_endpoint, 0) == "tcp://127.0.0.1:5567"
    with pytest.raises(ValueError, match="url"):
        parse_worker_arg("id=3")
    with pytest.raises(ValueError, match="unknown worker field"):
        parse_worker_arg("id=3,url=http://127.0.0.1:1,colour=blue")
    with pytest.raises(ValueError, match="dp_size"):
        parse_worker_arg("id=3,url=http://127.0.0.1:1,dp_size=0")
    with pytest.raises(ValueError):
        WorkerSpec.from_mapping({"id": "x", "url": "http://127.0.0.1:1"})


def test_a_bare_url_is_a_worker_with_an_id_derived_from_the_url() -> None:
    spec = parse_worker_arg("http://gpu1:8001")
    assert spec.url == "http://gpu1:8001" and spec.id == url_worker_id("http://gpu1:8001")
    assert 0 <= spec.id < 1 << 53 and spec.kv_events_endpoint is None and spec.dp_size == 1
    # the same worker however it is written: the id follows the normalised URL
    assert {parse_worker_arg(u).id for u in ("http://gpu1:8001/", "http://gpu1:8001/v1", " http://gpu1:8001")} == {
        spec.id
    }
    assert parse_worker_arg("http://gpu2:8001").id != spec.id
    with_fields = parse_worker_arg("http://gpu1:8001,dp_size=2")
    assert with_fields.id == spec.id and with_fields.dp_size == 2
    assert parse_worker_arg("id=7,url=http://gpu1:8001").id == 7  # an explicit id stays available
    assert WorkerSpec.from_mapping({"url": "http://gpu1:8001"}).id == spec.id
    with pytest.raises(ValueError, match="URL or key=value"):
        parse_worker_arg("http://gpu1:8001,dp_size")
    with pytest.raises(ValueError, match="http://"):
        parse_worker_arg("gpu1:8001")


def test_workers_document_json_and_yaml() -> None:
    specs, models = parse_workers_document(
        json.dumps(
            {"workers": [{"id": 1, "url": "http://127.0.0.1:9", "dp_size": 2}], "models": {"m": {"model_path": "/x"}}}
        )
    )
    assert [s.id for s in specs] == [1] and specs[0].dp_size == 2 and models == {"m": {"model_path": "/x"}}
    specs, _ = parse_workers_document(
        "workers:\n  - id: 4\n    url: http://127.0.0.1:10\n    kv_events_endpoint: tcp://127.0.0.1:5000\n"
    )
    assert specs[0].id == 4 and specs[0].kv_events_endpoint == "tcp://127.0.0.1:5000"
    with pytest.raises(ValueError, match="duplicate"):
        parse_workers_document(
            '{"workers": [{"id": 1, "url": "http://127.0.0.1:1"}, {"id": 1, "url": "http://127.0.0.1:2"}]}'
        )
    specs, _ = parse_workers_document("workers:\n  - http://127.0.0.1:11\n  - {id: 2, url: http://127.0.0.1:12}\n")
    assert [s.id for s in specs] == [url_worker_id("http://127.0.0.1:11"), 2]
    with pytest.raises(ValueError, match="the same URL twice"):
        parse_workers_document('["http://127.0.0.1:1", "http://127.0.0.1:1/"]')


def test_cache_config_info_parsing() -> None:
    text = (
        '# HELP x\nvllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",'
        'max_num_batched_tokens="8192"} 1.0\n'
    )
    assert parse_cache_config_info(text) == {"block_size": 16, "num_gpu_blocks": 2048, "max_num_batched_tokens": 8192}
    assert parse_cache_config_info("nothing here") == {}


def test_busy_rules() -> None:
    t = BusyThresholds(active_prefill_tokens_threshold=100)
    assert rank_overloaded(t, 101, 0, None, None) and not rank_overloaded(t, 100, 0, None, None)
    t = BusyThresholds(active_prefill_tokens_threshold_frac=0.5)
    assert rank_overloaded(t, 51, 0, None, 100) and not rank_overloaded(t, 50, 0, None, 100)
    t = BusyThresholds(active_decode_blocks_threshold=0.5)
    assert rank_overloaded(t, 0, 11, 20, None) and not rank_overloaded(t, 0, 10, 20, None)
    assert not rank_overloaded(t, 0, 10**6, None, None)  # capacity unknown: never busy on blocks
    assert not BusyThresholds().enabled
    with pytest.raises(ValueError):
        validate_update(1.5, None, None)
    with pytest.raises(ValueError):
        validate_update(None, -1, None)
    with pytest.raises(ValueError):
        validate_update(None, None, float("inf"))


# ---------------------------------------------------------------------------------------------
# upstream client


async def _serve(app, port):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=1))
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 10
    while not server.started:  # bounded poll: fail instead of hanging if the server cannot start
        if task.done() or asyncio.get_running_loop().time() > deadline:
            raise RuntimeError("test upstream server did not start")
        await asyncio.sleep(0.01)
    return server, task


def test_upstream_client_streams_reuses_and_reports_errors() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from frontend.dispatch.upstream import UpstreamConnectError, UpstreamPool, UpstreamTimeout
    from support import free_port

    gate: asyncio.Queue = asyncio.Queue()

    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "rank": request.headers.get("x-data-parallel-rank")})

    async def stream(request: Request):
        async def gen():
            for i in range(3):
                await gate.get()
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def slow(request: Request):
        await gate.get()
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/slow", slow, methods=["POST"]),
        ]
    )

    async def main():
        port = free_port()
        server, task = await _serve(app, port)
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        try:
            r = await pool.request(
                "POST", "/echo", b'{"a": 1}', [("content-type", "application/json"), ("x-data-parallel-rank", "3")]
            )
            assert r.status == 200 and json.loads(r.content) == {"got": {"a": 1}, "rank": "3"}
            assert len(pool._idle) == 1
            # chunks arrive one by one, as the server sends them (no buffering)
            s = await pool.request("POST", "/stream", b"{}", [("content-type", "application/json")], stream=True)
            assert s.status == 200 and s.header(b"content-type").startswith(b"text/event-stream")
            it = s.aiter_raw().__aiter__()
            for i in range(3):
                gate.put_nowait(None)
                assert await asyncio.wait_for(it.__anext__(), 10) == f"data: {i}\n\n".encode()
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(it.__anext__(), 10)
            # the server closes idle keep-alive connections after 1 s: the next request still works
            idle = pool._idle[0]
            deadline = asyncio.get_running_loop().time() + 10
            while not idle.lost and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            r = await pool.request("POST", "/echo", b"[]", [("content-type", "application/json")])
            assert r.status == 200
            impatient = UpstreamPool(f"http://127.0.0.1:{port}", timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await impatient.request("POST", "/slow", b"{}")
            gate.put_nowait(None)  # let the server's handler finish
            await impatient.aclose()
        finally:
            await pool.aclose()
            server.should_exit = True
            await task
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            dead_port = probe.getsockname()[1]
        with pytest.raises(UpstreamConnectError):
            await UpstreamPool(f"http://127.0.0.1:{dead_port}").request("POST", "/echo", b"{}")

    asyncio.run(main())


def test_metric_buckets_are_the_references() -> None:
    from frontend.observability import metrics as m

    assert m.REQUEST_DURATION_BUCKETS == [0, 2, 4, 8, 16, 32, 64, 130, 260, 510]
    assert m.ISL_BUCKETS == [0, 100, 210, 430, 870, 1800, 3600, 7400, 15000, 31000, 63000, 130000]
    assert m.OSL_BUCKETS == [0, 100, 210, 430, 880, 1800, 3700, 7600, 16000, 32000]
    assert m.TTFT_BUCKETS == [
        0,
        0.0022,
        0.0047,
        0.01,
        0.022,
        0.047,
        0.1,
        0.22,
        0.47,
        1,
        2.2,
        4.7,
        10,
        22,
        48,
        100,
        220,
        480,
    ]
    assert m.ITL_BUCKETS == [0, 0.0019, 0.0035, 0.0067, 0.013, 0.024, 0.045, 0.084, 0.16, 0.3, 0.56, 1.1, 2]
    assert m.KV_HIT_RATE_BUCKETS[:3] == [0.0, 0.05, 0.1] and m.KV_HIT_RATE_BUCKETS[-1] == 1.0


def test_lora_adapters_are_the_models_listed_with_a_served_parent() -> None:
    from frontend.pool.workers import lora_adapters

    data = [
        {"id": "base", "parent": None},
        {"id": "a1", "parent": "base"},
        {"id": "a2", "parent": "base"},
        {"id": "stray", "parent": "not-served"},  # a parent this engine does not serve: not an adapter here
        {"id": "self", "parent": "self"},
        "garbage",
    ]
    assert lora_adapters(data) == {"a1": "base", "a2": "base"}
    assert lora_adapters([]) == {}


def test_an_adapter_entry_hashes_with_its_name_and_books_on_its_base_model() -> None:
    from frontend.routing.models import BusyThresholds, ModelEntry
    from kvroute_common.hashing import local_block_hashes
    from slot_tracker.core import SlotRegistry

    slots = SlotRegistry()
    slots.register(1, "base", "default", 4, 0, 1)
    base = ModelEntry("base", 4, None, slots, None, None, BusyThresholds())  # type: ignore[arg-type]
    adapter = ModelEntry("a1", 4, None, slots, None, None, BusyThresholds(), base="base")  # type: ignore[arg-type]
    assert (base.base, base.lora_name) == ("base", None)
    assert (adapter.base, adapter.lora_name) == ("base", "a1")
    assert adapter.tracker is base.tracker is slots.get("base", "default")
    tokens = list(range(16))
    assert local_block_hashes(tokens, 4, adapter.lora_name) != local_block_hashes(tokens, 4, base.lora_name)


def test_a_worker_url_the_http_client_cannot_use_is_refused_as_the_specs_error() -> None:
    import pytest

    from frontend.pool.workers import WorkerSpec

    with pytest.raises(ValueError, match="not a usable URL"):
        WorkerSpec.from_mapping({"id": 1, "url": "http://\uda1d\uddd3"})  # found by the OpenAPI fuzzer: was a 500
    assert WorkerSpec.from_mapping({"id": 1, "url": "http://127.0.0.1:8000/v1/"}).url == "http://127.0.0.1:8000"


def test_worker_pool_prepares_a_discovered_worker_before_attaching_it() -> None:
    """``prepare`` (the frontend loads tokenizers there, on a thread) is awaited once the worker's
    models are known and before ``on_change`` attaches it; the event loop keeps running meanwhile."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from frontend.pool.workers import WorkerPool, WorkerSpec
    from support import free_port

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(request):
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health)])
    events: list[str] = []

    async def main() -> None:
        port = free_port()
        server, task = await _serve(app, port)
        release = asyncio.Event()

        async def prepare(worker) -> None:
            events.append(f"prepare {sorted(worker.models)}")
            await release.wait()

        pool = WorkerPool(lambda w: events.append(f"change healthy={w.healthy}"), lambda w: None, prepare=prepare)

        async def until(n: int) -> None:  # bounded: other tasks run while prepare waits
            for _ in range(1000):
                if len(events) >= n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"events so far: {events}")

        try:
            pool.add(WorkerSpec(id=1, url=f"http://127.0.0.1:{port}"), "test")  # probed in the background
            await until(1)
            await asyncio.sleep(0)
            assert events == ["prepare ['m']"]  # not attached while prepare runs
            release.set()
            await until(2)
            assert events == ["prepare ['m']", "change healthy=True"]
        finally:
            await pool.stop()
            server.should_exit = True
            await task

    asyncio.run(main())


def test_health_probes_on_the_request_path_client_see_slow_failing_and_gone_workers() -> None:
    """The probe's GET /health: a 200 keeps the worker, a health endpoint slower than the health timeout
    or answering 503 takes it out after the failures it is allowed, a closed port takes it out at once."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from frontend.pool.workers import WorkerPool, WorkerSpec
    from support import free_port

    behaviour = {"status": 200, "hang": False}
    hung = asyncio.Event()

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(request):
        if behaviour["hang"]:
            await hung.wait()  # set only once the test is done with slow answers
        return JSONResponse({}, status_code=behaviour["status"])

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health)])

    async def main() -> None:
        port = free_port()
        server, task = await _serve(app, port)
        pool = WorkerPool(lambda w: None, lambda w: None, health_timeout=1.0, failures_to_unhealthy=2)
        try:
            worker = pool.add(WorkerSpec(id=1, url=f"http://127.0.0.1:{port}"), "test")
            await pool.check_all()
            assert worker.healthy and worker.last_error is None
            behaviour["hang"] = True
            await pool.check_all()
            assert worker.healthy and "no answer within the health timeout" in (worker.last_error or "")
            await pool.check_all()
            assert not worker.healthy
            behaviour.update(hang=False, status=200)
            hung.set()  # the handlers of the probes that gave up finish (the server can stop)
            await pool.check_all()  # rediscovered, healthy again
            assert worker.healthy and worker.last_error is None
            behaviour["status"] = 503
            await pool.check_all()
            await pool.check_all()
            assert not worker.healthy and worker.last_error == "health check returned 503"
        finally:
            server.should_exit = True
            await task
        behaviour["status"] = 200
        await pool.check_all()  # nothing listens on the port now: refused, out at once
        assert not worker.healthy and worker.unreachable
        await pool.stop()

    asyncio.run(main())


def test_a_suspected_worker_is_probed_at_once_and_at_most_once_a_gap() -> None:
    """``suspect``: a worker another component saw fail is probed now, not at the next round (none runs
    here); a burst of suspicions (clients leaving mid-stream look the same) is one probe; a suspicion
    within the gap after a probe answered gets the next probe's answer (at the gap's end), not that one's."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from frontend.pool.workers import SUSPECT_GAP_S, WorkerPool, WorkerSpec
    from support import free_port

    probes: list[int] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(request):
        probes.append(1)
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health)])

    async def until(cond, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while not cond():  # bounded: fails at the deadline
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)

    async def main() -> None:
        port = free_port()
        server, task = await _serve(app, port)
        pool = WorkerPool(lambda w: None, lambda w: None, health_interval=3600)  # no round starts (not started)
        worker = pool.add(WorkerSpec(id=1, url=f"http://127.0.0.1:{port}"), "test")
        try:
            await pool.check_all()
            await until(lambda: not pool._tasks, "the probe on adding it ended")
            assert worker.healthy
            before = len(probes)
            for _ in range(5):
                pool.suspect(worker)
            await until(lambda: len(probes) == before + 1, "the early probe")
            await until(lambda: not pool._tasks, "the early probe's task ended")
            assert len(probes) == before + 1 and worker.healthy  # one probe for the burst; healthy, it stays
            t, probe = pool._suspected[worker.id]
            assert probe.result() is True  # the burst's probe: the worker answered
            pool._suspected[worker.id] = (t - SUSPECT_GAP_S, probe)  # the gap has passed: a probe at once
            probe = pool.suspect(worker)
            assert probe is not None and await probe is True and len(probes) == before + 2
        finally:
            server.should_exit = True
            await task
        # the worker stopped after that answer, within the gap: the answer says nothing about it now; the
        # next probe starts when the gap ends, and every suspicion until it answers shares it
        t, _ = pool._suspected[worker.id]
        later = pool.suspect(worker)
        assert later is not None and later is not probe and pool.suspect(worker) is later
        assert pool._suspected[worker.id][0] == t + SUSPECT_GAP_S
        assert await later is False  # nothing listens now: refused, out at once
        assert time.monotonic() >= t + SUSPECT_GAP_S
        assert not worker.healthy and worker.unreachable
        assert pool.suspect(worker) is None  # unhealthy: nothing to probe early, nothing to answer
        await pool.stop()

    asyncio.run(main())


def test_loop_lag_watch_sees_a_blocked_loop() -> None:
    """A callback that holds the loop 60 ms shows as one lag observation of about that much."""
    import time

    from frontend.observability.loop_lag import watch_loop_lag

    lags: list[float] = []

    async def main() -> None:
        watch = asyncio.get_running_loop().create_task(watch_loop_lag(lags.append, interval=0.005))
        try:
            for _ in range(500):  # bounded: a few quiet measurements first
                if len(lags) >= 3:
                    break
                await asyncio.sleep(0.005)
            quiet = len(lags)
            time.sleep(0.06)  # holds the loop: the watch's timer is due meanwhile
            for _ in range(500):
                if len(lags) > quiet:
                    break
                await asyncio.sleep(0.005)
            assert max(lags[quiet:]) >= 0.04, lags
        finally:
            watch.cancel()

    asyncio.run(main())


def test_loop_lag_watch_wakes_the_loop_at_its_fast_cadence_only_while_busy() -> None:
    """Idle (no request in flight) the watch sleeps ``idle_interval``, busy it sleeps ``interval``: each
    cadence is seen by making the other one far too long to produce a second observation."""
    from frontend.observability.loop_lag import watch_loop_lag

    async def observations(busy: bool, interval: float, idle_interval: float) -> int:
        lags: list[float] = []
        watch = asyncio.get_running_loop().create_task(
            watch_loop_lag(lags.append, interval=interval, busy=lambda: busy, idle_interval=idle_interval)
        )
        try:
            for _ in range(2000):  # bounded: until three observations or ~10 s
                if len(lags) >= 3:
                    break
                await asyncio.sleep(0.005)
            return len(lags)
        finally:
            watch.cancel()

    async def main() -> None:
        assert await observations(busy=False, interval=3600.0, idle_interval=0.01) >= 3
        assert await observations(busy=True, interval=0.01, idle_interval=3600.0) >= 3

    asyncio.run(main())


def test_stall_logger_names_what_held_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    """--log-loop-stalls: a callback that holds the loop past the threshold is logged with the loop
    thread's stack, and nothing is logged while the loop keeps up."""
    import logging
    import time

    from frontend.observability.loop_lag import StallLogger

    def hold_the_loop_for_a_while() -> None:
        time.sleep(0.15)

    async def main() -> None:
        stalls = StallLogger(asyncio.get_running_loop(), threshold=0.05, interval=0.005).start()
        try:
            for _ in range(10):  # a loop that keeps up: no stall
                await asyncio.sleep(0.01)
            assert stalls.stalls == 0
            hold_the_loop_for_a_while()
            for _ in range(500):  # bounded: the report comes once the loop runs again
                if stalls.stalls:
                    break
                await asyncio.sleep(0.01)
            assert stalls.stalls == 1
        finally:
            stalls.stop()

    with caplog.at_level(logging.WARNING, logger="frontend.observability.loop_lag"):
        asyncio.run(main())
    [record] = [r for r in caplog.records if r.name == "frontend.observability.loop_lag"]
    assert "event loop held for" in record.getMessage() and "hold_the_loop_for_a_while" in record.getMessage()


def test_switch_interval_defaults_to_the_loops_and_a_non_positive_one_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from frontend.cli import build_parser, make_state
    from kvroute_common.tokenize_offload import LOOP_SWITCH_INTERVAL_MS

    assert build_parser().parse_args([]).switch_interval_ms == LOOP_SWITCH_INTERVAL_MS < 5
    monkeypatch.setenv("KVROUTE_SWITCH_INTERVAL_MS", "2")
    assert build_parser().parse_args([]).switch_interval_ms == 2.0
    with pytest.raises(SystemExit, match="--switch-interval-ms must be > 0"):
        make_state(build_parser().parse_args(["--switch-interval-ms", "0"]))


def test_parity_sample_every_from_the_flag_or_the_environment_and_zero_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from frontend.cli import build_parser, make_state

    assert make_state(build_parser().parse_args([])).parity.sample_every == 8
    assert make_state(build_parser().parse_args(["--parity-sample-every", "1"])).parity.sample_every == 1
    monkeypatch.setenv("KVROUTE_PARITY_SAMPLE_EVERY", "3")
    assert make_state(build_parser().parse_args([])).parity.sample_every == 3
    monkeypatch.setenv("KVROUTE_PARITY_SAMPLE_EVERY", "0")
    with pytest.raises(SystemExit, match="--parity-sample-every must be >= 1"):
        make_state(build_parser().parse_args([]))


def test_the_encoder_pool_leaves_the_loop_a_core_unless_the_operator_sized_it() -> None:
    from kvroute_common.tokenize_offload import ENCODER_POOL_ENV, bound_encoder_threads

    env: dict[str, str] = {}
    assert bound_encoder_threads(env, cores=2) == 1 and env == {ENCODER_POOL_ENV: "1"}
    assert bound_encoder_threads(env := {}, cores=8) == 7 and env[ENCODER_POOL_ENV] == "7"
    assert bound_encoder_threads(env := {}, cores=1) == 1 and env[ENCODER_POOL_ENV] == "1"
    for operator in ({ENCODER_POOL_ENV: "4"}, {"TOKENIZERS_PARALLELISM": "false"}):
        env = dict(operator)
        assert bound_encoder_threads(env, cores=8) is None and env == operator


_ENCODER_THREADS = """
import os, sys
from kvroute_common.tokenize_offload import bound_encoder_threads
from kvroute_common.tokenizer import load_tokenizer, prompt_encoder
if sys.argv[1] == "bounded":
    bound_encoder_threads(cores=int(sys.argv[2]))
encoder = prompt_encoder(load_tokenizer(None))
before = len(os.listdir("/proc/self/task"))
encoder._batch_fast(["lorem ipsum dolor sit amet " * 40] * 64, add_special_tokens=False)
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to see the pool's default size")
def test_a_frontend_process_encodes_a_batch_on_one_core_fewer_than_it_has() -> None:
    """The real tokenizer library honours the bound: a batch encode starts as many pool threads as the
    process has cores by default, one fewer once bounded (the frontend calls it first thing)."""
    import subprocess

    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}

    def new_threads(*mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _ENCODER_THREADS, *mode], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert new_threads("default") == cores
    assert new_threads("bounded", str(cores)) == cores - 1


def test_a_huge_chat_message_is_rendered_and_tokenized_off_the_loop_a_tiny_one_inline() -> None:
    import copy
    import threading
    from typing import Any

    from frontend.routing.models import ModelEntry
    from frontend.routing.prompt import tokenize_request
    from kvroute_common.tokenize_offload import TokenizeOffload
    from kvroute_common.tokenizer import chat_request_token_ids, load_tokenizer
    from slot_tracker.core import SlotRegistry

    tok = copy.copy(load_tokenizer(None))  # the real tokenizer and template; its renders are recorded
    rendered_on: list[threading.Thread] = []
    render = tok.apply_chat_template

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rendered_on.append(threading.current_thread())
        return render(*args, **kwargs)

    tok.apply_chat_template = recorded
    entry = ModelEntry("m", 16, tok, SlotRegistry(), None, None, BusyThresholds())
    offload = TokenizeOffload()
    offload.start()
    huge = {"model": "m", "messages": [{"role": "user", "content": "lorem ipsum dolor " * 20_000}]}
    tiny = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def main() -> tuple[list[int], list[int], threading.Thread]:
        big = await tokenize_request(offload, entry, huge, "chat")
        small = await tokenize_request(offload, entry, tiny, "chat")
        return list(big.tokens), list(small.tokens), threading.current_thread()

    try:
        big, small, loop_thread = asyncio.run(main())
    finally:
        offload.close()
    assert rendered_on[0] is not loop_thread and rendered_on[0].name.startswith("tokenize")
    assert rendered_on[1] is loop_thread
    base = load_tokenizer(None)
    assert big == chat_request_token_ids(base, huge) and small == chat_request_token_ids(base, tiny)


def test_epp_port_without_the_epp_extra_is_a_usage_error_naming_the_install(monkeypatch) -> None:
    import importlib.util

    from frontend.cli import check_epp_installed

    check_epp_installed()  # the test environment has the extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "grpc" else real(name))
    with pytest.raises(SystemExit, match=r"pip install 'kvroute\[epp\]'"):
        check_epp_installed()


def test_token_ids_go_to_proven_workers_unless_the_flag_or_its_variable_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from frontend.cli import build_parser

    monkeypatch.delenv("KVROUTE_SEND_TOKEN_IDS", raising=False)
    assert build_parser().parse_args([]).send_token_ids == "auto"
    assert build_parser().parse_args(["--send-token-ids"]).send_token_ids == "always"  # the flag alone, as before
    assert build_parser().parse_args(["--send-token-ids", "never"]).send_token_ids == "never"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--send-token-ids", "sometimes"])
    for value, mode in (("1", "always"), ("true", "always"), ("0", "never"), ("FALSE", "never"), ("", "auto")):
        monkeypatch.setenv("KVROUTE_SEND_TOKEN_IDS", value)
        assert build_parser().parse_args([]).send_token_ids == mode
    monkeypatch.setenv("KVROUTE_SEND_TOKEN_IDS", "maybe")
    with pytest.raises(SystemExit, match="KVROUTE_SEND_TOKEN_IDS"):
        build_parser()


def test_a_completions_prompt_goes_as_ids_only_to_a_worker_that_takes_them() -> None:
    import orjson

    from frontend.dispatch.context import RequestContext
    from frontend.routing.prompt import takes_prompt_ids

    proven, unproven = SimpleNamespace(prompt_ids_proven=True), SimpleNamespace(prompt_ids_proven=False)
    assert [takes_prompt_ids(m, proven) for m in ("auto", "always", "never")] == [True, True, False]
    assert [takes_prompt_ids(m, unproven) for m in ("auto", "always", "never")] == [False, True, False]
    ctx = RequestContext()
    ctx.out_body = b'{"model":"m","prompt":"a b","stream":true,"stream_options":{"include_usage":true}}'
    assert ctx.body_for(True) is ctx.out_body  # no ids computed for it (e.g. echo): the text
    ctx.engine_ids = [1, 2]
    assert ctx.body_for(False) is ctx.out_body
    sent = ctx.body_for(True)
    assert orjson.loads(sent) == {**orjson.loads(ctx.out_body), "prompt": [1, 2]}  # every other field kept
    assert ctx.body_for(True) is sent  # built once per request
