"""Tokenisation shared by the frontend and the mocker, so both always see the same token ids.

* ``load_tokenizer(None)`` loads the built-in offline tokenizer (``tokenizer_data/``, built by
  ``python -m kvroute_common.build_tokenizer``); a directory loads that HF tokenizer. Never downloads.
* ``chat_request_token_ids(tok, body)`` (an OpenAI chat body: messages + the template arguments
  vLLM takes from it), ``chat_prompt_token_ids`` / ``completion_prompt_token_ids`` tokenise the
  way vLLM does: chat =
  render the chat template with ``add_generation_prompt=True`` to text, then encode WITHOUT special
  tokens (the template carries BOS); completion text = encode WITH special tokens; token-id prompts
  pass through.

Speed: HF ``tokenizers`` needs ~6-8 ms for 32 KB of text on this machine, far above the frontend's
2 ms routing budget. ``PromptEncoder`` gives the same ids faster for tokenizers whose pre-tokeniser is
one regex split + byte-level mapping (the built-in one, GPT-2's, Llama-3's, Qwen2's): it splits off
special tokens and pre-tokenises with Python's ``re`` where the pattern means the same there as in the
tokenizers' Oniguruma (the built-in one), then maps each piece through a cache of piece -> ids; an unseen
piece gets the tokenizer's own BPE model's merges on its byte-level characters. A pattern with Unicode
classes (``\\p{L}``, ``\\s``: Llama-3's, Qwen2's) is compiled with the ``regex`` module and used only on
ASCII text (``ascii_only``), where its classes and Oniguruma's agree (tests/test_text_chunks.py checks every
ASCII character against the tokenizer's own pre-tokenizer); other text goes to the backend, whose Unicode
tables may be of another version. Whole segments between special tokens (e.g. a long system prompt) are
cached too. Any other tokenizer goes straight to its backend encode.

Both paths reuse earlier prompts: a long text is cut where the pre-tokenizer is sure to split and each
chunk's ids are cached (``kvroute_common/text_chunks.py``), so each turn of a multi-turn session encodes
only what it added to the history (issue 28). Tokenizers without a known safe cut are encoded whole.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from kvroute_common.multimodal import (
    IMAGE_PART,
    UNKEYED_PARTS,
    ImageContext,
    ImageError,
    ImageLayout,
    ImageNotKeyable,
    ImageRef,
    Placeholder,
    expand_images,
    image_ref,
)
from kvroute_common.text_chunks import ChunkCache, chunk_ends, cut_rule

DEFAULT_MODEL_NAME = "kvroute-demo"
BUILTIN_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_data")

# transformers prints a PyTorch warning at import; kvroute only uses its tokenizers
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


EARLY_STOP_CHARS = 262_144  # piece size when counting an obviously over-long text
EARLY_STOP_MARGIN = 4  # tokens a cut between pieces may add or remove


class PromptError(ValueError):
    """The prompt or messages cannot be tokenised (maps to an OpenAI 400 error)."""


class PromptTooLong(PromptError):
    """The prompt has ``n_tokens`` >= the ``limit`` it was encoded against (its ids were never built).
    ``exact=False``: counting stopped once the answer was known, ``n_tokens`` is a lower bound."""

    def __init__(self, n_tokens: int, limit: int, exact: bool = True) -> None:
        at_least = "" if exact else "at least "
        super().__init__(f"the prompt has {at_least}{n_tokens} tokens, the limit is {limit}")
        self.n_tokens = n_tokens
        self.limit = limit
        self.exact = exact


_tokenizers: dict[str | None, Any] = {}
_tokenizers_lock = threading.Lock()
_layouts: dict[int, Any] = {}  # id(tokenizer) -> its model's image layout (kvroute_common.multimodal)


def image_layout(tokenizer) -> ImageLayout | None:
    """The image placeholder layout of the model whose tokenizer this is (None: text only)."""
    return _layouts.get(id(tokenizer))


def load_tokenizer(model_path: str | None = None):
    """A transformers fast tokenizer; ``None`` = the built-in offline one. Cached per path.

    Local directories are always read with ``local_files_only=True`` (no network, like
    ``HF_HUB_OFFLINE=1``); anything else is handed to transformers as a hub id, which honours
    ``HF_HUB_OFFLINE`` itself. Loads are serialised: transformers imports its tokenizer classes
    lazily, and two threads importing them at once can fail in one of them (the frontend loads
    tokenizers on worker threads).
    """
    tok = _tokenizers.get(model_path)
    if tok is None:
        with _tokenizers_lock:
            tok = _tokenizers.get(model_path)
            if tok is None:
                tok = _tokenizers[model_path] = _load_tokenizer(model_path)
    return tok


def _load_tokenizer(model_path: str | None):
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    path = model_path or BUILTIN_TOKENIZER_DIR
    local = os.path.isdir(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=local or model_path is None)
    if not getattr(tok, "is_fast", False):
        raise PromptError(f"tokenizer at {path!r} is not a fast (tokenizers-backed) tokenizer")
    from kvroute_common.multimodal import load_layout

    _layouts[id(tok)] = load_layout(path) if local else None
    # The encoder's set-up parses the whole tokenizer spec (tens of ms for a large vocabulary): done
    # here, where the tokenizer is loaded, instead of on the first request.
    prompt_encoder(tok)
    # So is the chat template's first render (it compiles the template: 5-27 ms on this machine),
    # which the first (short, inline) chat request would otherwise pay on the event loop.
    if getattr(tok, "chat_template", None):
        try:
            render_chat_prompt(tok, [{"role": "user", "content": "warm"}])
        except PromptError:  # a template that refuses this conversation renders on the first request
            pass
    return tok


# ---------------------------------------------------------------------------------------------
# chat template rendering (vLLM semantics)

_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+(?:message|msg|m)\s*(?:\[\s*['\"]content['\"]\s*\]|\.content)")


@lru_cache(maxsize=64)
def _template_loops_over_content(template: str) -> bool:
    """vLLM's "openai" content format: the template iterates over content parts itself."""
    return bool(_CONTENT_LOOP.search(template))


