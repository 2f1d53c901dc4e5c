"""End to end: real `python -m frontend` processes in front of real `python -m mocker` processes
(HTTP + ZMQ KV events), driven with the official `openai` SDK.

One cluster of three mockers is shared by the module; each frontend variant (kv, high temperature,
round robin via a workers file, random, approximate mode) is its own process started once, all in
parallel. The fault test (killed worker) has its own two mockers and frontend.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from support import REPO_ROOT, free_ports, stop_process, wait_until

MODEL = "kvroute-demo"
START_TIMEOUT = 90.0
WAIT = 30.0


# ---------------------------------------------------------------------------------------------
# process plumbing


class Mocker:
    def __init__(self, port: int, events: int, replay: int, proc: subprocess.Popen) -> None:
        self.port, self.events, self.replay, self.proc = port, events, replay, proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_arg(self, worker_id: int, events: bool = True) -> str:
        arg = f"id={worker_id},url={self.url}"
        if events:
            arg += f",kv_events_endpoint=tcp://127.0.0.1:{self.events},replay_endpoint=tcp://127.0.0.1:{self.replay}"
        return arg

    def worker_obj(self, worker_id: int) -> dict:
        return {
            "id": worker_id,
            "url": self.url,
            "kv_events_endpoint": f"tcp://127.0.0.1:{self.events}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
        }


class Frontend:
    def __init__(self, port: int, proc: subprocess.Popen) -> None:
        self.port, self.proc = port, proc
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)

    def loads(self) -> dict[tuple[int, int], tuple[int, int]]:
        rows = self.http.get("/loads").json()
        return {(r["worker_id"], r["dp_rank"]): (r["active_prefill_tokens"], r["active_decode_blocks"]) for r in rows}

    def idle(self) -> bool:
        return all(v == (0, 0) for v in self.loads().values())

    def explain(self, messages: list[dict]) -> dict:
        r = self.http.post("/admin/route", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self, messages: list[dict], nvext: dict | None = None, **kw) -> tuple[int, int, object]:
        """(worker_id, dp_rank, completion) of a non-streaming request."""
        kw.setdefault("max_tokens", 2)
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_body={"nvext": {"extra_fields": ["worker_id"], **(nvext or {})}}, **kw
        )
        comp = raw.parse()
        info = comp.model_extra["nvext"]["worker_id"]
        assert int(raw.headers["x-data-parallel-rank"]) == info["decode_dp_rank"]
        return info["decode_worker_id"], info["decode_dp_rank"], comp


def _spawn(args: list[str], log_name: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    log = open(os.path.join(_log_dir(), log_name), "wb")
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _log_dir() -> str:
    import tempfile

    d = os.path.join(tempfile.gettempdir(), "kvroute-frontend-e2e")
    os.makedirs(d, exist_ok=True)
    return d


def _ready(url: str, proc: subprocess.Popen, path: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"process {proc.args} exited with {proc.returncode}")
    return httpx.get(url + path, timeout=2.0).status_code == 200


def start_mockers(n: int, stack: contextlib.ExitStack, extra: list[str] | None = None) -> list[Mocker]:
    mockers = []
    for _ in range(n):
        port, events, replay = free_ports(3)
        proc = _spawn(
            [
                "-m",
                "mocker",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{events}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{replay}",
                "--num-gpu-blocks",
                "2048",
                *(extra or []),
            ],
            f"mocker-{port}.log",
        )
        stack.callback(stop_process, proc)
        mockers.append(Mocker(port, events, replay, proc))
    return mockers


def start_frontend(args: list[str], stack: contextlib.ExitStack, env: dict[str, str] | None = None) -> Frontend:
    (port,) = free_ports(1)
    proc = _spawn(
        [
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--health-check-interval",
            "0.5",
            "--log-level",
            "warning",
            *args,
        ],
        f"frontend-{port}.log",
        env,
    )
    stack.callback(stop_process, proc)
    fe = Frontend(port, proc)
    stack.callback(fe.http.close)
    return fe


def wait_ready(mockers: list[Mocker], frontends: list[Frontend]) -> None:
    for m in mockers:
        wait_until(lambda m=m: _ready(m.url, m.proc, "/health"), START_TIMEOUT, what=f"mocker {m.port}")
    for fe in frontends:
        wait_until(lambda fe=fe: _ready(fe.url, fe.proc, "/health"), START_TIMEOUT, what=f"frontend {fe.port}")


def system_prompt(tag: str, words: int = 200) -> str:
    """A long system prompt unique to ``tag`` (several KV blocks)."""
    return f"[{tag}] " + " ".join(f"fact{i % 37} about {tag} number {i}." for i in range(words // 4))


def unique_prompt() -> list[dict]:
    # a random first word: the first block differs from every other prompt
    return [
        {
            "role": "user",
            "content": f"{uuid.uuid4().hex} " + "tell me something about the weather on a long winter day. " * 4,
        }
    ]


class OpenStream:
    """A long streaming request held open after its first chunk (keep the iterator: dropping it closes the stream)."""

    def __init__(self, client: httpx.Client, resp: httpx.Response, it: Iterator[bytes]) -> None:
        self.client, self.resp, self.it = client, resp, it

    def rest(self) -> bytes:
        return b"".join(self.it)

    def close(self) -> None:
        self.resp.close()
        self.client.close()


def stream_until_first_chunk(fe: Frontend, messages: list[dict], max_tokens: int = 20000) -> OpenStream:
    """Open a long streaming request and read until its first chunk."""
    c = httpx.Client(base_url=fe.url, timeout=60.0)
    req = c.build_request(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "nvext": {"extra_fields": ["worker_id"]},
        },
    )
    resp = c.send(req, stream=True)
    assert resp.status_code == 200, resp.read()
    it = resp.iter_raw()
    first = next(it)
    assert first.startswith(b"data:")
    return OpenStream(c, resp, it)


# ---------------------------------------------------------------------------------------------
# the shared cluster


class Cluster:
    mockers: list[Mocker]
    kv: Frontend
    hot: Frontend
    rr: Frontend
    rnd: Frontend
    approx: Frontend
    workers_file: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        c = Cluster()
        c.mockers = ms = start_mockers(3, stack)
        events_workers = sum((["--worker", m.worker_arg(i + 1)] for i, m in enumerate(ms)), [])
        plain_workers = sum((["--worker", m.worker_arg(i + 1, events=False)] for i, m in enumerate(ms)), [])
        c.kv = start_frontend(["--router-mode", "kv", *events_workers], stack)
        c.hot = start_frontend(["--router-mode", "kv", "--router-temperature", "1000", *events_workers], stack)
        c.workers_file = str(tmp_path_factory.mktemp("workers") / "workers.yaml")
        with open(c.workers_file, "w") as f:
            f.write(f"workers:\n  - id: 1\n    url: {ms[0].url}\n")
        c.rr = start_frontend(["--router-mode", "round-robin", "--workers-file", c.workers_file], stack)
        # thresholds from the command line and from DYN_* variables (set high enough never to fire)
        c.rnd = start_frontend(
            ["--active-prefill-tokens-threshold", "1000000", *plain_workers],
            stack,
            env={"DYN_ROUTER_MODE": "random", "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "0.99"},
        )
        c.approx = start_frontend(["--router-mode", "kv", "--no-router-kv-events", *plain_workers], stack)
        wait_ready(ms, [c.kv, c.hot, c.rr, c.rnd, c.approx])
        for fe in (c.kv, c.hot, c.rnd, c.approx):
            wait_until(lambda fe=fe: _all_healthy(fe, 3), START_TIMEOUT, what=f"frontend {fe.port} to see every worker")
        yield c


def _all_healthy(fe: Frontend, n: int) -> bool:
    body = fe.http.get("/health").json()
    return sum(1 for i in body["instances"] if i["healthy"]) == n


# ---------------------------------------------------------------------------------------------
# tests


def test_openai_surface(cluster: Cluster) -> None:
    fe = cluster.kv
    wait_until(lambda: _all_healthy(fe, 3), WAIT, what="all workers healthy")
    assert [m.id for m in fe.client.models.list().data] == [MODEL]
    assert fe.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        fe.client.models.retrieve("no-such-model")
    assert fe.http.get("/live").json()["status"] == "live"
    health = fe.http.get("/health").json()
    assert health["status"] == "healthy" and len(health["endpoints"]) == 3

    eos = {"ignore_eos": True}
    comp = fe.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3, extra_body=eos
    )
    assert comp.choices[0].message.content and comp.usage.completion_tokens == 3
    chunks = list(
        fe.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, extra_body=eos
        )
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 4
    assert chunks[-1].choices[0].finish_reason == "length"
    text = fe.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
    assert text.usage.prompt_tokens > 0 and text.choices[0].text is not None
    ids = fe.client.completions.create(model=MODEL, prompt=[1, 50, 60, 70, 80], max_tokens=2)
    assert ids.usage.prompt_tokens == 5

    with pytest.raises(openai.NotFoundError):
        fe.client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        fe.client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        fe.client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4]])
    r = fe.http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    # the worker's own 4xx passes through with its message, and books nothing
    with pytest.raises(openai.BadRequestError) as err:
        fe.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-5)
    assert "max_tokens" in err.value.message
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            fe.client.completions.create(model=MODEL, prompt="hi", max_tokens=40000, stream=stream)

    metrics = fe.http.get("/metrics").text
    for name in (
        "dynamo_frontend_requests_total",
        "dynamo_frontend_time_to_first_token_seconds_bucket",
        "dynamo_frontend_inter_token_latency_seconds_bucket",
        "dynamo_frontend_worker_active_decode_blocks",
        "dynamo_component_router_kv_hit_rate_bucket",
        "dynamo_router_overhead_total_ms_bucket",
        "dynamo_frontend_output_tokens_total",
        "dynamo_frontend_model_ready",
    ):
        assert name in metrics, name
    families = [line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families)), "duplicate metric families"
    # the event loop's lag is measured all the time (a timer due every 20 ms with requests in flight, 1 s without)
    lag_count = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("kvroute_event_loop_lag_seconds_count")
    )
    assert lag_count > 0
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_kv_shared_prefix_lands_on_the_worker_that_holds_it(cluster: Cluster) -> None:
    fe = cluster.kv
    system = {"role": "system", "content": system_prompt("shared-prefix")}
    first_worker, _, _ = fe.chat([system, {"role": "user", "content": "question 0"}])

    def indexed() -> bool:  # the worker's KV events reached the frontend's indexer
        d = fe.explain([system, {"role": "user", "content": "question x"}])
        return d["worker_id"] == first_worker and d["overlap_blocks"] > 5

    wait_until(indexed, WAIT, what="prefix indexed from KV events")
    rows = fe.http.get("/admin/workers").json()["workers"]
    assert {r["id"]: r["kv_events"]["status"] for r in rows} == {1: "active", 2: "active", 3: "active"}
    seen = Counter(fe.chat([system, {"role": "user", "content": f"question {i}"}])[0] for i in range(1, 7))
    assert seen == Counter({first_worker: 6})
    hit_rate_sum = next(
        float(line.split()[-1])
        for line in fe.http.get("/metrics").text.splitlines()
        if line.startswith("dynamo_component_router_kv_hit_rate_sum")
    )
    assert hit_rate_sum > 3.0  # six requests that found most of their prompt cached
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_cost_ties_are_broken_at_random(cluster: Cluster) -> None:
    fe = cluster.kv
    wait_until(fe.idle, WAIT, what="idle")
    d = fe.explain(unique_prompt())
    costs = {c["cost"] for c in d["candidates"]}
    assert len(d["candidates"]) == 3 and len(costs) == 1  # idle workers, no overlap: a three-way tie
    seen = Counter(fe.chat(unique_prompt())[0] for _ in range(24))
    assert set(seen) == {1, 2, 3}, seen


def test_temperature_spreads_even_a_cached_prefix(cluster: Cluster) -> None:
    hot, kv = cluster.hot, cluster.kv
    system = {"role": "system", "content": system_prompt("temperature")}
    holder, _, _ = kv.chat([system, {"role": "user", "content": "warm up"}])
    wait_until(
        lambda: (
            max(c["overlap_blocks"] for c in hot.explain([system, {"role": "user", "content": "q"}])["candidates"]) > 5
        ),
        WAIT,
        what="prefix indexed",
    )
    d = hot.explain([system, {"role": "user", "content": "q"}])
    by_worker = {c["worker_id"]: c["cost"] for c in d["candidates"]}
    assert by_worker[holder] < min(v for w, v in by_worker.items() if w != holder)  # the holder is cheapest...
    seen = Counter(hot.chat([system, {"role": "user", "content": f"q{i}"}])[0] for i in range(24))
    assert len(seen) >= 2, seen  # ...yet a high temperature samples the others too


def test_round_robin_with_workers_file_and_registration_api(cluster: Cluster) -> None:
    fe, ms = cluster.rr, cluster.mockers
    wait_until(lambda: _all_healthy(fe, 1), WAIT, what="file worker")
    with open(cluster.workers_file, "w") as f:  # the file is re-read when it changes
        json.dump(
            {
                "workers": [
                    ms[0].worker_obj(1) | {"kv_events_endpoint": None, "replay_endpoint": None},
                    {"id": 2, "url": ms[1].url},
                ]
            },
            f,
        )
    wait_until(lambda: _all_healthy(fe, 2), WAIT, what="second worker from the reloaded file")
    with open(cluster.workers_file, "w") as f:
        f.write("workers: [ {id: 1, url: http://127.0.0.1:1, unknown_field: 3} ]\n")  # a bad edit changes nothing
    r = wait_until(
        lambda: (lambda b: b if b["workers_file"]["last_error"] else None)(fe.http.get("/admin/workers").json()),
        WAIT,
        what="the bad workers file to be read and refused",
    )
    assert "unknown_field" in r["workers_file"]["last_error"]
    assert [w["id"] for w in r["workers"]] == [1, 2]
    r = fe.http.post("/admin/workers", json={"id": 3, "url": ms[2].url})
    assert r.status_code == 201 and r.json()["healthy"] is True
    assert fe.http.post("/admin/workers", json={"id": 4}).status_code == 400
    wait_until(lambda: _all_healthy(fe, 3), WAIT, what="api worker")
    system = {"role": "system", "content": system_prompt("round-robin")}
    seen = Counter(fe.chat([system, {"role": "user", "content": "same"}])[0] for _ in range(9))
    assert seen == Counter({1: 3, 2: 3, 3: 3})
    assert fe.http.delete("/admin/workers/3").status_code == 200
    assert fe.http.delete("/admin/workers/3").status_code == 404
    seen = Counter(fe.chat([system, {"role": "user", "content": "same"}])[0] for _ in range(4))
    assert seen == Counter({1: 2, 2: 2})


def test_random_mode_spreads_the_same_prompt(cluster: Cluster) -> None:
    fe = cluster.rnd
    assert fe.http.get("/busy_threshold").json() == {
        "thresholds": [
            {"model": MODEL, "active_decode_blocks_threshold": 0.99, "active_prefill_tokens_threshold": 1000000}
        ]
    }
    assert (
        fe.http.post("/admin/route", json={"model": MODEL, "messages": unique_prompt()}).json()["router_mode"]
        == "random"
    )
    system = {"role": "system", "content": system_prompt("random")}
    seen = Counter(fe.chat([system, {"role": "user", "content": "same"}])[0] for _ in range(24))
    assert set(seen) == {1, 2, 3}, seen


def test_approximate_mode_without_kv_events(cluster: Cluster) -> None:
    fe = cluster.approx
    system = {"role": "system", "content": system_prompt("approximate")}
    first, _, _ = fe.chat([system, {"role": "user", "content": "q0"}])
    # no KV events: the prediction comes from the routing decision itself, immediately
    d = fe.explain([system, {"role": "user", "content": "q1"}])
    assert d["worker_id"] == first and d["overlap_blocks"] > 5
    seen = Counter(fe.chat([system, {"role": "user", "content": f"q{i}"}])[0] for i in range(1, 6))
    assert seen == Counter({first: 5})
    assert fe.http.get("/metrics").status_code == 200


def test_approximate_mode_predicts_a_long_prompt_beyond_its_first_slice(cluster: Cluster) -> None:
    """A prompt of more blocks than the prediction records per loop step (1,024): the frontend records the
    rest on its next loop iterations, so the next decision sees the whole prompt predicted."""
    fe = cluster.approx
    document = " ".join(f"clause{i} of the approximate contract" for i in range(2600))
    system = {"role": "system", "content": document}
    first, _, comp = fe.chat([system, {"role": "user", "content": "summarise"}], max_tokens=1)
    blocks = comp.usage.prompt_tokens // 16
    assert blocks > 1100, blocks  # more than one slice (and within the mocker's 2,048-block cache)

    def predicted() -> int:
        d = fe.explain([system, {"role": "user", "content": "and the next clause?"}])
        assert d["worker_id"] == first
        return int(d["overlap_blocks"])

    wait_until(lambda: predicted() >= blocks - 2, WAIT, what="the whole long prompt predicted on its worker")


def test_client_disconnect_frees_load(cluster: Cluster) -> None:
    fe = cluster.kv
    wait_until(fe.idle, WAIT, what="idle")
    streams = [stream_until_first_chunk(fe, unique_prompt()) for _ in range(3)]
    assert not fe.idle()
    for s in streams:
        s.close()
    wait_until(fe.idle, WAIT, what="streamed loads freed after disconnect")

    # a non-streaming request whose client gives up also frees its load at once
    done = threading.Event()

    def slow() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                fe.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": unique_prompt(), "max_tokens": 20000, "ignore_eos": True},
                timeout=1.5,
            )
        done.set()

    t = threading.Thread(target=slow)
    t.start()
    wait_until(lambda: not fe.idle(), WAIT, what="unary request booked")
    t.join(30)
    assert done.is_set()
    wait_until(fe.idle, WAIT, what="unary load freed after disconnect")
    assert "dynamo_frontend_disconnected_clients" in fe.http.get("/metrics").text


def test_busy_thresholds_exclude_and_restore_workers(cluster: Cluster) -> None:
    fe = cluster.kv
    wait_until(fe.idle, WAIT, what="idle")
    assert fe.http.get("/busy_threshold").json() == {"thresholds": []}
    assert fe.http.post("/busy_threshold", json={"model": MODEL}).json() == {
        "model": MODEL,
        "active_decode_blocks_threshold": None,
        "active_prefill_tokens_threshold": None,
    }
    r = fe.http.post("/busy_threshold", json={"model": "nope", "active_decode_blocks_threshold": 0.5})
    assert r.status_code == 404 and "not found" in r.json()["error"]
    assert (
        fe.http.post("/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 1.5}).status_code == 400
    )
    # busy as soon as a worker has any decode block in flight
    r = fe.http.post("/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 0.0})
    assert r.status_code == 200 and r.json()["active_decode_blocks_threshold"] == 0.0
    assert fe.http.get("/busy_threshold").json() == {
        "thresholds": [{"model": MODEL, "active_decode_blocks_threshold": 0.0, "active_prefill_tokens_threshold": None}]
    }
    r = fe.http.post("/busy_threshold", json={"model": MODEL, "active_prefill_tokens_threshold": 100000})
    assert r.json() == {
        "model": MODEL,
        "active_decode_blocks_threshold": 0.0,
        "active_prefill_tokens_threshold": 100000,
    }

    streams: list[OpenStream] = []
    try:
        streams.append(stream_until_first_chunk(fe, unique_prompt()))
        busy = {w for (w, _), (_, d) in fe.loads().items() if d > 0}
        assert len(busy) == 1
        seen = {fe.chat(unique_prompt())[0] for _ in range(6)}
        assert not seen & busy, (seen, busy)  # the busy worker is excluded
        for _ in range(2):
            streams.append(stream_until_first_chunk(fe, unique_prompt()))
        assert {w for (w, _), (_, d) in fe.loads().items() if d > 0} == {1, 2, 3}
        with pytest.raises(openai.APIStatusError) as err:
            fe.chat(unique_prompt())
        assert err.value.status_code == 529
        # raising the threshold at runtime brings them back
        assert (
            fe.http.post("/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 1.0}).status_code
            == 200
        )
        fe.chat(unique_prompt())
        fe.http.post("/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 0.0})
        with pytest.raises(openai.APIStatusError):
            fe.chat(unique_prompt())
        # a worker whose load drains is eligible again
        streams.pop(0).close()
        wait_until(lambda: sum(1 for (_, d) in fe.loads().values() if d > 0) == 2, WAIT, what="one worker drained")
        fe.chat(unique_prompt())
    finally:
        for s in streams:
            s.close()
        fe.http.post("/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 1.0})
    wait_until(fe.idle, WAIT, what="idle after busy test")


def test_killed_worker_is_avoided_and_its_requests_fail_cleanly() -> None:
    with contextlib.ExitStack() as stack:
        ms = start_mockers(2, stack)
        fe = start_frontend(
            ["--router-mode", "kv", *sum((["--worker", m.worker_arg(i + 1)] for i, m in enumerate(ms)), [])], stack
        )
        wait_ready(ms, [fe])
        wait_until(lambda: _all_healthy(fe, 2), WAIT, what="both workers healthy")
        s = stream_until_first_chunk(fe, unique_prompt())
        victim = next(w for (w, _), (_, d) in fe.loads().items() if d > 0)
        os.killpg(ms[victim - 1].proc.pid, signal.SIGKILL)
        rest = s.rest()  # the stream ends with an error event, not a hang
        assert b'"error"' in rest
        s.close()
        wait_until(fe.idle, WAIT, what="the dead worker's load freed")
        survivors = Counter(fe.chat(unique_prompt())[0] for _ in range(6))
        assert survivors == Counter({3 - victim: 6})
        wait_until(
            lambda: (
                not any(i["healthy"] for i in fe.http.get("/health").json()["instances"] if i["worker_id"] == victim)
            ),
            WAIT,
            what="dead worker reported unhealthy",
        )
        wait_until(fe.idle, WAIT, what="idle")
        # the worker comes back on the same address: a health check returns it to the candidate set
        dead = ms[victim - 1]
        proc = _spawn(
            [
                "-m",
                "mocker",
                "--host",
                "127.0.0.1",
                "--port",
                str(dead.port),
                "--num-gpu-blocks",
                "2048",
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{dead.events}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{dead.replay}",
            ],
            f"mocker-{dead.port}-restarted.log",
        )
        stack.callback(stop_process, proc)
        wait_until(lambda: _all_healthy(fe, 2), START_TIMEOUT, what="restarted worker healthy again")
        back = Counter(fe.chat(unique_prompt())[0] for _ in range(16))
        assert set(back) == {1, 2}, back
        # its new KV events are indexed again (a fresh subscription to the restarted process)
        system = {"role": "system", "content": system_prompt("restarted")}
        w, _, _ = fe.chat([system, {"role": "user", "content": "pinned"}], nvext={"backend_instance_id": victim})
        assert w == victim
        wait_until(
            lambda: (
                {
                    c["worker_id"]: c["overlap_blocks"]
                    for c in fe.explain([system, {"role": "user", "content": "q"}])["candidates"]
                }[victim]
                > 5
            ),
            WAIT,
            what="the restarted worker's KV events indexed",
        )
        # nobody left: a clean 503, no hang, no leaked load
        for p in (proc, ms[2 - victim].proc):
            os.killpg(p.pid, signal.SIGKILL)
        wait_until(lambda: _all_healthy(fe, 0), WAIT, what="both workers unhealthy")
        with pytest.raises(openai.APIStatusError) as err:
            fe.chat(unique_prompt())
        assert err.value.status_code == 503
        assert fe.http.get("/health").status_code == 503
        assert fe.idle()


def test_data_parallel_ranks_are_separate_candidates() -> None:
    from support import free_port_block

    with contextlib.ExitStack() as stack:
        (port,) = free_ports(1)
        events, replay = free_port_block(2), free_port_block(2)
        proc = _spawn(
            [
                "-m",
                "mocker",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--data-parallel-size",
                "2",
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{events}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{replay}",
            ],
            f"mocker-dp-{port}.log",
        )
        stack.callback(stop_process, proc)
        m = Mocker(port, events, replay, proc)
        fe = start_frontend(
            ["--router-mode", "kv", "--worker", m.worker_arg(7) + ",dp_size=2", "--log-level", "debug"], stack
        )
        wait_ready([m], [fe])
        d = fe.explain(unique_prompt())
        assert sorted((c["worker_id"], c["dp_rank"]) for c in d["candidates"]) == [(7, 0), (7, 1)]
        ranks = Counter(fe.chat(unique_prompt())[1] for _ in range(16))
        assert set(ranks) == {0, 1}, ranks  # ties spread over the ranks
        system = {"role": "system", "content": system_prompt("dp-ranks")}
        _, rank, _ = fe.chat([system, {"role": "user", "content": "first"}])
        # rank r publishes on the endpoint's port + r: the overlap shows up on exactly that rank
        wait_until(
            lambda: (
                {
                    (c["dp_rank"], c["overlap_blocks"] > 5)
                    for c in fe.explain([system, {"role": "user", "content": "x"}])["candidates"]
                }
                == {(rank, True), (1 - rank, False)}
            ),
            WAIT,
            what="per-rank KV events indexed",
        )
        assert Counter(fe.chat([system, {"role": "user", "content": f"q{i}"}])[1] for i in range(5)) == Counter(
            {rank: 5}
        )
        # a rank pin (header) overrides the cache preference; an impossible rank is a 400
        pinned = fe.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": "pinned"}],
            max_tokens=1,
            extra_headers={"x-dynamo-dp-rank": str(1 - rank)},
        )
        assert pinned.headers["x-data-parallel-rank"] == str(1 - rank)
        with pytest.raises(openai.BadRequestError):
            fe.client.chat.completions.create(
                model=MODEL, messages=unique_prompt(), max_tokens=1, extra_headers={"x-dynamo-dp-rank": "5"}
            )
        with open(os.path.join(_log_dir(), f"frontend-{fe.port}.log"), encoding="utf-8") as f:
            log = f.read()
        # the guide's per-candidate debug line
        assert "Formula for worker_7: " in log and "Formula for worker_7_dp1: " in log
        assert " = 1.0 * " in log and "(cached_blocks: " in log


def test_replica_sync_shares_active_load(cluster: Cluster) -> None:
    ms = cluster.mockers
    pa, pb = free_ports(2)
    workers = sum((["--worker", m.worker_arg(i + 1)] for i, m in enumerate(ms)), [])
    with contextlib.ExitStack() as stack:
        a = start_frontend(
            [
                "--router-mode",
                "kv",
                "--router-replica-sync",
                "--replica-sync-bind",
                f"tcp://127.0.0.1:{pa}",
                "--replica-sync-peers",
                f"tcp://127.0.0.1:{pb}",
                "--router-min-initial-workers",
                "3",
                *workers,
            ],
            stack,
        )
        b = start_frontend(
            [
                "--router-mode",
                "kv",
                "--router-replica-sync",
                "--replica-sync-bind",
                f"tcp://127.0.0.1:{pb}",
                "--replica-sync-peers",
                f"tcp://127.0.0.1:{pa}",
                *workers,
            ],
            stack,
        )
        wait_ready([], [a, b])
        assert a.http.get("/peers").json() == [f"tcp://127.0.0.1:{pb}"]

        def b_sees_a_stream() -> bool:  # the subscription handshake is asynchronous: retry until it carries
            s = stream_until_first_chunk(a, unique_prompt())
            try:
                return wait_until(lambda: not b.idle(), 2.0, what="replicated load")
            except TimeoutError:
                return False
            finally:
                s.close()

        wait_until(b_sees_a_stream, WAIT, what="frontend B to see frontend A's in-flight request")
        wait_until(lambda: a.idle() and b.idle(), WAIT, what="both replicas idle after the stream ended")


def test_tracker_endpoints_share_the_frontends_accounting(cluster: Cluster) -> None:
    fe = cluster.kv
    wait_until(fe.idle, WAIT, what="idle")
    workers = fe.http.get("/workers").json()
    assert sorted(w["worker_id"] for w in workers) == [1, 2, 3] and workers[0]["model_name"] == MODEL
    # an external router books a big request on worker 1 through the frontend's port...
    r = fe.http.post(
        "/add",
        json={
            "model_name": MODEL,
            "request_id": "external-1",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": list(range(1, 301)),
            "new_isl_tokens": 50000,
        },
    )
    assert r.status_code == 201, r.text
    assert fe.loads()[(1, 0)] == (50000, 300)
    costs = {c["worker_id"]: c["cost"] for c in fe.explain(unique_prompt())["candidates"]}
    assert costs[1] > costs[2] + 3000 and costs[1] > costs[3] + 3000
    # ...and the frontend's own routing takes it into account
    assert 1 not in {fe.chat(unique_prompt())[0] for _ in range(8)}
    assert fe.http.post("/prefill_complete", json={"model_name": MODEL, "request_id": "external-1"}).status_code == 200
    assert fe.loads()[(1, 0)] == (0, 300)
    assert fe.http.post("/free", json={"model_name": MODEL, "request_id": "external-1"}).status_code == 200
    wait_until(fe.idle, WAIT, what="idle after the external free")
    r = fe.http.post("/potential_loads", json={"model_name": MODEL, "sequence_hashes": [1, 2], "new_isl_tokens": 32})
    assert sorted((p["worker_id"], p["potential_prefill_tokens"]) for p in r.json()) == [(1, 32), (2, 32), (3, 32)]


def test_router_tokenizes_exactly_as_the_engine_for_template_arguments(cluster: Cluster) -> None:
    """Template arguments that change the prompt (add_generation_prompt, continue_final_message, tools,
    chat_template_kwargs) must change the router's tokens the same way they change the engine's."""
    fe, worker = cluster.kv, cluster.mockers[0]
    messages = [{"role": "user", "content": "Plan a trip."}, {"role": "assistant", "content": "Sure, first"}]
    variants = [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
        {"chat_template_kwargs": {"add_generation_prompt": False}},
    ]
    seen = set()
    for extra in variants:
        body = {"model": MODEL, "messages": messages, **extra}
        routed = fe.http.post("/admin/route", json=body)
        assert routed.status_code == 200, routed.text
        engine = httpx.post(worker.url + "/tokenize", json=body, timeout=10.0)
        assert engine.status_code == 200, engine.text
        engine_count = engine.json()["count"]
        assert routed.json()["isl"] == engine_count, extra
        seen.add(engine_count)
    assert len(seen) >= 2  # the variants really do render different prompts
