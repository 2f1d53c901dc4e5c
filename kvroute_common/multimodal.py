"""Images in chat requests as the engine sees them: placeholder tokens and the keys of their blocks.

A vLLM engine serving a vision-language model replaces each image's placeholder in the rendered prompt
with a run of tokens whose layout depends on the image's size, and keys every KV block that holds part
of an image with the image's identity (``("mm", identifier, offset)`` in the block hash; the pair
``[identifier, offset]`` in its ``BlockStored`` events' ``extra_keys``). The router reproduces both, so
that a repeated screenshot matches the blocks that hold it and another image with the same words
does not:

- **identity**: the request's ``uuid`` for the part when it gives one; otherwise vLLM's hash of the
  image: a digest (blake3 by default) over the encoded file's bytes, the decode settings when the
  engine converts the image to RGB, and the model id (the path or name the engine was started with:
  ``root`` in its ``/v1/models``);
- **layout**: the model family's processor arithmetic from the model's own processor configs
  (:class:`Idefics3Layout`: Idefics3 / SmolVLM-style tiles); the image's size and mode come from its
  header (Pillow reads no pixels);
- **block keys**: an image touches every block its token run overlaps; the block's local hash appends
  the u64 of each identifier (:func:`kvroute_common.hashing.mm_object_hash`). The block's offset
  within the image is not hashed: the chained sequence hash already fixes where the image starts.

Computing these in the router costs a base64 decode and one digest per image (a few ms for a
megabyte, on the tokenizer thread) instead of a round trip to an engine per request; the real-engine
tests hold the two to the same tokens and identifiers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute_common.hashing import mm_object_hash

IMAGE_PART = "image_url"
# content parts the engine would process as media kvroute does not key: routed on their text only
UNKEYED_PARTS = frozenset({"input_audio", "audio_url", "video_url", "image_embeds", "image_pil", "video"})
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
HASH_ALGORITHMS = ("blake3", "sha256", "sha512")
# what vLLM's image loader records when it converts an image to RGB (part of the image's hash)
_RGB_CONVERSION = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # rotated by 90 or 270 degrees: width and height swap


class ImageError(ValueError):
    """An image part that cannot be read (a client error: 400)."""


class ImageNotKeyable(Exception):
    """An image the engine may accept but the router cannot see: given by ``uuid`` alone (the engine has it
    cached) or by a URL scheme only the engine can open (``file://`` with ``--allowed-local-media-path``).
    The request is routed on its text."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part of a request, in prompt order."""

    url: str | None
    uuid: str | None

    @property
    def remote(self) -> bool:
        return self.url is not None and self.url.startswith(("http://", "https://"))


def image_ref(part: Mapping[str, Any], where: str) -> ImageRef:
    """The image of an OpenAI ``image_url`` part (``{"url": ...}`` or a bare string; an optional ``uuid``)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    uuid = part.get("uuid")
    if url is not None and not isinstance(url, str):
        raise ImageError(f"{where}.image_url.url must be a string")
    if uuid is not None and not isinstance(uuid, str):
        raise ImageError(f"{where}.uuid must be a string")
    if not url and not uuid:
        raise ImageError(f"{where}.image_url.url is required")
    return ImageRef(url or None, uuid)


def image_parts(body: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The image parts of a chat body's messages, in order."""
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and part.get("type") == IMAGE_PART:
                yield part


def remote_image_urls(body: Mapping[str, Any]) -> list[str]:
    """The distinct http(s) image URLs of a chat body's messages, in order."""
    urls: dict[str, None] = {}
    for part in image_parts(body):
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            urls[url] = None
    return list(urls)


def data_url_bytes(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:<type>;base64,<data>`` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("an image data URL must be data:<media type>;base64,<data>")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL is not valid base64") from None


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the engine's loader sees of an image before its processor: the size after EXIF rotation,
    and whether it converts the image to RGB (which vLLM records in the image's hash)."""

    width: int
    height: int
    converted: bool


def inspect_image(data: bytes) -> ImageInfo:
    """Size and mode from the image's header (no pixel decode)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            mode = img.mode
            try:
                orientation = _orientation(img, data)
            except Exception:  # malformed EXIF: the engine's transpose gives up on it too
                orientation = None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"the image cannot be read: {exc}") from None
    if orientation in _TRANSPOSED_ORIENTATIONS:
        width, height = height, width
    return ImageInfo(width, height, mode != "RGB")


def _orientation(img: Any, data: bytes) -> Any:
    """The EXIF orientation tag. A PNG's ``eXIf`` chunk may follow its pixel data, and Pillow's PNG
    ``getexif`` then decodes every pixel to reach it (10 ms for a 1280x800 screenshot, every image of
    every request): the chunk is found by walking the chunk headers instead."""
    from PIL import Image

    if img.format != "PNG" or "exif" in img.info:
        return img.getexif().get(_EXIF_ORIENTATION)
    raw = _png_chunk(data, b"eXIf")
    if raw is None:
        return None
    exif = Image.Exif()
    exif.load(raw)
    return exif.get(_EXIF_ORIENTATION)


def _png_chunk(data: bytes, kind: bytes) -> bytes | None:
    """The data of a PNG's first chunk of type ``kind`` (None: none before IEND or the end)."""
    pos = 8  # after the signature; every chunk is length, type, data, CRC
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        chunk = data[pos + 4 : pos + 8]
        if chunk == kind:
            return data[pos + 8 : pos + 8 + length]
        if chunk == b"IEND":
            return None
        pos += 12 + length
    return None


# -- vLLM's image identity


def _framed(chunk: bytes) -> bytes:
    return len(chunk).to_bytes(8, "little") + chunk


def _value(value: Any) -> bytes:
    """One value of vLLM's multimodal hash input: tagged by container kind, each leaf length-framed."""
    if isinstance(value, (list, tuple)):
        return b"\x01" + len(value).to_bytes(8, "little") + b"".join(_value(v) for v in value)
    if isinstance(value, dict):
        items = b"".join(_framed(str(k).encode()) + _value(v) for k, v in value.items())
        return b"\x02" + len(value).to_bytes(8, "little") + items
    if isinstance(value, str):
        return b"\x03" + _framed(value.encode("utf-8"))
    if isinstance(value, bytes):
        return b"\x03" + _framed(value)
    if isinstance(value, int):  # numpy's default integer: int64
        return b"\x03" + _framed(value.to_bytes(8, "little", signed=True))
    raise TypeError(f"no hash encoding for {type(value).__name__}")


def _hasher(algorithm: str) -> Any:
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3(max_threads=1)
    if algorithm in ("sha256", "sha512"):
        return hashlib.new(algorithm)
    raise ValueError(f"unknown multimodal hash algorithm {algorithm!r} (one of {', '.join(HASH_ALGORITHMS)})")


def vllm_image_identifier(data: bytes, converted: bool, model_id: str, algorithm: str = "blake3") -> str:
    """vLLM's identifier of an image loaded from a URL: ``hash_kwargs(image=..., model_id=...)`` over
    the file's bytes (with the RGB conversion settings when it converts), keyword names sorted."""
    image = _value({"io_config": _RGB_CONVERSION, "data": data}) if converted else _value(data)
    h = _hasher(algorithm)
    h.update(_framed(b"image") + b"\x03" + _framed(b"image") + image)
    h.update(_framed(b"model_id") + _value(model_id))
    return str(h.hexdigest())


# -- placeholder layouts


class Idefics3Layout:
    """Idefics3 / SmolVLM: the image is scaled so its longest edge is at most ``size.longest_edge``
    (and, with splitting, cut into ``max_image_size`` tiles); each tile and the global image become
    ``image_seq_len`` image tokens, framed by ``<fake_token_around_image>`` and a tile or global tag."""

    family = "idefics3"
    image_token = "<image>"  # the token the chat template renders per image, replaced by the run
    placeholder_text = "<image>"  # what vLLM puts in front of a string template's text per image

    def __init__(self, image_config: Mapping[str, Any], processor_config: Mapping[str, Any]) -> None:
        self.image_seq_len = int(processor_config.get("image_seq_len", 169))
        self.splitting = bool(image_config.get("do_image_splitting", True))
        self.longest_edge = int((image_config.get("size") or {}).get("longest_edge", 4 * 364))
        self.tile = int((image_config.get("max_image_size") or {}).get("longest_edge", 364))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Tile rows and columns (0, 0 = the global image alone), as the processor computes them."""
        if not self.splitting:
            return 0, 0
        height, width = _rescale_to_max_len(height, width, self.longest_edge)
        height, width = _scale_below_upper_bound(height, width, _IDEFICS3_MAX_IMAGE_SIZE)
        tile = self.tile
        rows_h = math.ceil(height / tile) * tile
        cols_w = math.ceil(width / tile) * tile
        if rows_h > tile or cols_w > tile:
            return math.ceil(rows_h / tile), math.ceil(cols_w / tile)
        return 0, 0

    def replacement(self, width: int, height: int) -> str:
        """The text the engine puts in place of the image's ``<image>`` token."""
        image = "<image>" * self.image_seq_len
        rows, cols = self.grid(width, height)
        global_image = "<fake_token_around_image><global-img>" + image + "<fake_token_around_image>"
        if rows == 0 and cols == 0:
            return global_image
        tiles = []
        for r in range(1, rows + 1):
            tiles += [f"<fake_token_around_image><row_{r}_col_{c}>" + image for c in range(1, cols + 1)]
            tiles.append("\n")
        return "".join(tiles) + "\n" + global_image


_IDEFICS3_MAX_IMAGE_SIZE = 4096  # the processor's upper bound on either side


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        if height % 2 != 0:
            height += 1
    else:
        height = max_len
        width = int(height * aspect)
        if width % 2 != 0:
            width += 1
    return max(height, 1), max(width, 1)


def _scale_below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


class Qwen2VLLayout:
    """Qwen2-VL / Qwen2.5-VL: the image is resized to multiples of ``patch_size * merge_size`` within
    ``[min_pixels, max_pixels]`` (``smart_resize``), and its ``<|image_pad|>`` becomes one pad per merged
    patch. Checked against transformers' processor; vLLM's CPU build here cannot serve the model (its
    processor module needs torchvision), so no real-engine test holds it."""

    family = "qwen2_vl"
    image_token = "<|image_pad|>"
    placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, image_config: Mapping[str, Any], processor_config: Mapping[str, Any]) -> None:
        size = image_config.get("size") or {}
        self.patch = int(image_config.get("patch_size", 14))
        self.merge = int(image_config.get("merge_size", 2))
        self.min_pixels = int(image_config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(image_config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)

    def tokens(self, width: int, height: int) -> int:
        """Pads for an image: its resized patch grid over the merge window."""
        factor = self.patch * self.merge
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"the image's aspect ratio must be below 200, got {width}x{height}")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return (h // self.patch) * (w // self.patch) // (self.merge * self.merge)

    def replacement(self, width: int, height: int) -> str:
        return self.image_token * self.tokens(width, height)


ImageLayout = Idefics3Layout | Qwen2VLLayout
LAYOUTS: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], ImageLayout]] = {
    "idefics3": Idefics3Layout,
    "Idefics3ImageProcessor": Idefics3Layout,
    "Qwen2VLImageProcessor": Qwen2VLLayout,
    "Qwen2VLImageProcessorFast": Qwen2VLLayout,
    "qwen2_vl": Qwen2VLLayout,
    "qwen2_5_vl": Qwen2VLLayout,
}


