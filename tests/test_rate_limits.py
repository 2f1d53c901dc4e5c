"""Per-key rate limits (``frontend/routing/rate_limits.py``): the buckets' arithmetic on an explicit
clock, then a real frontend over a mocker with real clients (openai and anthropic SDKs, httpx): 429 +
Retry-After after the burst in both APIs' shapes, recovery, keys isolated from each other, the token
limit charging output tokens, the refusals counted in /metrics, and nothing left booked."""

from __future__ import annotations

import contextlib
import hashlib
import re
import types
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from frontend.routing.rate_limits import ANONYMOUS, Limit, RateLimited, RateLimits, key_id, parse_limit
from support import frontend_client, mocker_url, wait_until

MODEL = "rate-model"
KEY_A, KEY_B, KEY_C = "key-a-secret", "key-b-secret", "key-c-secret"
ADMIN = "admin-secret"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _limits(default: Limit | None, per_key: dict[str, Limit], keys: tuple[str, ...] = (KEY_A, KEY_B)) -> Any:
    clock = Clock()
    rl = RateLimits(default, per_key, [_digest(k) for k in keys], CollectorRegistry(), clock=clock)
    return rl, clock


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---- the core, on an explicit clock -------------------------------------------------------------------


def test_key_ids_and_limit_specs() -> None:
    kid = key_id(KEY_A)
    assert kid == hashlib.sha256(KEY_A.encode()).hexdigest()[:12] and KEY_A not in kid
    assert parse_limit(f"{kid}:rps=5,burst=10,tpm=600,token-burst=50") == (kid, Limit(5, 10, 600, 50))
    assert parse_limit(f"{kid.upper()}:tpm=60")[1] == Limit(tpm=60)
    for bad in (
        "nokey",
        f"{kid}:",
        f"{kid}:burst=3",  # a size without a rate
        f"{kid}:rps=0",
        f"{kid}:rps=-1",
        f"{kid}:rps=nan",
        f"{kid}:speed=3",
        f"{kid[:-1]}:rps=1",
        f"{kid[:-1]}g:rps=1",
    ):
        with pytest.raises(ValueError):
            parse_limit(bad)
    with pytest.raises(ValueError, match="no --api-key"):
        RateLimits(None, {key_id("other"): Limit(rps=1)}, [_digest(KEY_A)], CollectorRegistry())


def test_request_bucket_burst_then_rate() -> None:
    rl, clock = _limits(Limit(rps=0.5, burst=2), {})
    rl.admit(_auth(KEY_A), 10)
    rl.admit(_auth(KEY_A), 10)
    with pytest.raises(RateLimited) as refused:
        rl.admit(_auth(KEY_A), 10)
    assert refused.value.status == 429 and refused.value.headers == {"retry-after": "2"}
    rl.admit(_auth(KEY_B), 10)  # another key has its own bucket
    clock.t += 1.0
    with pytest.raises(RateLimited) as refused:  # half a request refilled: 1 s to go
        rl.admit(_auth(KEY_A), 10)
    assert refused.value.headers == {"retry-after": "1"}
    clock.t += 1.0
    rl.admit(_auth(KEY_A), 10)
    assert rl.refused.labels(key_id(KEY_A), "requests")._value.get() == 2


def test_token_bucket_takes_prompt_at_admission_and_output_at_the_end() -> None:
    # 600 tokens per minute = 10 per second, a bucket of 100
    rl, clock = _limits(Limit(tpm=600, token_burst=100), {})
    hook = rl.admit(_auth(KEY_A), 30)  # 100 -> 70
    assert hook is not None
    hook.on_release(types.SimpleNamespace(tokens_out=50))  # 70 -> 20
    with pytest.raises(RateLimited) as refused:  # 20 < 30: a second until 30
        rl.admit(_auth(KEY_A), 30)
    assert refused.value.headers == {"retry-after": "1"}
    clock.t += 1.0
    rl.admit(_auth(KEY_A), 30)  # 30 -> 0
    clock.t += 10.0  # full again (100)
    rl.admit(_auth(KEY_A), 400)  # larger than the bucket: only on a full bucket, leaves a debt (-300)
    with pytest.raises(RateLimited) as refused:
        rl.admit(_auth(KEY_A), 1)
    assert refused.value.headers == {"retry-after": "31"}  # (1 - -300) / 10 per second
    assert rl.refused.labels(key_id(KEY_A), "tokens")._value.get() == 2


def test_who_is_limited() -> None:
    rl, _ = _limits(Limit(rps=1), {key_id(KEY_B): Limit(rps=100)})
    assert rl.key_of(_auth(KEY_A)) == key_id(KEY_A)
    assert rl.key_of({"authorization": f"bearer {KEY_B}"}) == key_id(KEY_B)
    for headers in ({}, _auth("not-a-key"), {"authorization": "Basic abc"}):
        assert rl.key_of(headers) == ANONYMOUS
    rl.admit(_auth("not-a-key"), 1)  # unknown tokens share the anonymous bucket
    with pytest.raises(RateLimited):
        rl.admit({}, 1)
    for _ in range(50):  # key B's own limit, not the default
        rl.admit(_auth(KEY_B), 1)
    # without keys every request is anonymous, whatever token it carries
    anon = RateLimits(Limit(rps=1), {}, [], CollectorRegistry())
    assert anon.key_of(_auth(KEY_A)) == ANONYMOUS
    # a per-key limit only: the others are not limited (no bucket, no hook)
    only, _ = _limits(None, {key_id(KEY_A): Limit(rps=1)})
    for _ in range(5):
        assert only.admit(_auth(KEY_B), 1) is None


