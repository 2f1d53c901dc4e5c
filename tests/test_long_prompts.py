"""Long prompts through a real frontend and mockers: what no engine can take is refused before it is
hashed or booked (the engines' context length and KV capacity, read from them), a prompt only some
engines can take goes only to those, and a prompt tokenized and hashed on the tokenizer thread is
routed on the same hashes as one handled inline.
"""

from __future__ import annotations

import contextlib

import httpx

from support import frontend_client, mocker_url, wait_until

MODEL = "long"
BS = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"


def mocker(*flags: str) -> contextlib.AbstractContextManager[str]:
    return mocker_url(MODEL, *flags, block_size=BS)


def frontend(*urls: str, flags: tuple[str, ...] = ()) -> contextlib.AbstractContextManager[httpx.Client]:
    return frontend_client(urls, *flags)


def text(n_words: int, salt: str = "") -> str:
    words = WORDS.split()
    return salt + " " + " ".join(words[i % len(words)] + str(i % 97) for i in range(n_words))


def routed(fe: httpx.Client, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "nvext": {"extra_fields": ["routing"]}}
    return fe.post("/v1/completions", json=body)


def _requests_seen(url: str) -> int:
    return len(httpx.get(f"{url}/mocker/priorities").json()["priorities"])


def test_prompts_no_engine_can_take_are_refused_before_routing_and_others_go_where_they_fit() -> None:
    # worker 1: a small KV cache (63 usable blocks = 1008 tokens); worker 2: 16368 tokens; both 8192 context
    with (
        mocker("--max-model-len", "8192", "--num-gpu-blocks", "64") as small,
        mocker("--max-model-len", "8192", "--num-gpu-blocks", "1024") as large,
        frontend(small, large) as fe,
    ):
        mid = routed(fe, text(700))  # ~2000 tokens: over worker 1's KV capacity, within worker 2's
        assert mid.status_code == 200, mid.text
        record = mid.json()["nvext"]["routing"]
        assert record["isl"] > 1008 and [c["worker_id"] for c in record["candidates"]] == [2]
        short = routed(fe, text(50)).json()["nvext"]["routing"]
        assert sorted(c["worker_id"] for c in short["candidates"]) == [1, 2]

        seen = _requests_seen(small) + _requests_seen(large)
        over = routed(fe, text(4000))  # ~12000 tokens: over every engine's context length
        assert over.status_code == 400
        assert "maximum context length is 8192 tokens" in over.json()["error"]["message"]
        assert _requests_seen(small) + _requests_seen(large) == seen  # no engine saw it
        loads = fe.get("/loads").json()
        assert all(r["active_decode_blocks"] == 0 and r["active_prefill_tokens"] == 0 for r in loads)


def test_a_prompt_over_every_kv_cache_gets_the_engines_capacity_message() -> None:
    with mocker("--max-model-len", "32768", "--num-gpu-blocks", "64") as one, frontend(one) as fe:
        refused = routed(fe, text(700))
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "KV cache holds only 1008 tokens" in message, message
        direct = httpx.post(f"{one}/v1/completions", json={"model": MODEL, "prompt": text(700), "max_tokens": 1})
        assert direct.status_code == 400 and "KV cache holds only 1008 tokens" in direct.json()["error"]["message"]


def test_prompts_hashed_on_the_tokenizer_thread_route_on_the_same_hashes() -> None:
    """With a 1000-character offload threshold the long prompt is tokenized and hashed on the thread,
    the short one inline; both find their full cached prefix on the worker that computed it."""
    with (
        mocker("--max-model-len", "32768") as one,
        mocker("--max-model-len", "32768") as two,
        frontend(one, two, flags=("--tokenizer-offload-chars", "1000")) as fe,
    ):
        for prompt in (text(3000, "long"), text(40, "short")):
            first = routed(fe, prompt)
            assert first.status_code == 200, first.text
            record = first.json()["nvext"]["routing"]
            full = record["isl"] // BS

            def cached(p: str = prompt, w: int = record["worker_id"], n: int = full) -> bool:
                cands = fe.post("/admin/route", json={"model": MODEL, "prompt": p}).json()["candidates"]
                return any(c["worker_id"] == w and c["overlap_blocks"] == n for c in cands)

            wait_until(cached, 30, what="the prompt's blocks indexed")
            again = routed(fe, prompt).json()
            assert again["nvext"]["routing"]["worker_id"] == record["worker_id"]
            assert again["nvext"]["routing"]["overlap_blocks"] == full
            # the engine recomputes at least the last token: a block-aligned prompt hits one block less
            expected = min(full, (record["isl"] - 1) // BS) * BS
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
