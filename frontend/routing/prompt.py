"""A request body to the prompt the router routes: its token ids and their block hashes.

Both are computed together, inline for short prompts and on a tokenizer thread for long ones
(``kvroute_common.tokenize_offload``): the block and sequence hashes of a long prompt cost as much as
its tokenization, so they are never computed on the event loop either. A prompt longer than the
model's workers accept is refused here, before anything is hashed or booked (on the thread, before
its ids are even built).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from frontend.request.errors import OpenAIError
from frontend.request.validation import PromptLimit, check_context_length, check_prompt_fits
from kvroute_common import anthropic_api
from kvroute_common.hashing import local_block_hashes, sequence_hashes, token_array
from kvroute_common.multimodal import ImageContext, Placeholder, block_mm_hashes, image_parts, remote_image_urls

MEMO_MAX_CHARS = 256 * 1024
"""Text prompts of at most this many characters go through the turn memo (``frontend/routing/turn_memo.py``)."""
IDS_BODY_INLINE_MAX = 32768
"""A prompt sent to its engine as more ids than this has that body written on the tokenizer thread
(``engine_body``), in slices: writing ids costs ~11 ns each, a 128 k-token prompt's 1.4 ms of loop in one call."""
IDS_SLICE = 8192  # ids written per call on the thread: the loop can take the GIL between two (~0.1 ms each)
COUNTED_MAX = 4
"""A prompt with more text than the offload threshold and no remembered turn it continues is counted by its
chunks the cache lacks (and encoded on the loop if they are few) only up to this many times the threshold;
past it, it goes to the worker thread uncounted: its whole-prompt ids and hashes (~50 ns a token) and the
count itself (~1 us a 100 characters) would grow on the loop with it. A turn that continues a remembered one
is counted at any length (what follows it). A chat-shaped request (chat, responses, Messages) up to this
bound is rendered on the loop (~0.1 ms) to be counted so (chunk cuts depend on the text before them, so the
messages' own chunks are not the prompt's)."""

if TYPE_CHECKING:
    from frontend.request.hints import RequestHints
    from frontend.routing.images import ImageCache
    from frontend.routing.models import ModelEntry
    from frontend.routing.turn_memo import Turn, TurnMemo
    from kvroute_common.tokenize_offload import TokenizeOffload
    from kvroute_common.tokenizer import PromptEncoder, RenderedChat


class Prompt:
    """Token ids and (for routing) their local block hashes and chained sequence hashes. A long
    prompt's ids are a compact ``array('I')`` (built and its list freed on the tokenizer thread: a
    list of 128 k ints takes ~1 ms to free, wherever the last reference goes), and its local hashes
    are also kept as a u64 array (``local_array``, built there too: what a remote index is sent). So
    are a remembered conversation's (``frontend.routing.turn_memo``)."""

    __slots__ = ("tokens", "local_hashes", "seq_hashes", "salt", "local_array")

    def __init__(
        self,
        tokens: Sequence[int],
        local_hashes: list[int] | None = None,
        seq_hashes: list[int] | None = None,
        salt: str | None = None,
    ) -> None:
        self.tokens = tokens
        self.local_hashes = local_hashes
        self.seq_hashes = seq_hashes
        self.salt = salt  # the cache salt the hashes were computed with
        self.local_array: np.ndarray | None = None

    @property
    def hashes(self) -> tuple[list[int], list[int]] | None:
        if self.local_hashes is None or self.seq_hashes is None:
            return None
        return self.local_hashes, self.seq_hashes


def hashed(entry: ModelEntry, tokens: Sequence[int], salt: str | None, images: Sequence[Placeholder] = ()) -> Prompt:
    """``tokens`` with the block hashes the router looks up and books (the model's block size and
    LoRA adapter, the request's cache salt, and the identity of each image in the blocks it spans)."""
    bs = entry.block_size
    mm = block_mm_hashes(images, len(tokens), bs) if images else None
    local = local_block_hashes(tokens, bs, entry.lora_name, salt, mm)
    return Prompt(tokens, local, sequence_hashes(local), salt)


