"""Issue 6 end to end: real ``python -m frontend`` + ``python -m mocker`` processes on 127.0.0.1.

Shows, through HTTP (httpx and the ``openai`` SDK): routing headers beat ``nvext``; pins land where
pinned (unknown worker -> 4xx, busy -> 529); sessions stick, keep their binding while a request is
live, expire after the idle TTL and are dropped with their worker; priority reaches the engine
(vLLM polarity); output-block tracking grows the decode load as tokens stream; a speculative
prefill makes the next turn a cache hit on the mocker.

The router queue's end-to-end tests live in ``test_extensions_e2e_queue.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from support import free_port, free_port_block, service, wait_until

MODEL = "kvroute-demo"
PRIO_MODEL = "prio-model"
BLOCK = 16
SESSION_TTL = 2.0


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Mocker:
    worker_id: int
    url: str
    dp: int
    events_base: int

    def spec(self, worker_id: int | None = None, events: bool = True) -> str:
        s = f"id={worker_id or self.worker_id},url={self.url},dp_size={self.dp}"
        if events:
            s += f",kv_events_endpoint=tcp://127.0.0.1:{self.events_base}"
            s += f",replay_endpoint=tcp://127.0.0.1:{self.events_base + self.dp}"
        return s


@contextlib.contextmanager
def run_mocker(
    worker_id: int,
    model: str = MODEL,
    dp: int = 1,
    max_num_seqs: int = 256,
    speedup: float = 1.0,
    block_size: int = BLOCK,
    extra: tuple[str, ...] = (),
) -> Iterator[Mocker]:
    port = free_port()
    base = free_port_block(2 * dp)
    args = [
        "-m",
        "mocker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        model,
        "--block-size",
        str(block_size),
        "--num-gpu-blocks",
        "4096",
        "--max-num-seqs",
        str(max_num_seqs),
        "--data-parallel-size",
        str(dp),
        "--speedup-ratio",
        str(speedup),
        "--seed",
        str(worker_id),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{base}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{base + dp}",
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=f"{url}/v1/models", timeout=90):
        yield Mocker(worker_id, url, dp, base)


@contextlib.contextmanager
def run_frontend(workers: list[str], models: list[str], *extra: str) -> Iterator[str]:
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
        "--health-check-interval",
        "0.5",
        *extra,
    ]
    for w in workers:
        args += ["--worker", w]
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        r = httpx.get(f"{url}/v1/models", timeout=2)
        names = {m["id"] for m in r.json().get("data", [])} if r.status_code == 200 else set()
        return all(m in names for m in models)

    with service(args, ready=ready, timeout=90):
        yield url


@pytest.fixture(scope="module")
def mockers():
    with run_mocker(1) as w1, run_mocker(2, dp=2) as w2, run_mocker(3, model=PRIO_MODEL, max_num_seqs=1) as w3:
        yield {1: w1, 2: w2, 3: w3}


@pytest.fixture(scope="module")
def ext(mockers):
    """Frontend with session affinity and output-block tracking."""
    with run_frontend(
        [m.spec() for m in mockers.values()],
        [MODEL, PRIO_MODEL],
        "--router-session-affinity-ttl-secs",
        str(SESSION_TTL),
        "--router-track-output-blocks",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def plain(mockers):
    """Frontend without the optional features (controls; busy-threshold changes stay here)."""
    with run_frontend([mockers[1].spec(), mockers[2].spec()], [MODEL]) as url:
        yield url


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def words(n: int, seed: object = None) -> str:
    rng = random.Random(seed if seed is not None else uuid.uuid4().int)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def chat_body(content: str | None = None, max_tokens: int = 4, model: str = MODEL, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content or words(30)}], "max_tokens": max_tokens}
    body.update(extra)
    return body


WANT_WORKER = {"extra_fields": ["worker_id"]}


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=timeout)


def landed(resp: httpx.Response) -> tuple[int, int]:
    """(worker_id, dp_rank) that served a request, from the response nvext (extra_fields worker_id)."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "nvext" in body and "worker_id" in body["nvext"], f"no nvext.worker_id in the response: {body}"
    info = body["nvext"]["worker_id"]
    rank = info.get("decode_dp_rank", 0)
    if "x-data-parallel-rank" in resp.headers:
        assert int(resp.headers["x-data-parallel-rank"]) == rank
    return info["decode_worker_id"], rank