def load_layout(model_dir: str) -> ImageLayout | None:
    """The image layout of the model in ``model_dir`` (None: not a vision-language model kvroute knows)."""

    def read(name: str) -> dict[str, Any]:
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    image_config = read("preprocessor_config.json")
    if not image_config:
        return None
    model_type = read("config.json").get("model_type")
    make = LAYOUTS.get(str(image_config.get("image_processor_type"))) or LAYOUTS.get(str(model_type))
    return make(image_config, read("processor_config.json")) if make is not None else None


# -- a request's images in its token ids


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One image's token run in the prompt: where it starts, how long it is, and its identity."""

    offset: int
    length: int
    identifier: str


@dataclass(frozen=True, slots=True)
class ImageOptions:
    """How a router or engine keys images (flags): the model id and digest vLLM hashes them with
    (None: the engines' ``root`` in ``/v1/models``), and bounds on an image and on fetching one."""

    model_id: str | None = None
    algorithm: str = "blake3"
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout: float = 10.0


@dataclass(slots=True)
class ImageContext:
    """What resolving a request's images needs: the model's layout and id, the digest vLLM uses,
    and the bytes of the request's remote images (fetched on the event loop before tokenizing)."""

    layout: ImageLayout
    model_id: str
    algorithm: str = "blake3"
    fetched: Mapping[str, bytes] | None = None
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def image_bytes(self, ref: ImageRef) -> bytes:
        url = ref.url
        if url is None:
            raise ImageNotKeyable("an image given by uuid alone")
        if url.startswith("data:"):
            return data_url_bytes(url, self.max_bytes)
        if ref.remote:
            data = (self.fetched or {}).get(url)
            if data is None:
                raise ImageError(f"the image at {url} was not fetched")
            return data
        raise ImageNotKeyable(f"an image at {url.split(':', 1)[0]}: URL")