# completions fields whose meaning depends on the prompt's text: such requests keep it
_TEXT_FIELDS = ("echo", "prompt_logprobs", "suffix", "add_special_tokens", "prompt_embeds")


def engine_token_ids(body: dict, prompt: Prompt, hints: RequestHints | None) -> Sequence[int] | None:
    """What a completions request sends the engine as its prompt instead of its text
    (``--send-token-ids``): the ids the router computed for routing, the engine's own tokens, so the
    engine skips tokenizing them again (a long prompt's body is written on the thread: ``engine_body``).
    None keeps the text: a prompt that was already ids, a request whose fields read the text, or one whose
    next turn is prefilled speculatively (that builds on the text)."""
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        return None
    if any(k in body for k in _TEXT_FIELDS):
        return None
    if hints is not None and (hints.speculative_prefill or hints.token_data):
        return None
    return prompt.tokens


def takes_prompt_ids(mode: str, worker: Any) -> bool:
    """Whether ``worker`` gets a completions prompt as the router's ids (``--send-token-ids``): always, never,
    or (auto) where the engine turned the probe completion into the router's ids when it joined
    (``frontend.pool.render_parity``): an engine with another tokenizer would compute another prompt."""
    return mode == "always" or (mode == "auto" and worker.prompt_ids_proven)


def with_prompt_ids(body: bytes, ids: Sequence[int]) -> bytes:
    """A completions request as it goes out (``body``), with ``ids`` as its prompt. A u32 array is
    written from its memory (a numpy view of it), never through an int object per id; one longer than
    ``IDS_SLICE`` in slices, each its own call (the GIL can change hands between two)."""
    doc = orjson.loads(body)
    if not isinstance(ids, array):
        doc["prompt"] = ids
        return orjson.dumps(doc)
    view = np.frombuffer(ids, dtype=np.uint32)
    if len(view) <= IDS_SLICE:
        doc["prompt"] = view
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    numpy = orjson.OPT_SERIALIZE_NUMPY
    slices = [orjson.dumps(view[i : i + IDS_SLICE], option=numpy)[1:-1] for i in range(0, len(view), IDS_SLICE)]
    doc["prompt"] = orjson.Fragment(b"[" + b",".join(slices) + b"]")  # written as it is
    return orjson.dumps(doc)


def engine_body(body: bytes, ids: Sequence[int], nogil: bool = False) -> bytes:
    """``with_prompt_ids`` for ``TokenizeOffload.run`` (which passes ``nogil``): a long prompt's body, written
    on the tokenizer thread."""
    return with_prompt_ids(body, ids if isinstance(ids, array) else token_array(ids))


async def ids_body_off_loop(offload: TokenizeOffload, body: bytes, ids: Sequence[int]) -> bytes | None:
    """The body with ``ids`` as its prompt, written on the tokenizer thread, when there are more than
    ``IDS_BODY_INLINE_MAX`` (else None: ``with_prompt_ids`` on the loop when a worker takes them)."""
    if len(ids) <= IDS_BODY_INLINE_MAX:
        return None
    return await offload.run(len(ids) * 4, engine_body, body, ids)


def body_tokens(
    entry: ModelEntry, body: dict, chat: bool, nogil: bool = False, limit: PromptLimit | None = None
) -> list[int]:
    """The engine's prompt tokens (images keyed as text), see :func:`body_prompt`."""
    return body_prompt(entry, body, chat, None, nogil, limit)[0]