def _normalise_messages(
    messages: Sequence[Mapping[str, Any]], keep_parts: bool, image_placeholder: str | None = None
) -> tuple[list[dict], list[ImageRef]]:
    """OpenAI messages -> template input, and the images in prompt order.

    Text parts are joined with '\\n' for string-format templates, as vLLM does; other fields (name,
    tool_calls, ...) pass through. With an ``image_placeholder`` (the model's layout is known) an
    image part becomes ``{"type": "image"}`` for templates that loop over parts, or the placeholder
    text in front of the message's text for string templates (vLLM's two content formats); without
    one, and for audio and video parts, the part is left out: the request is routed on its text."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise PromptError("messages must be a non-empty list")
    out = []
    images: list[ImageRef] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise PromptError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise PromptError(f"messages[{i}].role must be a non-empty string")
        content = msg.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            texts: list[str] = []
            n_images = 0
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if not isinstance(kind, str):
                    raise PromptError(f"messages[{i}].content[{j}].type must be a string")
                if kind in ("text", "input_text"):
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise PromptError(f"messages[{i}].content[{j}].text must be a string")
                    texts.append(text)
                    parts.append({"type": "text", "text": text})
                elif kind == IMAGE_PART or kind in UNKEYED_PARTS:
                    if kind != IMAGE_PART or image_placeholder is None:
                        _warn_unkeyed(str(kind))
                        continue
                    images.append(image_ref(part, f"messages[{i}].content[{j}]"))
                    parts.append({"type": "image"})
                    n_images += 1
                else:
                    raise PromptError(f"messages[{i}].content[{j}]: unsupported content part type {kind!r}")
            if keep_parts:
                content = parts
            else:
                text = "\n".join(texts)
                content = text
                if image_placeholder and n_images > text.count(image_placeholder):
                    missing = [image_placeholder] * (n_images - text.count(image_placeholder))
                    content = "\n".join(missing + ([text] if text else []))
        elif content is not None and not isinstance(content, str):
            raise PromptError(f"messages[{i}].content must be a string, a list of parts or null")
        m = dict(msg)
        m["content"] = content
        out.append(m)
    return out, images


_warned_parts: set[str] = set()


def _warn_unkeyed(kind: str) -> None:
    """Once per kind: media the router does not key is routed on the request's text alone."""
    if kind not in _warned_parts:
        _warned_parts.add(kind)
        import logging

        logging.getLogger(__name__).warning(
            "requests with %s are routed on their text only (kvroute keys images of the model families in "
            "docs/multimodal.md; audio and video are not keyed)",
            kind if " " in kind else f"content parts of type {kind!r}",
        )


def render_chat_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
    """The chat template rendered to text (``add_generation_prompt=True`` unless overridden); image
    parts are left out (see :func:`render_chat`)."""
    return render_chat(tokenizer, messages, None, **template_kwargs)[0]