def route(
    url: str, headers: dict | None = None, nvext: dict | None = None, content: str | None = None
) -> tuple[int, int]:
    ext = dict(WANT_WORKER)
    ext.update(nvext or {})
    return landed(post(url, chat_body(content, nvext=ext), headers))


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus sample (labels must match those given), or None."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def decode_blocks(url: str, worker_id: int, rank: int = 0) -> float:
    v = metric(scrape(url), "dynamo_frontend_worker_active_decode_blocks", worker_id=str(worker_id), dp_rank=str(rank))
    return v or 0.0


def openai_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err, dict) and isinstance(err.get("message"), str)
    return err["message"]


# ---------------------------------------------------------------------------------------------
# nvext, headers, pins
# ---------------------------------------------------------------------------------------------


def test_pins_land_where_pinned(ext):
    assert route(ext, nvext={"backend_instance_id": 1}) == (1, 0)
    assert route(ext, nvext={"backend_instance_id": 2, "dp_rank": 1}) == (2, 1)
    assert route(ext, nvext={"decode_worker_id": 2, "dp_rank": 0}) == (2, 0)
    assert route(ext, {"x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"}) == (2, 1)
    for _ in range(3):  # a worker pin without a rank stays on that worker
        assert route(ext, {"x-worker-instance-id": "1"})[0] == 1


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({"x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"}, (2, 1)),
        ({"x-worker-instance-id": "2", "x-dp-rank": "1"}, (2, 1)),  # legacy aliases
        ({"x-worker-instance-id": "2", "x-data-parallel-rank": "1"}, (2, 1)),
        ({"x-dynamo-worker-instance-id": "two", "x-dynamo-dp-rank": "x"}, (1, 0)),  # unparsable: body stands
    ],
)
def test_headers_beat_nvext(ext, headers, expected):
    assert route(ext, headers, {"backend_instance_id": 1, "dp_rank": 0}) == expected


def test_headers_beat_nvext_with_the_openai_sdk(ext):
    from openai import OpenAI

    client = OpenAI(base_url=f"{ext}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": words(20)}],
        max_tokens=3,
        extra_body={"nvext": {"backend_instance_id": 2, "dp_rank": 1, "extra_fields": ["worker_id"]}},
        extra_headers={"x-dynamo-worker-instance-id": "1", "x-dynamo-dp-rank": "0"},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    info = completion.model_extra["nvext"]["worker_id"]
    assert (info["decode_worker_id"], info.get("decode_dp_rank", 0)) == (1, 0)


def test_unknown_pinned_worker_is_a_clear_4xx(ext):
    r = post(ext, chat_body(nvext={"backend_instance_id": 999}))
    assert 400 <= r.status_code < 500
    assert "999" in openai_error(r, r.status_code)
    r = post(ext, chat_body(), {"x-dynamo-worker-instance-id": "12345"})
    assert 400 <= r.status_code < 500 and "12345" in openai_error(r, r.status_code)
    r = post(ext, chat_body(nvext={"backend_instance_id": 1, "dp_rank": 5}))  # worker 1 has one rank
    assert r.status_code == 400 and "5" in openai_error(r, 400)


def test_invalid_nvext_is_a_400_and_nothing_is_booked(ext):
    r = post(ext, chat_body(nvext={"no_such_field": True}))
    assert "invalid nvext" in openai_error(r, 400)
    r = post(ext, chat_body(nvext={"agent_hints": {"priority": "urgent"}}))
    assert "invalid nvext" in openai_error(r, 400)
    r = post(ext, chat_body(), {"x-dynamo-session-id": "s" * 300})
    assert "session" in openai_error(r, 400)
    text = scrape(ext)
    for w, rank in ((1, 0), (2, 0), (2, 1)):
        assert (
            metric(text, "dynamo_frontend_worker_active_prefill_tokens", worker_id=str(w), dp_rank=str(rank)) or 0
        ) == 0