def body_prompt(
    entry: ModelEntry,
    body: dict,
    chat: bool,
    images: ImageContext | None,
    nogil: bool = False,
    limit: PromptLimit | None = None,
    rendered: RenderedChat | None = None,
) -> tuple[list[int], list[Placeholder]]:
    """The engine's prompt tokens, each image expanded to its token run (``images``: how this model
    keys them; None routes image parts as text), and where the images lie, checked against what the
    most capable worker takes (``limit``: its context length, as vLLM checks it, and its KV capacity).
    ``rendered``: a chat body already rendered with ``images`` (:func:`_rendered_chat`).

    ``nogil``: running on a worker thread (kvroute_common.tokenize_offload); there the over-long
    prompt is refused before its ids are built and a long id list is freed on the thread, never on
    the loop."""
    from kvroute_common.tokenizer import PromptError, PromptTooLong, chat_request_prompt, completion_prompt_token_ids

    stop_at = limit.tokens if (nogil and limit is not None) else None
    placeholders: list[Placeholder] = []
    try:
        if chat:
            _check_messages(body)
            # every template argument the engine honours (chat_template_kwargs, add_generation_prompt,
            # continue_final_message, tools, documents): the router must hash the engine's tokens
            tokens, placeholders = chat_request_prompt(entry.tokenizer, body, images, nogil, stop_at, rendered)
        else:
            if "prompt" not in body:
                raise OpenAIError(400, "'prompt' is required", "prompt")
            tokens = completion_prompt_token_ids(entry.tokenizer, body["prompt"], nogil=nogil, limit=stop_at)
    except PromptTooLong as exc:
        check_prompt_fits(exc.n_tokens, body, limit, chat, exc.exact)
        raise OpenAIError(400, str(exc)) from None  # pragma: no cover - the check above raises
    except PromptError as exc:
        raise OpenAIError(400, str(exc)) from None
    check_prompt_fits(len(tokens), body, limit, chat)
    return tokens, placeholders


def embedding_tokens(entry: ModelEntry, body: dict, nogil: bool = False, limit: PromptLimit | None = None) -> list[int]:
    """All inputs' tokens, concatenated (for load accounting; embeddings are routed by load)."""
    from kvroute_common.tokenizer import PromptError, completion_prompt_token_ids

    inp = body.get("input")
    if isinstance(inp, str) or (isinstance(inp, list) and inp and all(type(t) is int for t in inp)):
        items = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(t, (str, list)) for t in inp):
        items = inp
    else:
        raise OpenAIError(
            400,
            "'input' must be a non-empty string, list of strings, list of token ids or list of token-id lists",
            "input",
        )
    out: list[int] = []
    try:
        for item in items:
            ids = completion_prompt_token_ids(entry.tokenizer, item, nogil=nogil)
            check_context_length(len(ids), {}, limit.context if limit is not None else None, False)
            out += ids
    except PromptError as exc:
        raise OpenAIError(400, str(exc), "input") from None
    return out


