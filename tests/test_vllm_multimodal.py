"""Images routed on the keys real vLLM gives them: two vLLM 0.32 CPU engines serving the tiny
Idefics3-shaped vision-language model (kvroute_common/real_engines/tiny_vlm.py: kvroute's tokenizer plus
the image tokens, random weights), kvroute in front in kv mode.

- the same screenshot in a new request goes to the engine that holds it, and the overlap kvroute
  predicted equals the ``cached_tokens`` vLLM reports;
- the same words with another screenshot match only up to the image's first block, on both sides;
- the image at another position (after more text; two images in one request) gets the keys vLLM
  gives it: predicted overlap = cached tokens again, and the hash-parity alarm stays at 0;
- an image given by ``uuid`` is keyed by it, as vLLM keys it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image
from test_vllm_e2e import MODEL, WAIT, Kvroute, cached_tokens, kvroute, wait_indexed

from kvroute_common.multimodal import ImageContext, load_layout
from kvroute_common.real_engines.vllm_cpu import VLM_ARGS, VllmEngine, expected_cached, start_engines, write_tiny_vlm
from kvroute_common.tokenizer import chat_prompt, load_tokenizer
from support import wait_until


def screenshot(color: tuple[int, int, int], size: tuple[int, int] = (100, 80)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def vlm(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Kvroute, list[VllmEngine]]]:
    model_dir = write_tiny_vlm(vllm_python, str(tmp_path_factory.mktemp("tiny-vlm")))
    # 512 blocks (16k tokens) each: two engines whose KV caches take little memory
    engines = [
        VllmEngine(
            vllm_python, model_dir, max_model_len=2048, num_gpu_blocks=512, eager=True, extra_args=list(VLM_ARGS)
        )
        for _ in range(2)
    ]
    start_engines(engines)
    try:
        with kvroute(model_dir, [e.worker_spec(i + 1) for i, e in enumerate(engines)]) as fe:
            yield fe, engines
    finally:
        for e in engines:
            e.stop()


def ask(fe: Kvroute, content: list[dict[str, Any]], worker: int | None = None) -> dict[str, Any]:
    """A chat turn with ``content``; its routing record and usage, once the engine's events for it are indexed."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    out = fe.chat(body, {"x-dynamo-worker-instance-id": str(worker)} if worker else None)
    record, n = out["nvext"]["routing"], out["usage"]["prompt_tokens"]
    assert cached_tokens(out) == expected_cached(record["overlap_blocks"], n), (record, out["usage"])
    wait_indexed(fe, body, record["worker_id"], n)
    return out


def image_offset(model_dir: str, content: list[dict[str, Any]]) -> int:
    """Where the request's first image starts in the engine's prompt (kvroute's own layout)."""
    layout = load_layout(model_dir)
    assert layout is not None
    messages = [{"role": "user", "content": content}]
    _, images = chat_prompt(load_tokenizer(model_dir), messages, ImageContext(layout, model_dir))
    return images[0].offset


def test_a_screenshot_is_routed_to_the_engine_holding_it(vlm: tuple[Kvroute, list[VllmEngine]]) -> None:
    fe, engines = vlm
    words = text("You are a browser agent. Here is the page you are looking at, describe what to click next. ")
    red, green = screenshot((200, 10, 10)), screenshot((10, 200, 10))
    first = ask(fe, [words, image(red)], worker=2)
    n = first["usage"]["prompt_tokens"]
    assert n > 312  # the image is in vLLM's prompt as its 312-token run

    again = ask(fe, [words, image(red), text(" What next?")])
    record = again["nvext"]["routing"]
    assert record["worker_id"] == 2 and record["overlap_blocks"] == n // 32
    assert cached_tokens(again) == expected_cached(n // 32, again["usage"]["prompt_tokens"])

    # the same words and another screenshot: matched only before the image, by kvroute and by vLLM
    other = ask(fe, [words, image(green)], worker=2)
    before_image = image_offset(engines[0].model_dir, [words, image(green)]) // 32
    assert other["nvext"]["routing"]["overlap_blocks"] == before_image

    # the image at another position, and two images in one request: keys as vLLM gives them
    moved = [text("First some more words so the screenshot starts elsewhere. "), words, image(red)]
    ask(fe, moved, worker=1)
    twice = [words, image(green), text(" and before it: "), image(red)]
    ask(fe, twice, worker=1)
    repeat = ask(fe, twice)
    assert repeat["nvext"]["routing"]["worker_id"] == 1
    assert repeat["nvext"]["routing"]["overlap_blocks"] == repeat["usage"]["prompt_tokens"] // 32

    # an image named by uuid is keyed by it: the same pixels under another name are another image
    named = ask(fe, [words, image(red, uuid="tab-17")], worker=1)
    assert named["nvext"]["routing"]["overlap_blocks"] < n // 32
    assert ask(fe, [words, image(red, uuid="tab-17")])["nvext"]["routing"]["worker_id"] == 1

    assert fe.metric("kvroute_hash_parity_mismatch") == 0
    wait_until(fe.idle, WAIT, what="loads back at 0")
