"""Images in chat requests: vLLM's image identity and placeholder layout, the block keys of the blocks an
image spans, and routing on them through the frontend in front of mockers serving the tiny Idefics3-shaped
model's files (kvroute_common/real_engines/tiny_vlm.py --no-weights). The same against real vLLM serving
that model is in tests/test_vllm_multimodal.py.

The identifiers and tile grids below were computed by vLLM 0.32's own ``MultiModalHasher`` (after its
image loader) and by transformers' Idefics3 image processor.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from PIL import Image

from indexer.normalize import _mm_from_extra_keys
from kvroute_common.hashing import list_to_i64, local_block_hashes, mm_object_hash
from kvroute_common.multimodal import (
    Idefics3Layout,
    ImageContext,
    ImageError,
    Placeholder,
    Qwen2VLLayout,
    block_extra_keys,
    block_mm_hashes,
    inspect_image,
    load_layout,
    vllm_image_identifier,
)
from kvroute_common.ports import free_port
from kvroute_common.tokenizer import PromptError, chat_prompt, load_tokenizer
from support import frontend_client, mocker_url, service, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VLM = os.path.join(REPO, "kvroute_common", "real_engines", "tiny_vlm.py")
BS = 32
MODEL = "tiny-vlm"

RGB_PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x03\x00\x00\x00\x02\x08\x02\x00\x00\x00\x12\x16\xf1M\x00"
    b"\x00\x00\x15IDATx\x9ccddbf``````b\x80\x01\x00\x00\xa6\x00\n\x01\xdeh/\x00\x00\x00\x00IEND\xaeB`\x82"
)
RGBA_PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x02\x00\x00\x00\x02\x08\x06\x00\x00\x00r\xb6\r$\x00\x00"
    b"\x00\x14IDATx\x9ccddbfa````b\x80\x02\x00\x00\xcc\x00\x0e\xe8\xb7\xf5\x84\x00\x00\x00\x00IEND\xaeB`\x82"
)


def png(size: tuple[int, int], color: tuple[int, ...], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-vlm"))
    subprocess.run([sys.executable, TINY_VLM, "--out", out, "--no-weights"], check=True, capture_output=True)
    return out


# -- identity, layout, keys


def test_image_identifier_is_vllms() -> None:
    model = "/models/tiny-vlm"
    rgb, rgba = inspect_image(RGB_PNG), inspect_image(RGBA_PNG)
    assert (rgb.width, rgb.height, rgb.converted) == (3, 2, False)
    assert (rgba.width, rgba.height, rgba.converted) == (2, 2, True)  # the engine converts RGBA to RGB
    expected = {
        (RGB_PNG, "blake3"): "cdfe9c2b8c226d1774c6aadb67f15b53f886ca37ed668b645cc29a873f04b6b2",
        (RGB_PNG, "sha256"): "1096f9d0d1d5f97b94bd4711e755c010467c1e5ea304af25cf9318a400a4c4e0",
        (RGBA_PNG, "blake3"): "93ef3c8aa8a61494d86d711e2af9c283f3e25c853fbd9b2d9a52fd75ed79490e",
        (RGBA_PNG, "sha256"): "2dbcee78fba19b2e7950a716d072be8e1fa47ff02e43ee0293916d164a3f753e",
    }
    for (data, algorithm), digest in expected.items():
        assert vllm_image_identifier(data, inspect_image(data).converted, model, algorithm) == digest
    assert vllm_image_identifier(RGB_PNG, False, "/models/other") != expected[(RGB_PNG, "blake3")]


def test_exif_rotation_swaps_the_size() -> None:
    img = Image.new("RGB", (40, 10))
    exif = img.getexif()
    exif[0x0112] = 6  # rotated 90 degrees
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    info = inspect_image(buf.getvalue())
    assert (info.width, info.height) == (10, 40)


def test_png_exif_after_the_pixels_is_read_without_decoding_them() -> None:
    """A PNG's eXIf chunk may follow its pixel data (where vLLM's loader, which decodes the image,
    still applies it); the router finds it without decoding a pixel: the same answer with the pixel
    data destroyed."""
    exif = Image.Exif()
    exif[0x0112] = 6
    plain = png((40, 10), (1, 2, 3))
    chunk = b"eXIf" + exif.tobytes()
    late = (
        plain[:-12] + (len(chunk) - 4).to_bytes(4, "big") + chunk + zlib.crc32(chunk).to_bytes(4, "big") + plain[-12:]
    )
    with Image.open(io.BytesIO(late)) as img:
        assert "exif" not in img.info and img.getexif().get(0x0112) == 6  # Pillow: only after decoding it all
    idat = late.index(b"IDAT") + 4
    broken = late[:idat] + bytes(8) + late[idat + 8 :]
    for data in (late, broken):
        info = inspect_image(data)
        assert (info.width, info.height) == (10, 40)
    assert (inspect_image(plain).width, inspect_image(plain).height) == (40, 10)


def test_idefics3_tile_grid_is_the_processors(vlm_dir: str) -> None:
    layout = load_layout(vlm_dir)
    assert isinstance(layout, Idefics3Layout) and layout.image_seq_len == 16
    grids = {
        (1, 1): (4, 4), (64, 64): (4, 4), (65, 64): (4, 4), (100, 80): (4, 4), (80, 100): (4, 4),
        (256, 256): (4, 4), (257, 100): (2, 4), (1000, 10): (1, 4), (10, 1000): (4, 1), (640, 480): (3, 4),
        (333, 777): (4, 2), (4000, 3000): (3, 4),
    }  # fmt: skip
    assert {size: layout.grid(*size) for size in grids} == grids
    one_tile = Idefics3Layout({"do_image_splitting": False}, {"image_seq_len": 3})
    framed = "<fake_token_around_image><global-img><image><image><image><fake_token_around_image>"
    assert one_tile.replacement(500, 500) == framed
    assert load_layout(os.path.join(REPO, "kvroute_common", "tokenizer_data")) is None  # a text model


def test_qwen2_vl_pads_are_the_processors(tmp_path: Any) -> None:
    """Pads per image of transformers' Qwen2-VL image processor (defaults, and a small max_pixels)."""
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    default = load_layout(str(tmp_path))
    assert isinstance(default, Qwen2VLLayout)
    small = Qwen2VLLayout({"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}, {})
    sizes = [(100, 80), (80, 100), (28, 28), (1, 1), (27, 29), (1000, 10), (640, 480), (1920, 1080), (4000, 3000)]
    assert [default.tokens(w, h) for w, h in sizes] == [12, 12, 4, 4, 6, 20, 391, 1222, 1230]
    assert [small.tokens(w, h) for w, h in sizes] == [12, 12, 4, 4, 6, 20, 54, 60, 54]
    assert default.replacement(28, 28) == "<|image_pad|>" * 4
    with pytest.raises(ImageError):
        default.tokens(1000, 4)  # the processor refuses an aspect ratio over 200


def test_block_keys_follow_vllms_overlap_rule() -> None:
    images = [Placeholder(14, 312, "a" * 64), Placeholder(330, 10, "shot-2")]
    per_block = block_mm_hashes(images, 352, BS)
    a, b = mm_object_hash("a" * 64), mm_object_hash("shot-2")
    assert a == int("a" * 16, 16)
    assert per_block[:10] == [[a]] * 10 and per_block[10] == [a, b]  # block 10 holds the end of one, all of two
    assert block_extra_keys(images, 0, BS) == [["a" * 64, 14]]
    assert block_extra_keys(images, 9, BS) == [["a" * 64, 14 - 288]]
    assert block_extra_keys(images, 10, BS) == [["a" * 64, 14 - 320], ["shot-2", 10]]
    # the event side reads the same keys back from vLLM's extra_keys (LoRA names and salts skipped)
    events = [(("a" * 64, 14),), None, ("my-lora", ("shot-2", -3)), ("dynamo-cache-salt:x",)]
    assert _mm_from_extra_keys(events) == [[a], None, [b], None]
    assert _mm_from_extra_keys([("dynamo-cache-salt:x",)]) is None
    tokens = list(range(BS * 2))
    assert local_block_hashes(tokens, BS, mm_hashes=[[a], None]) != local_block_hashes(tokens, BS)


def test_the_mockers_own_keying_follows_vllms_rule_and_agrees_with_the_routers() -> None:
    """The mocker keys image blocks with its own code (mocker/mm_keys.py), not the router's: hand cases of vLLM's
    cursor walk, then both implementations on random placements."""
    import random

    from mocker.mm_keys import block_image_keys, image_hashes

    a, b, c = Placeholder(14, 50, "a"), Placeholder(64, 10, "b"), Placeholder(74, 22, "c")
    # block 0 [0, 32): a starts at 14; block 1 [32, 64): a ends at 64 exactly; block 2 [64, 96): b then c, c ends
    # exactly at 96; block 3: nothing
    assert block_image_keys([a, b, c], BS, 0, 4) == [(("a", 14),), (("a", -18),), (("b", 0), ("c", 10)), None]
    assert block_image_keys([a, b, c], BS, 2, 4) == [(("b", 0), ("c", 10)), None]  # from a later block
    assert image_hashes([(("b", 0), ("c", 10)), None]) == [[mm_object_hash("b"), mm_object_hash("c")], None]
    rng = random.Random(7)
    for _ in range(300):
        images, at = [], rng.randrange(0, 40)
        for k in range(rng.randrange(1, 5)):
            length = rng.randrange(1, 90)
            images.append(Placeholder(at, length, f"img-{k}"))
            at += length + rng.choice((0, 0, 1, 5, 40))
        n_blocks = (at + rng.randrange(0, 64)) // BS
        mine = block_image_keys(images, BS, 0, n_blocks)
        theirs = [block_extra_keys(images, i, BS) for i in range(n_blocks)]
        assert [list(map(list, ks)) if ks else None for ks in mine] == theirs, images
        assert image_hashes(mine) == block_mm_hashes(images, n_blocks * BS, BS)


def test_chat_prompt_expands_each_image_where_the_template_put_it(vlm_dir: str) -> None:
    tok = load_tokenizer(vlm_dir)
    layout = load_layout(vlm_dir)
    assert layout is not None
    ctx = ImageContext(layout, "/models/tiny-vlm")
    text_only = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}]}]
    base, none = chat_prompt(tok, text_only, ctx)
    assert none == []
    red = data_url(png((100, 80), (200, 10, 10)))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image_part(red)]}]
    tokens, images = chat_prompt(tok, msgs, ctx)
    (image,) = images
    assert image.length == 312  # 16 tiles + the global image, 16 tokens each, tags and newlines
    assert tokens[: image.offset] == base[: image.offset]
    assert len(tokens) == len(base) + image.length  # the <image> token replaced by its run
    first = tokens[image.offset : image.offset + 2]
    assert first == tok.convert_tokens_to_ids(["<fake_token_around_image>", "<row_1_col_1>"])
    # a uuid is the image's identity; the same image with another uuid is another image
    _, (named,) = chat_prompt(tok, [{"role": "user", "content": [image_part(red, uuid="shot-1")]}], ctx)
    assert named.identifier == "shot-1"
    # without a layout (ctx None) the image is routed as text; so is one only the engine can see
    assert chat_prompt(tok, msgs, None) == (base, [])
    for unseen in (image_part("file:///srv/shots/1.png"), {"type": "image_url", "uuid": "cached-on-the-engine"}):
        parts = [{"type": "text", "text": "what is this?"}, unseen]
        assert chat_prompt(tok, [{"role": "user", "content": parts}], ctx) == (base, [])
    for bad in ("data:image/png;base64,@@@", "data:text/plain,hi", data_url(b"not an image")):
        with pytest.raises(PromptError):
            chat_prompt(tok, [{"role": "user", "content": [image_part(bad)]}], ctx)