async def tokenize_request(
    offload: TokenizeOffload,
    entry: ModelEntry,
    body: dict,
    kind: str | bool,
    salt: str | None = None,
    image_cache: ImageCache | None = None,
) -> Prompt:
    """The request's tokens and block hashes: inline for short prompts, on a worker thread above the
    offload threshold (hashes with the cache ``salt``; embeddings get none, they are routed by load).
    A chat request's images are keyed as the engine keys them when the model's layout is known; their
    number is capped and its remote images are fetched first, under the media fetch policy (``image_cache``).

    ``kind``: chat | completions | responses | messages | embeddings (a bool means chat / completions)."""
    from kvroute_common.openai_api import responses_to_chat
    from kvroute_common.tokenize_offload import prompt_chars

    if isinstance(kind, bool):
        kind = "chat" if kind else "completions"
    chars = prompt_chars(body)
    long = offload.offloads(chars)  # long enough to matter: count only what the tokenizer's caches lack
    turn_text = None  # a text prompt the turn memo takes, with the remembered turn it continues
    before: Turn | None = None
    if kind == "completions":
        text = _text_prompt(body.get("prompt")) if long else None
        if text is not None and len(text) <= MEMO_MAX_CHARS:
            chars, before = _new_text_chars(entry, text, salt, True, COUNTED_MAX * offload.threshold_chars)
            turn_text = text if entry.turns.usable(text, MEMO_MAX_CHARS) else None
    elif kind == "embeddings":
        if long:
            chars = _new_input_chars(entry, body.get("input"), chars)
        tokens = await offload.run(chars, embedding_tokens, entry, body, limit=entry.prompt_limit())
        return Prompt(tokens)
    if kind == "responses":
        body = responses_to_chat(body)
    elif kind == "messages":
        body = messages_to_chat(entry, body)
    images = entry.image_context() if kind != "completions" else None
    image_bytes = 0
    if images is not None and image_cache is not None:
        n_images = sum(1 for _ in image_parts(body))
        if n_images:
            image_cache.check_count(n_images)  # before anything is fetched or decoded
            urls = remote_image_urls(body)
            if urls:
                images.fetched = await image_cache.fetch_all(urls, entry.image_options, n_images)
                image_bytes = sum(len(data) for data in images.fetched.values())  # decoded and hashed with the prompt
    rendered = None
    counted_max = COUNTED_MAX * offload.threshold_chars
    if kind != "completions" and long and chars <= counted_max:
        rendered = _rendered_chat(entry, body, images)
        chars, before = _new_text_chars(entry, rendered.text, salt, False, counted_max)
        if not rendered.images and entry.turns.usable(rendered.text, MEMO_MAX_CHARS):
            turn_text = rendered.text
    if turn_text is not None:  # through the memo from the turn found here (new text past the threshold: on the thread)
        memo = entry.turns
        chat = kind != "completions"
        turn, prompt = await offload.run(
            chars, _encode_turn, memo, body, turn_text, salt, before, chat, limit=entry.prompt_limit()
        )
        memo.keep(turn, before)
        return prompt
    return await offload.run(
        chars + image_bytes,
        _tokens_and_hashes,
        entry,
        body,
        kind != "completions",
        salt,
        images,
        rendered,
        limit=entry.prompt_limit(),
    )


def _encoder(entry: ModelEntry) -> PromptEncoder:
    from kvroute_common.tokenizer import prompt_encoder

    return prompt_encoder(entry.tokenizer)