def test_response_nvext_timing_and_worker_id(ext):
    r = post(ext, chat_body(nvext={"extra_fields": ["worker_id", "timing"], "backend_instance_id": 2, "dp_rank": 1}))
    assert r.status_code == 200, r.text
    ext_obj = r.json()["nvext"]
    assert ext_obj["worker_id"] == {
        "prefill_worker_id": 2,
        "prefill_dp_rank": 1,
        "decode_worker_id": 2,
        "decode_dp_rank": 1,
    }
    t = ext_obj["timing"]
    assert t["ttft_ms"] >= 0 and t["total_time_ms"] >= t["ttft_ms"] and t["request_received_ms"] > 1.6e12
    assert 0.0 <= t["kv_hit_rate"] <= 1.0
    # streaming: worker_id rides on every chunk, timing on the final one
    chunks = []
    with httpx.stream(
        "POST",
        f"{ext}/v1/chat/completions",
        timeout=60,
        json=chat_body(stream=True, nvext={"extra_fields": ["worker_id", "timing"], "backend_instance_id": 1}),
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    with_ext = [c for c in chunks if "nvext" in c]
    assert with_ext, "no stream chunk carried nvext"
    last = with_ext[-1]
    assert last["nvext"]["worker_id"]["decode_worker_id"] == 1 and "ttft_ms" in last["nvext"]["timing"]
    # timing only on the piece that finishes the response, never on the ones before
    finish_at = max(i for i, c in enumerate(chunks) if any(ch.get("finish_reason") for ch in c.get("choices", [])))
    assert all("timing" not in c.get("nvext", {}) for c in chunks[:finish_at])
    assert all(c["nvext"]["worker_id"]["decode_worker_id"] == 1 for c in chunks if c.get("choices"))


def test_nvext_is_not_forwarded_to_the_worker(ext, mockers):
    # the mocker (like vLLM) would reject or ignore it; the frontend must strip it: a request carrying
    # every routing field still succeeds and lands where pinned
    r = post(
        ext,
        chat_body(
            nvext={"backend_instance_id": 1, "agent_hints": {"osl": 10, "priority": 1}, "extra_fields": ["worker_id"]}
        ),
    )
    assert landed(r) == (1, 0)


def test_busy_pinned_worker_is_529(plain):
    try:
        r = httpx.post(
            f"{plain}/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 0.0001}, timeout=10
        )
        assert r.status_code == 200, r.text
        body = chat_body(max_tokens=2000, stream=True, ignore_eos=True)
        with httpx.stream(
            "POST", f"{plain}/v1/chat/completions", json=body, headers={"x-dynamo-worker-instance-id": "1"}, timeout=60
        ) as s:
            lines = s.iter_lines()
            next(lines)  # streaming: worker 1 now holds decode blocks
            wait_until(lambda: decode_blocks(plain, 1) > 0, timeout=20, what="worker 1 to carry decode load")
            r = post(plain, chat_body(), {"x-dynamo-worker-instance-id": "1"})
            assert "busy" in openai_error(r, 529).lower()
            assert post(plain, chat_body(), {"x-dynamo-worker-instance-id": "2"}).status_code == 200
        # the stream is closed: worker 1 is free again
        wait_until(
            lambda: post(plain, chat_body(), {"x-dynamo-worker-instance-id": "1"}).status_code == 200,
            timeout=30,
            what="worker 1 to accept pinned requests again",
        )
    finally:
        httpx.post(f"{plain}/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 1.0}, timeout=10)


# ---------------------------------------------------------------------------------------------
# session affinity
# ---------------------------------------------------------------------------------------------


def test_sessions_stick_while_free_routing_spreads(ext):
    sid = f"sess-{uuid.uuid4()}"
    targets = {route(ext, {"x-dynamo-session-id": sid}) for _ in range(8)}
    assert len(targets) == 1, f"session moved between {targets}"
    free = {route(ext) for _ in range(16)}
    assert len(free) > 1, "without a session, equal-cost requests should spread (control)"


def test_session_headers_without_affinity_are_identity_only(plain):
    # affinity off: a session header (even one too long for the affinity table) changes nothing
    assert post(plain, chat_body(), {"x-dynamo-session-id": "s" * 300}).status_code == 200


@pytest.mark.parametrize(
    "make_headers",
    [
        lambda sid: {"x-claude-code-session-id": sid},
        lambda sid: {"x-claude-code-session-id": "root-" + sid, "x-claude-code-agent-id": sid},
        lambda sid: {"thread-id": sid},
        lambda sid: {"x-session-id": sid},
    ],
    ids=["claude-code", "claude-code-subagent", "codex", "opencode"],
)
def test_coding_agent_session_headers_stick(ext, make_headers):
    sid = f"agent-{uuid.uuid4()}"
    first = route(ext, {**make_headers(sid), "x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"})
    assert first == (2, 1)  # with no binding yet, the pin headers are the proposal
    for _ in range(3):
        assert route(ext, make_headers(sid)) == (2, 1)


def test_binding_beats_pin_headers_then_expires_after_idle_ttl(ext):
    sid = f"sess-{uuid.uuid4()}"
    assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "1"}) == (1, 0)
    # bound: headers are only a proposal when no binding exists
    assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"}) == (
        1,
        0,
    )
    idle_from = time.monotonic()
    # the TTL is the thing under test: let it run out (idle, no request of this session)
    wait_until(
        lambda: time.monotonic() - idle_from > SESSION_TTL + 1.0, timeout=SESSION_TTL + 5, interval=0.1, what="idle TTL"
    )
    assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"}) == (
        2,
        1,
    )
    # and the new binding holds
    assert route(ext, {"x-dynamo-session-id": sid}) == (2, 1)


