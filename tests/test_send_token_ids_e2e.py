"""``--send-token-ids`` end to end: a frontend with the built-in tokenizer in front of a mocker that loads
another one (Llama-3's split pattern, which cuts digit runs in threes), so the engine's own count of a
text prompt differs from the router's. By default (auto) ids go only to a worker that turned the probe
text into the router's ids when it joined: that one gets the text, a mocker with the router's tokenizer
is proven. With ``always`` the engine computes the router's ids, streamed or not; a request with a field
that reads the text keeps it."""

from __future__ import annotations

import httpx
import orjson
import pytest

from bench.data_path import hf_tokenizer_dir
from frontend.routing.prompt import (
    IDS_BODY_INLINE_MAX,
    IDS_SLICE,
    Prompt,
    engine_token_ids,
    ids_body_off_loop,
    with_prompt_ids,
)
from kvroute_common.hashing import token_array
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
from kvroute_common.tokenizer import load_tokenizer
from support import wait_until

TEXT = "Invoice 12345678901234567890 for order 98765432123456789, paid 31415926535."


def engine_prompt_tokens(base: str, body: dict) -> int:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["usage"]["prompt_tokens"]
    usage = [line for line in r.text.splitlines() if '"prompt_tokens"' in line]
    assert len(usage) == 1 and r.text.rstrip().endswith("data: [DONE]"), r.text
    return httpx.Response(200, content=usage[0][len("data: ") :]).json()["usage"]["prompt_tokens"]


def probe_results(url: str) -> dict[int, str]:
    """Each worker's probe result (``hash_parity.render.prompt_ids``), once every worker has one."""
    rows = httpx.get(f"{url}/admin/workers", timeout=5).json()["workers"]
    renders = {w["id"]: (w.get("hash_parity") or {}).get("render") for w in rows}
    return {i: r["prompt_ids"] for i, r in renders.items()} if all(renders.values()) else {}


def proven(url: str) -> dict[int, bool]:
    """Which workers get prompts as ids, once every worker's probe answered."""
    if not probe_results(url):
        return {}
    return {w["id"]: w["prompt_ids_proven"] for w in httpx.get(f"{url}/admin/workers", timeout=5).json()["workers"]}


def test_the_engine_computes_the_routers_ids_and_text_fields_keep_the_text(tmp_path) -> None:
    ours = len(load_tokenizer(None)(TEXT)["input_ids"])
    engines = hf_tokenizer_dir(str(tmp_path))
    theirs = len(load_tokenizer(engines)(TEXT)["input_ids"])
    assert ours != theirs  # the two tokenizers disagree on this text
    base = {"model": DEFAULT_MODEL, "prompt": TEXT, "max_tokens": 2}
    with Cluster(log_dir=str(tmp_path / "logs")) as cluster:
        long_context = ["--max-model-len", "65536"]
        worker = cluster.start_mocker(MockerOptions(speedup_ratio=10, model_path=engines, extra_args=long_context))
        cluster.start_mocker(MockerOptions(speedup_ratio=10))  # the router's own tokenizer
        cluster.wait_workers_ready(60)
        url = cluster.start_frontend()  # auto
        wanted = {1: False, 2: True}
        assert wait_until(lambda: proven(url) == wanted, 60, what="the probes answered")
        assert probe_results(url) == {1: "mismatch", 2: "match"}
        pinned = {**base, "nvext": {"backend_instance_id": worker.worker_id}}
        assert engine_prompt_tokens(url, pinned) == theirs  # not proven: the text, as the engine reads it
        url = cluster.start_frontend(extra_args=["--send-token-ids"])  # always
        wait_until(lambda: httpx.get(f"{url}/v1/models", timeout=5).json()["data"], 60, what="the model served")
        assert engine_prompt_tokens(worker.url, base) == theirs  # the engine alone tokenizes its way
        assert engine_prompt_tokens(url, pinned) == ours
        assert engine_prompt_tokens(url, {**pinned, "prompt": [TEXT]}) == ours  # a batch of one
        assert engine_prompt_tokens(url, {**pinned, "stream": True, "stream_options": {"include_usage": True}}) == ours
        assert engine_prompt_tokens(url, {**pinned, "stream": False}) == ours  # sent streamed, answered whole
        assert engine_prompt_tokens(url, {**pinned, "echo": False}) == theirs  # echo reads the text: it goes as text
        # a conversation's turns long enough for the turn memo (their ids kept as a u32 array): sent as ids too
        turn = " ".join([TEXT] * 40)
        for _ in range(2):
            assert engine_prompt_tokens(url, {**pinned, "prompt": turn}) == len(load_tokenizer(None)(turn)["input_ids"])
            turn += " And then: " + TEXT
        hits = [ln for ln in httpx.get(f"{url}/metrics", timeout=5).text.splitlines() if 'result="hit"' in ln]
        assert len(hits) == 1 and float(hits[0].split()[-1]) >= 1, hits  # the second turn continued the first
        # a prompt of more ids than the loop writes (its body written on the tokenizer thread): ids too
        long_text = " ".join(f"{k} {TEXT}" for k in range(1200))
        n_ours = len(load_tokenizer(None)(long_text)["input_ids"])
        assert n_ours > IDS_BODY_INLINE_MAX
        assert engine_prompt_tokens(url, {**pinned, "prompt": long_text}) == n_ours