def _check_messages(body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", "messages")


def _rendered_chat(entry: ModelEntry, body: dict, images: ImageContext | None) -> RenderedChat:
    """A chat body rendered as :func:`body_prompt` renders it, here on the loop: what is counted is the text
    the encode sees."""
    from kvroute_common.tokenizer import PromptError, render_chat_request

    _check_messages(body)
    try:
        return render_chat_request(entry.tokenizer, body, images)
    except PromptError as exc:
        raise OpenAIError(400, str(exc)) from None


def _new_text_chars(
    entry: ModelEntry, text: str, salt: str | None, specials: bool, counted_max: int
) -> tuple[int, Turn | None]:
    """What follows the remembered prompt ``text`` continues (``specials``: a completion's, else a rendered
    chat's) and that prompt; else the chunks of ``text`` the cache does not hold (all of it past
    ``counted_max`` characters: ``COUNTED_MAX``) and None."""
    memo = entry.turns
    if memo.usable(text, MEMO_MAX_CHARS):
        before = memo.find(text, salt, specials)
        if before is not None:
            return memo.chars_after(before, text), before
    if len(text) > counted_max:
        return len(text), None
    return _encoder(entry).new_chars(text), None


def _new_input_chars(entry: ModelEntry, inp: object, chars: int) -> int:
    """An embeddings request's text inputs' chunks the cache does not hold (each input is encoded alone), or
    ``chars`` when they are too long to scan."""
    if chars > MEMO_MAX_CHARS:
        return chars
    texts = [inp] if isinstance(inp, str) else inp if isinstance(inp, list) else []
    encoder = _encoder(entry)
    return sum(encoder.new_chars(t) for t in texts if isinstance(t, str))


def _text_prompt(prompt: object) -> str | None:
    """A completions ``prompt`` that is one text (alone or a batch of one), else None."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


async def hash_tokens(offload: TokenizeOffload, entry: ModelEntry, tokens: list[int], salt: str | None) -> Prompt:
    """Given token ids (``nvext.token_data``) with their hashes, on a thread when there are many."""
    return await offload.run(len(tokens) * 4, _hashed, entry, tokens, salt)


def _hashed(entry: ModelEntry, tokens: list[int], salt: str | None, nogil: bool = False) -> Prompt:
    return hashed(entry, tokens, salt)


def _tokens_and_hashes(
    entry: ModelEntry,
    body: dict,
    chat: bool,
    salt: str | None,
    images: ImageContext | None,
    rendered: RenderedChat | None = None,
    nogil: bool = False,
    limit: PromptLimit | None = None,
) -> Prompt:
    if not nogil and not chat:
        text = _text_prompt(body.get("prompt"))
        if text is not None and entry.turns.usable(text, MEMO_MAX_CHARS):
            return _continued_turn(entry, body, text, salt, limit, False)
    elif not nogil:  # a conversation's rendered prompt, images aside, through the memo too
        rendered = rendered or _rendered_chat(entry, body, images)
        if not rendered.images and entry.turns.usable(rendered.text, MEMO_MAX_CHARS):
            return _continued_turn(entry, body, rendered.text, salt, limit, True)
    tokens, placeholders = body_prompt(entry, body, chat, images, nogil, limit, rendered)
    if nogil:  # on the tokenizer thread: compact ids, the list freed here
        prompt = hashed(entry, token_array(tokens), salt, placeholders)
        prompt.local_array = np.asarray(prompt.local_hashes, dtype=np.uint64)
        return prompt
    return hashed(entry, tokens, salt, placeholders)


def _encode_turn(
    memo: TurnMemo,
    body: dict,
    text: str,
    salt: str | None,
    before: Turn | None,
    chat: bool,
    nogil: bool = False,
    limit: PromptLimit | None = None,
) -> tuple[Turn, Prompt]:
    """``_continued_turn`` from the turn ``before`` it (found on the loop), for ``TokenizeOffload.run``: the turn
    is built here and kept by the loop (``TurnMemo.keep``); on a thread its local hashes as a u64 array too."""
    from kvroute_common.tokenizer import PromptError

    try:
        turn = memo.encode(text, salt, not chat, before, nogil)
    except PromptError as exc:
        raise OpenAIError(400, str(exc)) from None
    ids, local, seq = turn.prompt
    check_prompt_fits(len(ids), body, limit, chat)
    prompt = Prompt(ids, local, seq, salt)
    if nogil:
        prompt.local_array = np.asarray(local, dtype=np.uint64)
    return turn, prompt


def _continued_turn(
    entry: ModelEntry, body: dict, text: str, salt: str | None, limit: PromptLimit | None, chat: bool
) -> Prompt:
    """A completions text prompt or a rendered chat prompt (``chat``: no special tokens added) through the
    model's turn memo (``frontend/routing/turn_memo.py``): what a remembered earlier prompt already holds
    is not tokenized or hashed again."""
    from kvroute_common.tokenizer import PromptError

    try:
        turn = entry.turns.prompt(text, salt, specials=not chat)
    except PromptError as exc:
        raise OpenAIError(400, str(exc)) from None
    check_prompt_fits(len(turn.ids), body, limit, chat)
    return Prompt(turn.ids, turn.local_hashes, turn.seq_hashes, salt)


def tokenize_request_sync(entry: ModelEntry, body: dict, kind: str) -> list[int]:
    """A short request's tokens on the calling thread (chat | completions | messages), no length check."""
    if kind == "messages":
        body = messages_to_chat(entry, body)
    return body_tokens(entry, body, kind != "completions")


def messages_to_chat(entry: ModelEntry, body: dict) -> dict:
    """An Anthropic Messages request as the chat request the engine renders (its template decides
    whether inline system messages are merged into the leading one)."""
    template = anthropic_api.tokenizer_template(entry.tokenizer)
    return anthropic_api.to_chat(body, anthropic_api.requires_system_first(template))