def render_chat(
    tokenizer, messages: Sequence[Mapping[str, Any]], image_placeholder: str | None, **template_kwargs: Any
) -> tuple[str, list[ImageRef]]:
    """The chat template rendered to text, and the request's images in the order their placeholders
    appear (``image_placeholder``: the model's; None renders the text alone).

    ``template_kwargs`` go to ``apply_chat_template``: ``tools``, ``documents``, ``chat_template``,
    ``continue_final_message``, ``add_generation_prompt`` and any template variable (vLLM's
    ``chat_template_kwargs``). transformers caches the compiled template.
    """
    template = template_kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not template:
        raise PromptError("the tokenizer has no chat template; use /v1/completions")
    if isinstance(template, dict):  # named templates: vLLM uses "default" (or tool_use with tools)
        template = template.get("default") or next(iter(template.values()))
        template_kwargs["chat_template"] = template
    try:
        conv, images = _normalise_messages(messages, _template_loops_over_content(template), image_placeholder)
    except ImageError as exc:
        raise PromptError(str(exc)) from None
    template_kwargs.setdefault("add_generation_prompt", True)
    if template_kwargs.get("continue_final_message"):
        template_kwargs["add_generation_prompt"] = False
    try:
        return tokenizer.apply_chat_template(conv, tokenize=False, **template_kwargs), images
    except PromptError:
        raise
    except Exception as exc:  # jinja errors, raise_exception() in the template
        raise PromptError(f"chat template error: {exc}") from exc