def test_live_request_keeps_the_binding_past_the_ttl(ext):
    sid = f"sess-{uuid.uuid4()}"
    assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "0"}) == (
        2,
        0,
    )
    body = chat_body(max_tokens=4000, stream=True, ignore_eos=True)
    with httpx.stream(
        "POST", f"{ext}/v1/chat/completions", json=body, headers={"x-dynamo-session-id": sid}, timeout=60
    ) as s:
        started = time.monotonic()
        for _ in s.iter_lines():  # keep reading the live stream well past the idle TTL
            if time.monotonic() - started > SESSION_TTL + 1.0:
                break
        else:
            pytest.fail("the long stream ended before the TTL elapsed")
        assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "1"}) == (2, 0)


def test_binding_is_dropped_when_its_worker_goes_away(ext, mockers):
    extra_id = 41  # worker 1's engine registered a second time under another id, then removed
    r = httpx.post(f"{ext}/admin/workers", json={"id": extra_id, "url": mockers[1].url}, timeout=30)
    assert r.status_code in (200, 201), r.text
    try:
        wait_until(
            lambda: post(ext, chat_body(), {"x-dynamo-worker-instance-id": str(extra_id)}).status_code == 200,
            timeout=30,
            what="the extra worker to serve",
        )
        sid = f"sess-{uuid.uuid4()}"
        assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": str(extra_id)}) == (extra_id, 0)
        assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "2"})[0] == extra_id
    finally:
        assert httpx.delete(f"{ext}/admin/workers/{extra_id}", timeout=30).status_code == 200
    # the binding went with the worker: the session routes again (here: to the proposed pin)
    assert route(ext, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "2", "x-dynamo-dp-rank": "1"}) == (
        2,
        1,
    )


# ---------------------------------------------------------------------------------------------
# priority reaches the engine
# ---------------------------------------------------------------------------------------------


