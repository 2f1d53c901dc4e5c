"""``python -m mocker`` as a real process, driven with the openai SDK and httpx."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvroute_common.tokenizer import chat_prompt_token_ids, completion_prompt_token_ids, load_tokenizer
from support import free_port, free_port_block, service, wait_until

MODEL = "kvroute-demo"
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega router cache block prefix worker"
).split()


def long_text(n_words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] + str((i + salt) % 97) for i in range(n_words))


@pytest.fixture(scope="module")
def mocker():
    port = free_port()
    zmq_base = free_port_block(4)
    args = [
        "-m",
        "mocker",
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--num-gpu-blocks",
        "2048",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{zmq_base}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{zmq_base + 2}",
        "--seed",
        "7",
    ]
    with service(args, ready_url=f"http://127.0.0.1:{port}/health", timeout=60):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(mocker):
    return openai.OpenAI(base_url=mocker + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_models_and_health(mocker, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(mocker + "/health").status_code == 200


def test_chat_non_stream_fixed_length(client, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about KV caches."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip()
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(chat_prompt_token_ids(tok, msgs))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_equals_non_stream_and_reports_usage(client):
    msgs = [{"role": "user", "content": "deterministic output please " + long_text(20, 3)}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=9, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_completion_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_completions_text_and_token_prompts(client, tok):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(completion_prompt_token_ids(tok, "Once upon a time"))
    ids = tok.encode("a token id prompt", add_special_tokens=False)
    stream = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 4


def test_repeated_prompt_is_cached_and_faster(client, tok):
    msgs = [{"role": "user", "content": long_text(1500, 11)}]
    n_prompt = len(chat_prompt_token_ids(tok, msgs))
    assert n_prompt > 3000

    def ttft():
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = None
        usage = None
        for c in stream:
            if first is None and c.choices and c.choices[0].delta.content:
                first = time.perf_counter() - t0
            if c.usage:
                usage = c.usage
        return first, usage

    cold, u1 = ttft()
    warm, u2 = ttft()
    assert u1.prompt_tokens_details.cached_tokens == 0
    assert u2.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16
    # modelled prefill: ~100 ms for 3000+ new tokens vs ~17 ms for the last block
    assert warm < cold - 0.04, (cold, warm)


def test_stop_strings_and_min_tokens(client):
    prompt = "stop string test " + long_text(5, 1)
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, extra_body={"ignore_eos": True})
    words = base.choices[0].text.split(" ")
    stop_word = " " + words[5]
    cut = base.choices[0].text.index(stop_word)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, stop=[stop_word], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base.choices[0].text[:cut]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, stop=stop_word, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == base.choices[0].text[:cut]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, extra_body={"min_tokens": 300})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 301  # EOS right after min_tokens


def test_natural_eos_without_ignore_eos(client):
    r = client.completions.create(model=MODEL, prompt="natural end", max_tokens=1000)
    assert r.choices[0].finish_reason == "stop" and 16 < r.usage.completion_tokens <= 257


def test_errors_use_openai_envelope(mocker, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-data-parallel-rank": "2"})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2, 10**9], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=40000)
    r = httpx.post(mocker + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    r = httpx.post(mocker + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_dp_rank_header_and_metrics(mocker, client):
    before = httpx.get(mocker + "/metrics").text
    p1 = _metric(before, "vllm:prompt_tokens_total", engine="1") or 0.0
    r = client.completions.create(
        model=MODEL,
        prompt=long_text(40, 5),
        max_tokens=2,
        extra_headers={"X-data-parallel-rank": "1"},
        extra_body={"ignore_eos": True},
    )
    text = httpx.get(mocker + "/metrics").text
    assert _metric(text, "vllm:prompt_tokens_total", engine="1", model_name=MODEL) == p1 + r.usage.prompt_tokens
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert _metric(text, name, engine="0") is not None, name
        assert _metric(text, name, engine="1") is not None, name
    assert _metric(text, "vllm:cache_config_info", engine="1", block_size="16", num_gpu_blocks="2048") == 1.0
    assert "max_num_batched_tokens" not in text  # as in vLLM: the scheduler budget is only on /server_info
    info = httpx.get(mocker + "/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["scheduler_config"]["max_num_batched_tokens"] > 0 and info["cache_config"]["num_gpu_blocks"] == 2048
    blocks = httpx.get(mocker + "/mocker/kv_blocks", params={"dp_rank": 1}).json()
    assert blocks["dp_rank"] == 1 and len(blocks["blocks"]) >= r.usage.prompt_tokens // 16


def test_client_disconnect_aborts_request(mocker):
    body = {"model": MODEL, "prompt": "long running", "max_tokens": 20000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", mocker + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break

    def idle():
        return _metric(httpx.get(mocker + "/metrics").text, "vllm:num_requests_running", engine="0") == 0.0

    wait_until(idle, timeout=20, what="the aborted request to leave the engine")


def test_non_stream_client_disconnect_aborts_request(mocker):
    body = {"model": MODEL, "prompt": "long running too", "max_tokens": 20000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(mocker + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))

    def idle():
        return _metric(httpx.get(mocker + "/metrics").text, "vllm:num_requests_running", engine="0") == 0.0

    wait_until(idle, timeout=20, what="the abandoned non-streaming request to leave the engine")


def test_tokenize_matches_shared_tokenizer(mocker, tok):
    msgs = [{"role": "user", "content": "hi there"}]
    r = httpx.post(mocker + "/tokenize", json={"model": MODEL, "messages": msgs}).json()
    assert r["tokens"] == chat_prompt_token_ids(tok, msgs) and r["count"] == len(r["tokens"])
    r = httpx.post(mocker + "/tokenize", json={"prompt": "hi there"}).json()
    assert r["tokens"] == completion_prompt_token_ids(tok, "hi there")


def test_preemption_under_memory_pressure_keeps_outputs():
    """40 blocks for 6 concurrent 100-token generations: sequences are preempted and recomputed,
    every request still completes with the same (deterministic) text as when run alone."""
    import concurrent.futures

    port = free_port()
    zmq_base = free_port_block(2)
    args = [
        "-m",
        "mocker",
        "--port",
        str(port),
        "--num-gpu-blocks",
        "40",
        "--speedup-ratio",
        "20",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{zmq_base}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{zmq_base + 1}",
    ]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=url + "/health", timeout=60):
        prompts = [long_text(60, 100 + i) for i in range(6)]

        def run(prompt: str) -> dict:
            r = httpx.post(
                url + "/v1/completions",
                timeout=120,
                json={"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(run, prompts))
        preemptions = _metric(httpx.get(url + "/metrics").text, "vllm:num_preemptions_total", engine="0")
        assert preemptions and preemptions > 0
        for prompt, res in zip(prompts, together, strict=True):
            assert res["usage"]["completion_tokens"] == 100 and res["choices"][0]["finish_reason"] == "length"
            assert run(prompt)["choices"][0]["text"] == res["choices"][0]["text"]