# ---- a real frontend over a mocker ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mocker() -> Iterator[str]:
    with mocker_url(MODEL, "--max-model-len", "4096") as url:
        yield url


@pytest.fixture(scope="module")
def keyed(mocker: str) -> Iterator[dict[str, Any]]:
    """API keys A, B, C and an admin token; A: 0.5 request/s with a burst of 2; C: 120 tokens/min in a
    bucket of 60; B (and the admin token): the default, 50 requests/s."""
    flags = ["--api-key", KEY_A, "--api-key", KEY_B, "--api-key", KEY_C, "--admin-token", ADMIN]
    flags += ["--rate-limit-rps", "50", "--rate-limit-key", f"{key_id(KEY_A)}:rps=0.5,burst=2"]
    flags += ["--rate-limit-key", f"{key_id(KEY_C)}:tpm=120,token-burst=60"]
    with contextlib.ExitStack() as stack:
        fe = stack.enter_context(frontend_client([mocker], *flags, headers={"authorization": f"Bearer {ADMIN}"}))
        base = str(fe.base_url).rstrip("/")
        yield {"fe": fe, "url": base}


def _openai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _chat(client: openai.OpenAI, max_tokens: int = 4) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something short."}], max_tokens=max_tokens
    )


def _refused(fe: httpx.Client, kid: str, limit: str) -> float:
    pattern = re.compile(rf'^kvroute_rate_limited_requests_total\{{key="{kid}",limit="{limit}"\}} (\S+)$', re.M)
    m = pattern.search(fe.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def _loads_idle(fe: httpx.Client) -> bool:
    rows = fe.get("/loads").json()
    return all(r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in rows)


def test_burst_then_429_in_both_shapes_other_keys_unaffected_and_recovery(keyed: dict[str, Any]) -> None:
    url, fe = keyed["url"], keyed["fe"]
    a, b = _openai(url, KEY_A), _openai(url, KEY_B)
    kid = key_id(KEY_A)
    before = _refused(fe, kid, "requests")
    _chat(a)
    _chat(a)  # the burst of 2
    with pytest.raises(openai.RateLimitError) as refused:
        _chat(a)
    retry_after = int(refused.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 2
    assert kid in refused.value.message and KEY_A not in refused.value.message
    # Anthropic's SDK (bearer auth) on the same key: Anthropic's error shape, the same header
    claude = anthropic.Anthropic(base_url=url, auth_token=KEY_A, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as arefused:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert arefused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(arefused.value.response.headers["retry-after"]) >= 1
    # the other key is not touched by A's limit
    for _ in range(5):
        assert _chat(b).choices[0].message is not None
    assert _refused(fe, kid, "requests") == before + 2
    assert _refused(fe, key_id(KEY_B), "requests") == 0
    assert KEY_A not in fe.get("/metrics").text
    # A recovers once its bucket refills (0.5 request/s): polled, not slept
    wait_until(lambda: _try(lambda: _chat(a)), 10, 0.2, what="key A admitted again")
    wait_until(lambda: _loads_idle(fe), 10, what="every load in /loads back at 0")


def _try(call: Any) -> bool:
    try:
        call()
    except openai.RateLimitError:
        return False
    return True


def test_token_limit_counts_prompt_and_output_tokens(keyed: dict[str, Any]) -> None:
    """Key C's bucket holds 60 tokens and refills 2 a second. The first request takes its prompt at
    admission and its output at the end: with both charged the second, the same prompt, no longer fits
    (with the prompt alone charged it would)."""
    url, fe = keyed["url"], keyed["fe"]
    c = _openai(url, KEY_C)
    first = _chat(c, max_tokens=32)
    usage = first.usage
    assert usage is not None
    p, out = usage.prompt_tokens, usage.completion_tokens
    assert out == 32 and 60 - p >= p and 60 - p - out < p - 2, (p, out)  # the test's premise
    before = _refused(fe, key_id(KEY_C), "tokens")
    with pytest.raises(openai.RateLimitError) as refused:
        _chat(c, max_tokens=32)
    # the deficit over the refill rate: about (p - (60 - p - out)) / 2 seconds
    assert int(refused.value.response.headers["retry-after"]) >= (p - (60 - p - out)) // 2 - 1
    assert _refused(fe, key_id(KEY_C), "tokens") == before + 1
    wait_until(lambda: _loads_idle(fe), 10, what="every load in /loads back at 0")


@pytest.fixture(scope="module")
def anonymous(mocker: str) -> Iterator[str]:
    """No API keys: every request shares the default bucket (1 request, then 1 a second)."""
    with frontend_client([mocker], "--rate-limit-rps", "1", "--rate-limit-burst", "1") as fe:
        yield str(fe.base_url).rstrip("/")


def test_anonymous_requests_share_the_default(anonymous: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=anonymous, timeout=30) as h:
        first = h.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        # another bearer token is no key here: the same (anonymous) bucket
        r = h.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer whoever"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == 429 and "anonymous" in r.json()["error"]["message"]
        wait_until(lambda: h.post("/v1/chat/completions", json=body).status_code == 200, 10, 0.2, what="admitted")
        text = h.get("/metrics").text
        assert 'kvroute_rate_limited_requests_total{key="anonymous",limit="requests"}' in text
        assert any(
            ln.startswith("dynamo_frontend_requests_total{") and 'error_type="rate_limited"' in ln
            for ln in text.splitlines()
        ), text
        wait_until(lambda: _loads_idle(h), 10, what="every load in /loads back at 0")  # type: ignore[arg-type]