def test_priority_reaches_the_worker(ext, mockers):
    """Worker 3 runs one sequence at a time (max_num_seqs 1), so waiting requests are ordered by the
    engine's own priority queue: the higher-priority request (sent second) finishes first only if the
    frontend forwarded ``priority`` with vLLM's polarity (lower value = sooner)."""
    w3 = mockers[3].url

    def waiting() -> float:
        return metric(httpx.get(f"{w3}/metrics", timeout=5).text, "vllm:num_requests_waiting") or 0.0

    async def main() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=ext, timeout=120) as client:

            async def req(name: str, max_tokens: int, priority: int | None, header: bool = False) -> None:
                nv = {"agent_hints": {"priority": priority}} if (priority is not None and not header) else None
                hdr = {"x-dynamo-request-priority": str(priority)} if header else {}
                body = chat_body(model=PRIO_MODEL, max_tokens=max_tokens, ignore_eos=True)
                if nv:
                    body["nvext"] = nv
                r = await client.post("/v1/chat/completions", json=body, headers=hdr)
                assert r.status_code == 200, r.text
                done.append(name)

            loop = asyncio.get_running_loop()
            blocker = asyncio.create_task(req("blocker", 600, None))
            await loop.run_in_executor(
                None,
                lambda: wait_until(
                    lambda: metric(httpx.get(f"{w3}/metrics", timeout=5).text, "vllm:num_requests_running") == 1,
                    timeout=30,
                    what="blocker running",
                ),
            )
            low = asyncio.create_task(req("low", 3, -5))
            await loop.run_in_executor(None, lambda: wait_until(lambda: waiting() >= 1, timeout=30, what="low waiting"))
            high = asyncio.create_task(req("high", 3, 10, header=True))
            await loop.run_in_executor(
                None, lambda: wait_until(lambda: waiting() >= 2, timeout=30, what="high waiting")
            )
            assert "blocker" not in done, "blocker finished too early for the test to mean anything"
            await asyncio.gather(blocker, low, high)
        return done

    order = asyncio.run(main())
    assert order.index("high") < order.index("low"), order


# ---------------------------------------------------------------------------------------------
# output-block tracking
# ---------------------------------------------------------------------------------------------


def _decode_growth(url: str, worker: int, tokens_to_read: int, osl: int | None = None) -> tuple[float, float]:
    """Stream a long generation pinned to ``worker``; decode load after the first and after
    ``tokens_to_read`` chunks."""
    nv = {"agent_hints": {"osl": osl}} if osl else None
    body = chat_body(max_tokens=tokens_to_read + 200, stream=True, ignore_eos=True, nvext=nv)
    if nv is None:
        body.pop("nvext")
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"x-dynamo-worker-instance-id": str(worker)},
        timeout=120,
    ) as s:
        n = 0
        first = None
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            n += 1
            if n == 2:
                first = decode_blocks(url, worker)
            if n >= tokens_to_read:
                return first, decode_blocks(url, worker)
    pytest.fail("stream ended early")


def test_output_tracking_grows_decode_load_as_tokens_stream(ext, plain):
    start, later = _decode_growth(ext, 1, 240)
    # 240 generated tokens = 15 more blocks of 16 on top of the prompt's
    assert later - start >= 10, (start, later)
    # control: without --router-track-output-blocks the decode load stays at the prompt's blocks
    c_start, c_later = _decode_growth(plain, 1, 240)
    assert c_later == c_start, (c_start, c_later)
    # loads return to zero once the streams are over
    wait_until(
        lambda: decode_blocks(ext, 1) == 0 and decode_blocks(plain, 1) == 0, timeout=30, what="decode load to drain"
    )


def test_osl_decay_shrinks_tracked_output_load(ext):
    _, no_osl = _decode_growth(ext, 1, 240)
    wait_until(lambda: decode_blocks(ext, 1) == 0, timeout=30, what="decode load to drain")
    _, with_osl = _decode_growth(ext, 1, 240, osl=120)  # past the expected length: its blocks decay away
    assert with_osl < no_osl, (with_osl, no_osl)


# ---------------------------------------------------------------------------------------------
# speculative prefill
# ---------------------------------------------------------------------------------------------