# -- routing through the frontend in front of mockers


@contextlib.contextmanager
def image_server(images: dict[str, bytes]) -> Iterator[tuple[str, dict[str, int]]]:
    """Serves ``images`` by path on loopback; its URL and the GETs per path."""
    hits: dict[str, int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            hits[self.path] = hits.get(self.path, 0) + 1
            data = images.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.send_header("content-length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        server.shutdown()
        server.server_close()


def routed(fe: httpx.Client, messages: list[dict], **headers: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "nvext": {"extra_fields": ["routing"]}}
    r = fe.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def overlap_on(fe: httpx.Client, messages: list[dict], worker: int) -> int:
    cands = fe.post("/admin/route", json={"model": MODEL, "messages": messages}).json()["candidates"]
    return next((c["overlap_blocks"] for c in cands if c["worker_id"] == worker), 0)


def test_images_are_routed_on_their_identity_through_the_frontend(vlm_dir: str) -> None:
    shot_a, shot_b = png((100, 80), (200, 10, 10)), png((100, 80), (10, 200, 10))
    words = "please describe the screenshot in detail " * 3

    def turn(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": words}, image_part(url)]}]

    flags = ("--model-path", vlm_dir)
    with (
        mocker_url(MODEL, *flags, block_size=BS) as one,
        mocker_url(MODEL, *flags, block_size=BS) as two,
        frontend_client([one, two], *flags, "--mm-max-image-bytes", "100000", "--mm-allow-private-media-hosts") as fe,
        image_server({"/a.png": shot_a}) as (site, hits),
    ):
        first = routed(fe, turn(data_url(shot_a)), **{"x-dynamo-worker-instance-id": "1"})
        n = first["usage"]["prompt_tokens"]
        assert n > 312  # the image's token run is in the engine's prompt
        wait_until(lambda: overlap_on(fe, turn(data_url(shot_a)), 1) == n // BS, 30, what="image blocks indexed")

        again = routed(fe, turn(data_url(shot_a)))
        record = again["nvext"]["routing"]
        assert (record["worker_id"], record["overlap_blocks"]) == (1, n // BS)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == record["overlap_blocks"] * BS

        # same words, another screenshot: only the blocks before the image match, on the router and the engine
        other = turn(data_url(shot_b))
        before_image = overlap_on(fe, other, 1)
        assert before_image < n // BS
        out = routed(fe, other, **{"x-dynamo-worker-instance-id": "1"})
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == before_image * BS

        # the same image from a URL is the same image (fetched once, then cached by URL)
        url = f"{site}/a.png"
        via_url = routed(fe, turn(url))
        assert via_url["nvext"]["routing"]["overlap_blocks"] == n // BS
        routed(fe, turn(url))
        assert hits["/a.png"] == 1 + 2  # the router once; the mocker (the engine) once per request

        # an Anthropic Messages image block is the same image: the conversation follows it
        b64 = base64.b64encode(shot_a).decode()
        source = {"type": "base64", "media_type": "image/png", "data": b64}
        block = [{"type": "text", "text": words}, {"type": "image", "source": source}]
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": block}]}
        r = fe.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["cache_read_input_tokens"] == n // BS * BS

        # an image that cannot be fetched, or a bad data URL, is the client's error
        noise = Image.frombytes("RGB", (200, 200), os.urandom(200 * 200 * 3))
        buf = io.BytesIO()
        noise.save(buf, "PNG")
        too_big = data_url(buf.getvalue())  # over the frontend's --mm-max-image-bytes
        for bad in (f"{site}/missing.png", "data:image/png;base64,@@", too_big):
            r = fe.post("/v1/chat/completions", json={"model": MODEL, "messages": turn(bad), "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert "image" in r.json()["error"]["message"]

        wait_until(lambda: not any(busy(fe)), 10, what="loads freed")


def busy(fe: httpx.Client) -> list[Any]:
    return [w for w in fe.get("/loads").json() if w.get("active_blocks") or w.get("active_prefill_tokens")]


def test_the_mocker_keys_image_blocks_in_its_events(vlm_dir: str) -> None:
    kv = free_port()
    with mocker_url(MODEL, "--model-path", vlm_dir, block_size=BS, kv_port=kv) as url:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{kv}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, image_part(data_url(RGB_PNG))]}]

            def stored() -> list[Any]:
                httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1})
                out = []
                while sub.poll(200):
                    batch = msgspec.msgpack.decode(sub.recv_multipart()[-1])
                    out += [e for e in batch[1] if isinstance(e, (list, dict))]
                return out

            events: list[Any] = []
            wait_until(lambda: bool(events.extend(stored()) or events), 20, what="events")
        finally:
            sub.close(0)
            ctx.term()
    keys = [e[8] if isinstance(e, list) else e["extra_keys"] for e in events]
    ident = vllm_image_identifier(RGB_PNG, False, vlm_dir)
    flat = [k for ks in keys for k in ks or () if k]
    assert flat and all(pair[0][0] == ident for pair in flat)


def test_the_standalone_indexer_matches_image_blocks_by_their_keys(vlm_dir: str) -> None:
    """``python -m indexer`` fed by a mocker's image events: ``/query_by_hash`` with the request's image-keyed
    hashes finds every block; the same tokens hashed without the image's key find only the blocks before it."""
    kv, port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    layout = load_layout(vlm_dir)
    assert layout is not None
    tok, ctx = load_tokenizer(vlm_dir), ImageContext(layout, vlm_dir)
    args = ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port)]
    with (
        service(args, ready_url=f"{base}/health"),
        mocker_url(MODEL, "--model-path", vlm_dir, block_size=BS, kv_port=kv) as url,
    ):
        reg = {"instance_id": 7, "endpoint": f"tcp://127.0.0.1:{kv}", "model_name": MODEL, "block_size": BS}
        assert httpx.post(f"{base}/register", json=reg).status_code == 201

        def matched_tokens(hashes: list[int]) -> int:
            body = {"block_hashes": list_to_i64(hashes), "model_name": MODEL}
            scores = httpx.post(f"{base}/query_by_hash", json=body).json()["scores"]  # {id: {rank: tokens}}
            return max((int(n) for ranks in scores.values() for n in ranks.values()), default=0)

        sent: list[tuple[list[int], list[int], int]] = []

        def send_new_image() -> tuple[list[int], list[int], int]:
            # a new image each time: events published before the indexer's subscription joined are lost
            shot = png((100, 80), (200, 10, len(sent)))
            msgs = [{"role": "user", "content": [{"type": "text", "text": "see " * 40}, image_part(data_url(shot))]}]
            tokens, images = chat_prompt(tok, msgs, ctx)
            keyed = local_block_hashes(tokens, BS, mm_hashes=block_mm_hashes(images, len(tokens), BS))
            httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1})
            sent.append((keyed, local_block_hashes(tokens, BS), images[0].offset))
            return sent[-1]

        def one_indexed() -> bool:
            if any(matched_tokens(keyed) == len(keyed) * BS for keyed, _, _ in sent):
                return True
            send_new_image()
            return False

        wait_until(one_indexed, 30, interval=0.5, what="an image's blocks indexed")
        keyed, plain, offset = next(s for s in sent if matched_tokens(s[0]) == len(s[0]) * BS)
        assert matched_tokens(plain) == offset // BS * BS  # the placeholder tokens alone are not the image