def expand_images(
    tokens: Sequence[int],
    image_token_id: int,
    images: Sequence[ImageRef],
    ctx: ImageContext,
    encode: Callable[[str], list[int]],
) -> tuple[list[int], list[Placeholder]]:
    """``tokens`` with the i-th ``image_token_id`` replaced by the i-th image's token run, and where
    each run lies. ``encode`` tokenizes a replacement text without special tokens."""
    out: list[int] = []
    placeholders: list[Placeholder] = []
    start = 0
    for ref in images:
        try:
            at = tokens.index(image_token_id, start)
        except ValueError:
            raise ImageError("the chat template did not render a placeholder for every image") from None
        out.extend(tokens[start:at])
        data = ctx.image_bytes(ref)
        info = inspect_image(data)
        identifier = ref.uuid or vllm_image_identifier(data, info.converted, ctx.model_id, ctx.algorithm)
        run = encode(ctx.layout.replacement(info.width, info.height))
        placeholders.append(Placeholder(len(out), len(run), identifier))
        out.extend(run)
        start = at + 1
    out.extend(tokens[start:])
    return out, placeholders


def block_mm_hashes(placeholders: Sequence[Placeholder], n_tokens: int, block_size: int) -> list[list[int] | None]:
    """Per full block, the u64 of each image identifier whose token run overlaps the block (vLLM's
    rule: a block ``[s, e)`` holds an image at ``[o, o + n)`` when ``e > o`` and ``s < o + n``)."""
    n_blocks = n_tokens // block_size
    out: list[list[int] | None] = [None] * n_blocks
    for p in placeholders:
        key = mm_object_hash(p.identifier)
        first = p.offset // block_size
        last = min(n_blocks - 1, (p.offset + p.length - 1) // block_size)
        for b in range(first, last + 1):
            slot = out[b]
            if slot is None:
                out[b] = [key]
            else:
                slot.append(key)
    return out


def block_extra_keys(placeholders: Sequence[Placeholder], block: int, block_size: int) -> list[list[Any]] | None:
    """A block's multimodal entry in vLLM's ``BlockStored.extra_keys``: ``[identifier, offset]`` for each
    image overlapping it, the offset being where the image starts relative to the block (negative for
    an image that began in an earlier block)."""
    start, end = block * block_size, (block + 1) * block_size
    keys = [[p.identifier, p.offset - start] for p in placeholders if end > p.offset and start < p.offset + p.length]
    return keys or None