def _two_turns(url: str, speculative: bool, mocker_url: str, worker: int) -> tuple[int, int, int]:
    """Turn 1 (optionally with speculative_prefill), then turn 2 = history + reply + new question.

    Returns (turn 2 cached tokens, turn 1 prompt + generated tokens, turn 2 prompt tokens)."""
    from kvroute_common.tokenizer import chat_prompt_token_ids, load_tokenizer

    tok = load_tokenizer()
    history = [{"role": "system", "content": words(40)}, {"role": "user", "content": words(60)}]
    p1 = len(chat_prompt_token_ids(tok, history))
    # end turn 1 two tokens short of a block boundary: what turn 1 leaves in the engine's cache then
    # stops a block earlier than a warm-up that also covers the reply's end-of-turn tokens
    gen = next(g for g in range(40, 56) if (p1 + g) % BLOCK == BLOCK - 2)
    nv = {"extra_fields": ["worker_id"], "agent_hints": {"speculative_prefill": speculative}}
    hdr = {"x-dynamo-worker-instance-id": str(worker)}

    def served() -> float:
        return metric_sum(httpx.get(f"{mocker_url}/metrics", timeout=5).text, "vllm:request_success_total")

    before = served()
    r1 = post(url, {"model": MODEL, "messages": history, "max_tokens": gen, "ignore_eos": True, "nvext": nv}, hdr)
    assert landed(r1)[0] == worker
    u1 = r1.json()["usage"]
    assert u1["prompt_tokens"] == p1 and u1["completion_tokens"] == gen
    reply = r1.json()["choices"][0]["message"]["content"]
    if speculative:  # the warm-up (a second request to the same worker) runs in the background
        wait_until(lambda: served() >= before + 2, timeout=30, what="the speculative warm-up to finish")
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": words(10)}]
    r2 = post(url, {"model": MODEL, "messages": history, "max_tokens": 2}, hdr)
    assert r2.status_code == 200, r2.text
    usage = r2.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return cached, p1 + gen, usage["prompt_tokens"]


def test_speculative_prefill_makes_the_next_turn_a_cache_hit(ext, mockers):
    cached, turn1, prompt = _two_turns(ext, True, mockers[1].url, 1)
    # the warm-up cached the history + reply + its end-of-turn tokens: the hit reaches past
    # everything turn 1 itself left in the engine's cache (prompt + generated tokens)
    assert turn1 < cached < prompt, (cached, turn1, prompt)
    control_cached, control_turn1, _ = _two_turns(ext, False, mockers[1].url, 1)
    # without it, the next turn only finds what turn 1 left behind
    assert control_cached < control_turn1, (control_cached, control_turn1)


# ---------------------------------------------------------------------------------------------
# --no-router-assume-kv-reuse
# ---------------------------------------------------------------------------------------------


def _decode_load_of_two_identical_streams(url: str, content: str) -> float:
    """Decode load on worker 1 while two streams with the prompt ``content`` run there."""
    body = chat_body(content, max_tokens=5000, stream=True, ignore_eos=True)
    hdr = {"x-dynamo-worker-instance-id": "1"}
    with (
        httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=hdr, timeout=60) as a,
        httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=hdr, timeout=60) as b,
    ):
        assert a.status_code == 200 and b.status_code == 200, (a.status_code, b.status_code)
        la, lb = a.iter_lines(), b.iter_lines()
        first = next(la), next(lb)  # both streaming
        assert all(line.startswith("data: {") for line in first), first
        load = decode_blocks(url, 1)
    wait_until(lambda: decode_blocks(url, 1) == 0, timeout=30, what="decode load to drain")
    return load


def test_no_assume_kv_reuse_counts_identical_prompts_twice(mockers, plain):
    content = words(120, seed="no-assume-kv-reuse")  # the same prompt (and block count) in both runs
    shared = _decode_load_of_two_identical_streams(plain, content)
    with run_frontend([mockers[1].spec(), mockers[2].spec()], [MODEL], "--no-router-assume-kv-reuse") as unique_url:
        unique = _decode_load_of_two_identical_streams(unique_url, content)
    # by default the second request's prompt blocks are the first one's (same hashes): counted once;
    # with unique per-request hashes both requests' blocks count
    assert shared > 0 and unique >= 2 * shared - 2, (shared, unique)