def chat_prompt_token_ids(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    nogil: bool = False,
    limit: int | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of a text chat request exactly as vLLM computes them (render, encode w/o specials).

    ``nogil=True`` (worker threads): encode with the backend call that releases the GIL; ``limit``:
    raise PromptTooLong instead of building the ids of a prompt with that many tokens or more."""
    return chat_prompt(tokenizer, messages, None, nogil=nogil, limit=limit, **template_kwargs)[0]


class RenderedChat(NamedTuple):
    """A chat request rendered by its template: the text, and its images in the order their
    placeholders appear in it."""

    text: str
    images: list[ImageRef]


def chat_prompt(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    images: ImageContext | None,
    *,
    nogil: bool = False,
    limit: int | None = None,
    rendered: RenderedChat | None = None,
    **template_kwargs: Any,
) -> tuple[list[int], list[Placeholder]]:
    """Token ids of a chat request as the engine runs them, with each image's placeholder expanded
    to its token run (``images``: the model's layout and id; None routes image parts as text), and
    where each image's run lies. ``rendered``: the messages already rendered with ``images``' placeholder."""
    placeholder = images.layout.placeholder_text if images is not None else None
    text, refs = rendered if rendered is not None else render_chat(tokenizer, messages, placeholder, **template_kwargs)
    encoder = prompt_encoder(tokenizer)
    tokens = encoder.encode(text, add_special_tokens=False, nogil=nogil, limit=limit)
    if not refs or images is None:
        return tokens, []
    image_token = tokenizer.convert_tokens_to_ids(images.layout.image_token)
    try:
        return expand_images(tokens, image_token, refs, images, encoder.encode_cached)
    except ImageError as exc:
        raise PromptError(str(exc)) from None
    except ImageNotKeyable as exc:
        _warn_unkeyed(str(exc))
        return chat_prompt(tokenizer, messages, None, nogil=nogil, limit=limit, **template_kwargs)


_UNSET = (None, "auto")  # explicit request fields with these values leave chat_template_kwargs' value


def chat_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-template arguments vLLM (0.32) derives from an OpenAI chat request body.

    ``chat_template_kwargs``, overridden by the explicit fields ``add_generation_prompt`` (default
    true), ``continue_final_message`` (default false), ``documents`` and ``reasoning_effort`` unless
    they are null or ``"auto"``; a ``reasoning_effort`` also sets ``enable_thinking`` (``!= "none"``) unless the
    request's kwargs set it. ``tools`` whenever the request has them (also with ``tool_choice``
    ``"none"``), each as vLLM's request model dumps it; the request's ``chat_template``.
    """
    kwargs: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise PromptError("chat_template_kwargs must be an object")
        kwargs.update(extra)
    for name in ("add_generation_prompt", "continue_final_message"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise PromptError(f"{name} must be a boolean")
    explicit: dict[str, Any] = {
        # vLLM's request defaults when absent (they then override chat_template_kwargs too)
        "add_generation_prompt": True if body.get("add_generation_prompt") is None else body["add_generation_prompt"],
        "continue_final_message": bool(body.get("continue_final_message")),
        "documents": body.get("documents"),
    }
    effort = body.get("reasoning_effort")
    explicit["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in kwargs:
        explicit["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in explicit.items() if v not in _UNSET})
    tools = body.get("tools")
    if tools is not None:
        kwargs["tools"] = engine_tool_dicts(tools)
    template = body.get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise PromptError("chat_template must be a string")
        kwargs["chat_template"] = template
    return kwargs


def engine_tool_dicts(tools: Any) -> list[dict[str, Any]]:
    """OpenAI chat ``tools`` as the chat template sees them in vLLM: its request model's dump.

    Each tool is ``{"type", "function": {"name", "description", "parameters"[, "strict"]
    [, "defer_loading"]}[, "defer_loading"]}``: a missing description or parameters is null,
    ``strict`` and ``defer_loading`` appear only when set, other keys are dropped, and a tool-level
    ``defer_loading`` is copied into the function when it has none. Templates that print tools (``tools | tojson``)
    see exactly these; a client's raw tools would render other text.
    """
    if not isinstance(tools, list):
        raise PromptError("tools must be a list")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise PromptError(f"tools.{i}.function.name: a string is required")
        if tool.get("type", "function") != "function":
            raise PromptError(f"tools.{i}.type: only 'function' is supported")
        if not isinstance(fn.get("description"), str | None) or not isinstance(fn.get("parameters"), Mapping | None):
            raise PromptError(f"tools.{i}.function: description must be a string and parameters an object")
        defer = tool.get("defer_loading")
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        if fn.get("strict") is not None:
            function["strict"] = fn["strict"]
        fn_defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
        if fn_defer is not None:
            function["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def chat_request_token_ids(
    tokenizer, body: Mapping[str, Any], nogil: bool = False, limit: int | None = None
) -> list[int]:
    """Token ids of an OpenAI chat request body (messages + vLLM's template arguments), text only."""
    return chat_request_prompt(tokenizer, body, None, nogil, limit)[0]


def chat_request_prompt(
    tokenizer,
    body: Mapping[str, Any],
    images: ImageContext | None,
    nogil: bool = False,
    limit: int | None = None,
    rendered: RenderedChat | None = None,
) -> tuple[list[int], list[Placeholder]]:
    """Token ids of an OpenAI chat request body with its images expanded, and where the images lie
    (``rendered``: the body's :func:`render_chat_request`, when the caller has it)."""
    if "messages" not in body:
        raise PromptError("messages is required")
    kwargs = chat_template_kwargs(body)  # also with ``rendered``: an image that cannot be keyed renders the text again
    return chat_prompt(tokenizer, body["messages"], images, nogil=nogil, limit=limit, rendered=rendered, **kwargs)


def render_chat_request(tokenizer, body: Mapping[str, Any], images: ImageContext | None) -> RenderedChat:
    """An OpenAI chat request body rendered by its template with vLLM's arguments, image parts as the
    placeholder of ``images``' layout (None: text alone), as :func:`chat_request_prompt` renders it."""
    if "messages" not in body:
        raise PromptError("messages is required")
    placeholder = images.layout.placeholder_text if images is not None else None
    return RenderedChat(*render_chat(tokenizer, body["messages"], placeholder, **chat_template_kwargs(body)))


def completion_prompt_token_ids(tokenizer, prompt: Any, nogil: bool = False, limit: int | None = None) -> list[int]:
    """Token ids of a completions ``prompt``: text is encoded with special tokens (as vLLM),
    a token-id list passes through; a batch of exactly one prompt is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt_encoder(tokenizer).encode(prompt, add_special_tokens=True, nogil=nogil, limit=limit)
    if isinstance(prompt, list):
        if not prompt:
            raise PromptError("prompt must not be empty")
        vocab = len(tokenizer)
        if set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab:
            return list(prompt)  # checked at C speed: a router sends every prompt as ids (--send-token-ids)
        for t in prompt:
            if type(t) is not int or t < 0 or t >= vocab:
                if isinstance(t, (str, list)):
                    raise PromptError("batched prompts are not supported; send one prompt per request")
                raise PromptError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        return list(prompt)
    raise PromptError("prompt must be a string or a list of token ids")


# ---------------------------------------------------------------------------------------------
# fast, exact encoding


def _byte_level_table() -> dict[int, str]:
    """Byte (as the code point of a latin-1 character) -> the byte-level alphabet's character: printable
    bytes map to themselves, the others to 256 and up, in byte order (GPT-2's ``bytes_to_unicode``)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()
# every ASCII character, and the runs where split patterns differ (contractions in any case, digit runs,
# punctuation before newlines, whitespace before a word)
_ASCII_SAMPLE = (
    "".join(map(chr, range(128)))
    + " It'S they'LL 'd 1234567 x!\n\n\ty  \n z\r\n\r\n  w \x1c\x1f a\x0b\x0cb ((x)) -- 'quoted' "
)


class ChunkedIds(NamedTuple):
    """A text's ids from its chunks, with where its last chunk starts (``last_start``, a character
    index) and how many of the ids come before that chunk (``ids_before_last``): where the encode of a
    longer text that repeats this one resumes (``PromptEncoder.encode_from``)."""

    ids: list[int]
    last_start: int
    ids_before_last: int


class PromptEncoder:
    """Encodes text to exactly the ids of ``tokenizer.backend_tokenizer.encode`` (see module doc)."""

    PIECE_CACHE_MAX = 400_000
    # Unseen pieces are encoded one by one, holding the GIL: this path runs on the event loop, and the
    # batch call releases the GIL, after which the loop waits for it behind any thread running Python
    # code (--log-loop-stalls caught tiny requests there, 20 ms and more). Through the BPE model's own
    # merges every unseen piece is (1.9 us a piece, against 7.8 in a batch: a new 4 KB system prompt's
    # 800 pieces held the loop 6 ms); through the backend's whole encode (6.5 us a piece), up to this many.
    GIL_HELD_PIECES = 32
    SEGMENT_CACHE_MAX = 256
    SEGMENT_CACHE_MIN_CHARS = 256
    # Texts at least this long are cut into chunks whose ids are cached (kvroute_common/text_chunks.py):
    # a chunk ends at the first safe cut this many characters after its start, so a new turn encodes
    # at most about this much of its history again, and a 16 KB prompt is ~30 cache lookups.
    CHUNK_MIN_CHARS = 512
    # 8 MiB holds ~50 agentic sessions of 4k tokens; a larger cache fills for minutes, which the soak
    # test reads as RSS growth after its warm-up
    CHUNK_CACHE_BYTES = 8 * 1024 * 1024

    def __init__(self, tokenizer) -> None:
        import json

        self.backend = tokenizer.backend_tokenizer
        # ids without offsets, GIL released (tokenizers >= 0.21); encode_batch otherwise
        self._batch_fast = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        self._lock = threading.Lock()
        self._pieces: dict[str, list[int]] = {}
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._repeats: dict[str, list[int]] = {}  # short texts that recur whole (image placeholder runs)
        self.piece_re: Any = None  # a compiled ``re`` (or ``regex``) pattern: its ``findall`` splits pieces
        self.ascii_only = False  # the split pattern is trusted on ASCII text only (other text: the backend)
        self._bpe: Callable[[str], list[Any]] | None = None  # the BPE model's tokenize (see _piece_ids)
        self.special_re: re.Pattern[str] | None = None
        self.special_ids: dict[str, int] = {}
        self.prefix: list[int] = []
        self.suffix: list[int] = []
        self.cuts: re.Pattern[str] | None = None  # where text may be cut into chunks (None: never)
        self.chunks = ChunkCache(self.CHUNK_CACHE_BYTES)
        try:
            spec = json.loads(self.backend.to_str())
        except Exception:  # pragma: no cover - exotic backends
            return
        if not self._find_special_affixes():
            return
        self._setup_fast_path(spec)
        if getattr(self.backend, "truncation", None) is None and getattr(self.backend, "padding", None) is None:
            self.cuts = cut_rule(spec)

    @property
    def fast(self) -> bool:
        return self.piece_re is not None

    def _find_special_affixes(self) -> bool:
        """The ids ``add_special_tokens=True`` puts around a text's (BOS, EOS), from a probe; False when
        the post-processor does something else."""
        probe = "a"
        core = self.backend.encode(probe, add_special_tokens=False).ids
        full = self.backend.encode(probe, add_special_tokens=True).ids
        n = len(core)
        for i in range(len(full) - n + 1):
            if full[i : i + n] == core:
                self.prefix, self.suffix = full[:i], full[i + n :]
                return True
        return False  # pragma: no cover - post-processor we do not understand

    def _setup_fast_path(self, spec: dict[str, Any]) -> None:
        if spec.get("normalizer") is not None:
            return
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            return
        pre = spec.get("pre_tokenizer") or {}
        subs = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not subs or len(subs) != 2:
            return
        split, byte_level = subs
        if (
            split.get("type") != "Split"
            or split.get("behavior") != "Isolated"
            or split.get("invert")
            or "Regex" not in (split.get("pattern") or {})
            or byte_level.get("type") != "ByteLevel"
            or byte_level.get("use_regex")
            or byte_level.get("add_prefix_space")
        ):
            return
        pattern = split["pattern"]["Regex"]
        added = spec.get("added_tokens") or []
        for t in added:
            if t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
                return
        piece_re: Any
        # Python's re where the pattern means the same there as in Oniguruma; else the regex module (Unicode
        # classes, scoped flags), trusted on ASCII text only
        if not re.search(r"\\[pPsSwWdDbBhHRXK]|\(\?[<>!=]*[a-zA-Z]", pattern.replace("(?!", "")):
            try:
                piece_re = re.compile(pattern)
            except re.error:
                return
        else:
            try:
                import regex

                piece_re = regex.compile(pattern)
            except Exception:  # a pattern the regex module does not take: the backend encodes
                return
            self.ascii_only = True
        self.special_ids = {t["content"]: t["id"] for t in added}
        if self.special_ids:
            alts = sorted(self.special_ids, key=len, reverse=True)  # leftmost-longest, like HF
            self.special_re = re.compile("|".join(re.escape(a) for a in alts))
        self.piece_re = piece_re
        tokenize = getattr(getattr(self.backend, "model", None), "tokenize", None)
        if callable(tokenize) and not model.get("byte_fallback"):
            self._bpe = tokenize
        # self-check on a mixed sample and every ASCII character; any disagreement disables the model's own
        # BPE, then the fast path
        samples = ("Hello  world!\n\n  x=42;\t<|im_start|>ünï ☃ code()  \r\n end ", _ASCII_SAMPLE)
        backend = self.backend
        pieces = [p for sample in samples for p in piece_re.findall(sample)]
        if any(self._piece_ids(p) != backend.encode(p, add_special_tokens=False).ids for p in pieces):
            self._bpe = None
        if any(self._encode_fast(t) != backend.encode(t, add_special_tokens=False).ids for t in samples):
            self.piece_re = None
            self.ascii_only = False

    def _pieces_one_pass(self, pieces: list[str]) -> list[int]:
        """The ids of ``pieces`` with one cache lookup each, an unseen piece through the BPE model where it
        first occurs (no set of the pieces and no second lookup: a new turn's ~200 pieces are mostly
        cached)."""
        cache = self._pieces
        get = cache.get
        out: list[int] = []
        added = 0
        for p in pieces:
            ids = get(p)
            if ids is None:
                ids = cache[p] = self._piece_ids(p)  # one dict store: atomic under the GIL
                added += 1
            out += ids
        if added and len(cache) > self.PIECE_CACHE_MAX:
            with self._lock:
                if len(cache) > self.PIECE_CACHE_MAX:
                    cache.clear()
        return out

    def _piece_ids(self, piece: str) -> list[int]:
        """The ids of one pre-tokenized piece with no added token in it: the BPE model's own merges on its
        byte-level characters (a third of a whole ``encode`` call's cost, which also builds offsets and
        word ids), else the backend's encode."""
        bpe = self._bpe
        if bpe is None:
            return self.backend.encode(piece, add_special_tokens=False).ids
        return [t.id for t in bpe(piece.encode("utf-8").decode("latin-1").translate(_BYTE_LEVEL))]

    def encode(
        self, text: str, add_special_tokens: bool = False, nogil: bool = False, limit: int | None = None
    ) -> list[int]:
        """``nogil=True``: one backend ``encode_batch_fast`` call, which releases the GIL for the whole
        encode (``backend.encode`` and our ``re``-based fast path hold it), for worker threads. Texts
        of ``CHUNK_MIN_CHARS`` or more, with a tokenizer whose safe cuts are known, are encoded from
        their chunks' cached ids (``_encode_chunked``), so a prompt repeating a cached history encodes
        only its new tail.
        ``limit`` (nogil path): a prompt of ``limit`` tokens or more raises PromptTooLong before its
        ids are built (building a list of millions of ints holds the GIL for tens of ms)."""
        if not isinstance(text, str):
            raise PromptError("prompt must be a string")
        try:
            if nogil and limit is not None and len(text) > max(EARLY_STOP_CHARS, 2 * limit):
                self._refuse_early(text, limit)
            if self.cuts is not None and len(text) >= self.CHUNK_MIN_CHARS:
                affixes = len(self.prefix) + len(self.suffix) if add_special_tokens else 0
                ids = self._encode_chunked(text, nogil, None if limit is None or not nogil else (limit, affixes)).ids
            elif nogil:
                enc = self._batch_fast([text], add_special_tokens=add_special_tokens)[0]
                if limit is not None and len(enc) >= limit:
                    raise PromptTooLong(len(enc), limit)
                return enc.ids
            elif self.piece_re is None:
                return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            else:
                ids = self._encode_fast(text)
        except PromptError:
            raise
        except Exception as exc:  # e.g. lone surrogates, which the tokenizer cannot encode
            raise PromptError(f"the prompt cannot be tokenized: {exc}") from None
        if add_special_tokens and (self.prefix or self.suffix):
            return self.prefix + ids + self.suffix
        return ids

    def new_chars(self, text: str) -> int:
        """Characters of ``text`` the encode would have to tokenize: the chunks the cache does not hold
        (the whole text where it is not cut into cached chunks). A prompt repeating a session's history
        adds only its new turn: little to encode, where a worker thread would cost more (handing the
        prompt over, hashing under the GIL beside the loop) than it saves."""
        if self.cuts is None or len(text) < self.CHUNK_MIN_CHARS:
            return len(text)
        n = start = 0
        cache = self.chunks
        for end in chunk_ends(text, self.cuts, self.CHUNK_MIN_CHARS):
            if (text[start:end] if start or end < len(text) else text) not in cache:
                n += end - start
            start = end
        return n

    REPEATS_MAX = 256

    def encode_cached(self, text: str) -> list[int]:
        """Ids of a short text that recurs whole (an image's placeholder run: one per image size)."""
        ids = self._repeats.get(text)
        if ids is None:
            ids = self.encode(text)
            if len(self._repeats) >= self.REPEATS_MAX:
                self._repeats.clear()
            self._repeats[text] = ids
        return list(ids)

    def encode_from(
        self, text: str, start: int, known: tuple[int, list[int]] | None = None, nogil: bool = False
    ) -> ChunkedIds:
        """The ids of ``text[start:]`` (no special tokens added), where ``start`` is where a chunk of
        ``text`` starts: the last chunk start of an earlier prompt that ``text`` extends (``ChunkedIds.
        last_start``) is one, since a cut depends only on the text before it and one character after.
        A conversation's next turn so encodes only what follows its previous prompt's last chunk.
        ``known``: a safe cut inside that chunk and the ids of ``text[start:cut]`` (``last_cut``): only
        what follows the cut is encoded, and the chunk is cached whole as before.
        ``nogil`` (a worker thread): new chunks through the backend call that releases the GIL, whole.
        Needs the chunk cuts (``cuts`` not None)."""
        try:
            return self._encode_chunked(text, nogil, None, start, known)
        except Exception as exc:  # e.g. lone surrogates, which the tokenizer cannot encode
            raise PromptError(f"the prompt cannot be tokenized: {exc}") from None

    LAST_CUT_SCANS = (32, 256)  # characters before a text's end searched for its last cut, then all of it

    def last_cut(self, text: str, start: int, n_ids: int) -> tuple[int, int] | None:
        """The last safe cut of ``text`` after ``start`` (a chunk start) and how many of the ``n_ids`` ids
        of ``text[start:]`` come before it, or None without such a cut. A longer text that repeats this
        one has the same cut (it depends on the characters around it only), so its encode can resume
        there (``encode_from``'s ``known``) instead of at ``start``: a conversation's next turn does not
        encode its previous prompt's last chunk again. Costs the encode of the text after the cut."""
        cuts = self.cuts
        if cuts is None:
            return None
        cut = None
        for pos in (*(len(text) - n for n in self.LAST_CUT_SCANS), start + 1):
            for m in cuts.finditer(text, max(pos, start + 1)):
                cut = m.start()
            if cut is not None or pos <= start + 1:
                break
        if cut is None:
            return None
        tail = text[cut:]
        if self.piece_re is not None:
            n_tail = len(self._encode_fast(tail, False))
        else:
            n_tail = len(self.backend.encode(tail, add_special_tokens=False).ids)
        before = n_ids - n_tail
        return (cut, before) if before > 0 else None

    def _encode_chunked(
        self,
        text: str,
        nogil: bool,
        limit: tuple[int, int] | None = None,
        start: int = 0,
        known: tuple[int, list[int]] | None = None,
    ) -> ChunkedIds:
        """The ids of ``text[start:]`` (no special tokens added) from its chunks' cached ids; only the
        chunks not in the cache are encoded: with the backend call that releases the GIL on a worker
        thread, else on the fast path or one by one (holding the GIL, as GIL_HELD_PIECES explains).
        ``limit`` (worker threads: the limit, and the special tokens the prompt gets): PromptTooLong
        from the chunks' lengths, before the new chunks' id lists are built. ``known`` (``encode_from``):
        the first chunk, if not cached, is encoded from the known cut on."""
        assert self.cuts is not None
        cache = self.chunks
        parts: list[list[int] | None] = []
        keys: list[str] = []  # the chunks to encode
        missing: list[str] = []  # their text still to encode (the first may start at the known cut)
        head: list[int] = []  # the known ids of the first missing chunk
        last = start
        for end in chunk_ends(text, self.cuts, self.CHUNK_MIN_CHARS, start):
            chunk = text[start:end] if start or end < len(text) else text
            ids = cache.get(chunk)
            if ids is None:
                keys.append(chunk)
                if known is not None and not parts and start < known[0] < end and not nogil:
                    missing.append(text[known[0] : end])
                    head = known[1]
                else:
                    missing.append(chunk)
            parts.append(ids)
            last, start = start, end
        encoded: list[list[int]] = []
        if missing:
            if nogil:
                encodings = self._batch_fast(missing, add_special_tokens=False)
                self._check_limit(sum(len(e) for e in encodings), parts, limit)
                encoded = [e.ids for e in encodings]
            elif self.piece_re is not None:
                encoded = [self._encode_fast(c, cache_segments=False) for c in missing]
            else:
                encoded = [self.backend.encode(c, add_special_tokens=False).ids for c in missing]
            if head:
                encoded[0] = head + encoded[0]
            for chunk, ids in zip(keys, encoded, strict=True):
                cache.put(chunk, ids)
        else:
            self._check_limit(0, parts, limit)
        out: list[int] = []
        fresh = iter(encoded)
        before_last = 0
        for p in parts:
            before_last = len(out)
            out += p if p is not None else next(fresh)
        return ChunkedIds(out, last, before_last)

    @staticmethod
    def _check_limit(new: int, parts: list[list[int] | None], limit: tuple[int, int] | None) -> None:
        if limit is not None:
            n = new + sum(len(p) for p in parts if p is not None) + limit[1]
            if n >= limit[0]:
                raise PromptTooLong(n, limit[0])

    def _refuse_early(self, text: str, limit: int) -> None:
        """A text far longer than ``limit`` tokens is counted in pieces, and refused (PromptTooLong with a
        lower bound) as soon as the pieces hold ``limit`` tokens: a 3 MB prompt against a 450 k-token
        context costs a quarter of its encode. Pieces end before a space (where byte-level BPE
        pre-tokenizers start a new piece); each cut may change the count by a few tokens, so the
        count is only trusted with that margin. A text that turns out to fit is encoded whole after."""
        counted = cuts = 0
        start, n = 0, len(text)
        while start < n:
            end = min(n, start + EARLY_STOP_CHARS)
            if end < n:
                space = text.rfind(" ", start + EARLY_STOP_CHARS // 2, end)
                end = space if space > start else end
            counted += len(self._batch_fast([text[start:end]], add_special_tokens=False)[0])
            cuts += 1
            if counted - EARLY_STOP_MARGIN * cuts >= limit:
                raise PromptTooLong(counted - EARLY_STOP_MARGIN * cuts, limit, exact=False)
            start = end

    def _encode_fast(self, text: str, cache_segments: bool = True) -> list[int]:
        if self.special_re is None:
            return self._encode_segment(text, cache_segments)
        out: list[int] = []
        pos = 0
        for m in self.special_re.finditer(text):
            if m.start() > pos:
                out += self._encode_segment(text[pos : m.start()], cache_segments)
            out.append(self.special_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            out += self._encode_segment(text[pos:] if pos else text, cache_segments)
        return out

    def _encode_segment(self, segment: str, cache_segments: bool = True) -> list[int]:
        if self.ascii_only and not segment.isascii():
            return self.backend.encode(segment, add_special_tokens=False).ids
        cacheable = cache_segments and len(segment) >= self.SEGMENT_CACHE_MIN_CHARS
        if cacheable:
            hit = self._segments.get(segment)
            if hit is not None:
                with self._lock:
                    if segment in self._segments:
                        self._segments.move_to_end(segment)
                return list(hit)
        assert self.piece_re is not None  # this path runs only with the fast path set up
        pieces = self.piece_re.findall(segment)
        cache = self._pieces
        if self._bpe is not None:
            out = self._pieces_one_pass(pieces)
        else:
            missing = [p for p in set(pieces) if p not in cache]
            if missing:
                if len(missing) <= self.GIL_HELD_PIECES:
                    found = [self._piece_ids(p) for p in missing]
                else:
                    found = [e.ids for e in self._batch_fast(missing, add_special_tokens=False)]
                with self._lock:
                    if len(cache) + len(missing) > self.PIECE_CACHE_MAX:
                        cache.clear()
                    for p, new in zip(missing, found, strict=True):
                        cache[p] = new
            out = []
            get = cache.get
            for p in pieces:
                ids = get(p)
                out += ids if ids is not None else self._piece_ids(p)  # None: evicted by a concurrent clear
        if cacheable:
            with self._lock:
                self._segments[segment] = out
                if len(self._segments) > self.SEGMENT_CACHE_MAX:
                    self._segments.popitem(last=False)
            return list(out)
        return out


_encoders: weakref.WeakKeyDictionary[Any, PromptEncoder] = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def prompt_encoder(tokenizer) -> PromptEncoder:
    """The (cached) fast encoder of ``tokenizer``."""
    enc = _encoders.get(tokenizer)
    if enc is None:
        with _encoders_lock:
            enc = _encoders.get(tokenizer)
            if enc is None:
                enc = PromptEncoder(tokenizer)
                _encoders[tokenizer] = enc
    return enc


def encode_text(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """``tokenizer.encode(text)`` ids through the fast cached encoder."""
    return prompt_encoder(tokenizer).encode(text, add_special_tokens=add_special_tokens)
