"""Token ids of text chunks cut where the tokenizer's pre-tokenization splits anyway, cached across prompts.

Why: a multi-turn prompt repeats its whole history every turn, and a completions prompt is one segment
between special tokens, so tokenizing it from scratch redoes the previous turn's work (issue 28). A
byte-level BPE tokenizer encodes each pre-token piece on its own, so wherever the pre-tokenizer's regex
is sure to split, the text can be cut and the pieces' ids concatenated: ``ids(a + b) == ids(a) + ids(b)``.
Chunks end at such cuts, the first one at least ``min_chars`` after the chunk's start; the cut depends
only on the text before it (and one character after), so every turn of a session cuts its shared
history at the same places and finds those chunks' ids in the cache; only the new tail is encoded.

Which cuts are safe depends on the pattern, so only known patterns get a rule (anything else, or a
normalizer other than NFC, or added tokens that could straddle a cut, gets none and is encoded whole):

* GPT-2 family (the built-in tokenizer's ASCII pattern, GPT-2's): before ``"\\n"`` or before ``" x"``
  (x an ASCII letter), after an ASCII non-space character. No piece continues past a non-space character
  into ``\\n`` or a space, and a piece starting at the cut does not look behind it.
* Llama-3 / Qwen2 family: before ``" x"`` as above, and after a newline before an ASCII non-space
  character (there punctuation takes the newlines after it, so ``"!\\n"`` is one piece and the GPT-2
  newline cut would be wrong; a newline run always ends its piece).

The characters that decide a cut are ASCII, which Python's ``re`` and the tokenizers' Oniguruma classify
alike, and NFC never composes across an ASCII character. tests/test_text_chunks.py checks the rules
against the tokenizers' own full encode on random texts.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

BUILTIN_PATTERN = r" ?[A-Za-z]+| ?[0-9]+| ?[^ \t\r\nA-Za-z0-9]+|[ \t\r\n]+(?![^ \t\r\n])|[ \t\r\n]+"
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_HEAD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = _LLAMA3_HEAD + r"\p{N}{1,3}" + _LLAMA3_TAIL
QWEN2_PATTERN = _LLAMA3_HEAD + r"\p{N}" + _LLAMA3_TAIL

_BEFORE_SPACE_WORD = r"(?<=[!-~])(?= [A-Za-z])"
CUTS_GPT2 = re.compile(_BEFORE_SPACE_WORD + r"|(?<=[!-~])(?=\n)")
CUTS_LLAMA3 = re.compile(_BEFORE_SPACE_WORD + r"|(?<=[\r\n])(?=[!-~])")
KNOWN_PATTERNS: dict[str, re.Pattern[str]] = {
    BUILTIN_PATTERN: CUTS_GPT2,
    GPT2_PATTERN: CUTS_GPT2,
    LLAMA3_PATTERN: CUTS_LLAMA3,
    QWEN2_PATTERN: CUTS_LLAMA3,
}


def cut_rule(spec: Mapping[str, Any]) -> re.Pattern[str] | None:
    """The safe cuts of the tokenizer described by ``spec`` (its ``tokenizer.json``), or None."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    for t in spec.get("added_tokens") or []:
        content = t.get("content", "")
        if t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return None
        if "\n" in content or "\r" in content or " " in content:  # could straddle a cut
            return None
    pattern = _split_pattern(spec.get("pre_tokenizer") or {})
    return KNOWN_PATTERNS.get(pattern) if pattern is not None else None


def _split_pattern(pre: Mapping[str, Any]) -> str | None:
    """The one regex a byte-level pre-tokenizer splits with (a Split + ByteLevel sequence, or GPT-2's
    ByteLevel with its built-in regex), never with a prefix space (that would start every chunk with one)."""
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex") and not pre.get("add_prefix_space") else None
    subs: Sequence[Mapping[str, Any]] = pre.get("pretokenizers") or () if pre.get("type") == "Sequence" else ()
    if len(subs) != 2:
        return None
    split, byte_level = subs
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None


def chunk_ends(text: str, cuts: re.Pattern[str], min_chars: int, start: int = 0) -> list[int]:
    """Where each chunk of ``text`` ends: at the first cut at least ``min_chars`` after the chunk's start
    (the last chunk ends with the text). One C-level search per chunk. ``start``: where a chunk of
    ``text`` starts (0, or one of these ends): the chunks from there, as the scan from 0 finds them."""
    n = len(text)
    ends: list[int] = []
    search = cuts.search
    while start + min_chars < n:
        m = search(text, start + min_chars)
        if m is None:
            break
        start = m.start()
        ends.append(start)
    ends.append(n)
    return ends


class ChunkCache:
    """Least recently used chunk text -> token ids, bounded by an estimate of the bytes it holds.
    Shared by the event loop and the tokenizer threads: every change holds the lock, no encode does."""

    # a list slot and an int object per id, the text (ASCII: a byte a character), object headers
    BYTES_PER_ID = 36
    BYTES_PER_ENTRY = 200

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _size(self, text: str, ids: list[int]) -> int:
        return len(text) + self.BYTES_PER_ID * len(ids) + self.BYTES_PER_ENTRY

    def get(self, text: str) -> list[int] | None:
        ids = self._entries.get(text)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        with self._lock:
            if text in self._entries:
                self._entries.move_to_end(text)
        return ids

    def __contains__(self, text: object) -> bool:
        return text in self._entries

    def put(self, text: str, ids: list[int]) -> None:
        size = self._size(text, ids)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self.bytes -= self._size(text, old)
            self._entries[text] = ids
            self.bytes += size
            while self.bytes > self.max_bytes:
                k, v = self._entries.popitem(last=False)
                self.bytes -= self._size(k, v)