def test_an_engine_restarted_with_another_tokenizer_gets_text_again(tmp_path) -> None:
    """The proof belongs to the process: a worker that comes back loading another tokenizer is probed again
    and gets text, where its predecessor got ids."""
    ours = len(load_tokenizer(None)(TEXT)["input_ids"])
    engines = hf_tokenizer_dir(str(tmp_path))
    theirs = len(load_tokenizer(engines)(TEXT)["input_ids"])
    body = {"model": DEFAULT_MODEL, "prompt": TEXT, "max_tokens": 2}
    with Cluster(log_dir=str(tmp_path / "logs")) as cluster:
        worker = cluster.start_mocker(MockerOptions(speedup_ratio=10))
        cluster.wait_workers_ready(60)
        url = cluster.start_frontend()
        assert wait_until(lambda: proven(url) == {1: True}, 60, what="the worker proven")
        assert engine_prompt_tokens(url, body) == ours
        # the router sees the process go (a restart between two health checks goes unseen: see the note in
        # docs/engines.md), then the new one come back
        worker.child.proc.kill()
        wait_until(lambda: not httpx.get(f"{url}/admin/workers", timeout=5).json()["workers"][0]["healthy"], 30)
        cluster.restart_mocker(worker, extra_args=["--model-path", engines])
        cluster.wait_workers_ready(60)
        assert wait_until(lambda: probe_results(url) == {1: "mismatch"}, 60, what="the new process probed")
        assert proven(url) == {1: False}
        assert engine_prompt_tokens(url, body) == theirs  # text: the new engine tokenizes it its own way


@pytest.mark.parametrize(
    ("body", "prompt", "sent"),
    [
        ({"prompt": "a b"}, Prompt([1, 2]), [1, 2]),
        ({"prompt": ["a b"]}, Prompt([1, 2]), [1, 2]),
        ({"prompt": "a b"}, Prompt(token_array([1, 2])), [1, 2]),  # a remembered conversation's: a u32 array
        ({"prompt": [1, 2]}, Prompt([1, 2]), None),  # already ids
        ({"prompt": "a b"}, Prompt(token_array(range(IDS_BODY_INLINE_MAX + 1))), list(range(IDS_BODY_INLINE_MAX + 1))),
        ({"prompt": "a b", "echo": True}, Prompt([1, 2]), None),
        ({"prompt": "a b", "suffix": "c"}, Prompt([1, 2]), None),
        ({"prompt": "a b", "add_special_tokens": False}, Prompt([1, 2]), None),
        ({"prompt": "a b", "prompt_logprobs": 1}, Prompt([1, 2]), None),
    ],
)
def test_which_prompts_go_as_ids(body: dict, prompt: Prompt, sent: list[int] | None) -> None:
    ids = engine_token_ids(body, prompt, None)
    assert (None if ids is None else list(ids)) == sent


def test_a_u32_array_of_ids_is_written_as_the_same_json_as_their_list() -> None:
    body = orjson.dumps({"model": "m", "prompt": "text", "max_tokens": 3, "stream": True})
    ids = [0, 1, 255, 256, 128_000, 4_294_967_295]
    out = with_prompt_ids(body, token_array(ids))
    assert out == with_prompt_ids(body, ids)
    assert orjson.loads(out) == {"model": "m", "prompt": ids, "max_tokens": 3, "stream": True}
    for n in (IDS_SLICE - 1, IDS_SLICE, IDS_SLICE + 1, 3 * IDS_SLICE + 5):  # written in slices past one
        many = [(i * 2_654_435_761) % 4_294_967_296 for i in range(n)]
        assert with_prompt_ids(body, token_array(many)) == with_prompt_ids(body, many)


def test_a_long_prompts_ids_body_is_written_on_the_tokenizer_thread() -> None:
    import asyncio
    import threading

    from frontend.routing import prompt as prompt_module
    from kvroute_common.tokenize_offload import TokenizeOffload

    body = orjson.dumps({"model": "m", "prompt": "text", "max_tokens": 3, "nvext": {"prompt": "kept"}})
    written_on: list[str] = []
    write = prompt_module.with_prompt_ids

    def recorded(b: bytes, ids: object) -> bytes:
        written_on.append(threading.current_thread().name)
        return write(b, ids)  # type: ignore[arg-type]

    offload = TokenizeOffload()
    short, long = token_array(range(IDS_BODY_INLINE_MAX)), list(range(IDS_BODY_INLINE_MAX + 1))

    async def main() -> tuple[bytes | None, bytes | None]:
        return await ids_body_off_loop(offload, body, short), await ids_body_off_loop(offload, body, long)

    prompt_module.with_prompt_ids = recorded  # type: ignore[assignment]
    try:
        none, out = asyncio.run(main())
    finally:
        prompt_module.with_prompt_ids = write  # type: ignore[assignment]
        offload.close()
    assert none is None  # short: written on the loop when a worker takes ids
    assert len(written_on) == 1 and written_on[0].startswith("tokenize")
    assert out is not None and orjson.loads(out) == {**orjson.loads(body), "prompt": long}
