"""The next turn of a conversation repeats its previous prompt: that prompt's ids and block hashes are
reused, and only what the turn adds is tokenized and hashed.

Why: a multi-turn completions prompt is the whole history again with a new turn at its end. The chunk
cache (``kvroute_common.text_chunks``) already saves encoding the history, but finding its chunks,
joining their ids and hashing every block still cost the loop time in proportion to the whole prompt.
Here a prompt that starts with a remembered prompt takes that prompt's ids up to where its last chunk
starts (a cut a longer text shares, ``PromptEncoder.encode_from``) and the block hashes of the full
blocks inside them; the rest is encoded from its chunks and hashed, chained on. The ids of that last
chunk up to its last safe cut (``PromptEncoder.last_cut``) are reused too: only the text after the cut
is encoded again (a third of what a turn of ``agentic-dense`` encoded before).

A remembered prompt is found by its first ``FINGERPRINT_CHARS`` characters and then compared whole
(C-speed); the turn it continues is forgotten, its conversation having moved on. The memo's own state is
read and changed on the event loop only (no lock): a turn with more new text than the loop encodes is
encoded on a tokenizer thread from the turn found on the loop (``encode``, which reads neither) and kept
when it comes back, so the conversation's next turn continues it on the loop. Prompts of at most
``max_chars`` characters. A chat conversation's rendered prompt extends its previous turn's the same way (the
assistant's answer and the new messages follow the previous generation prompt) wherever the template renders
earlier turns alike.

A prompt's ids are a compact u32 ``array``, not a list: taking the earlier turn's ids is then a copy of
contiguous memory, and freeing a forgotten turn one free. A list of a few thousand token ids points at
as many int objects spread over the heap; copying it writes each one's reference count and freeing it
writes them again, a cache miss each on a core that ran other requests in between (~60 us for 3,000
ids, against ~11 for the array). The array is also what is hashed (no conversion) and what the
engine is sent (``frontend.routing.prompt.with_prompt_ids``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from kvroute_common.hashing import local_block_hashes, sequence_hashes, token_array

if TYPE_CHECKING:
    from kvroute_common.tokenizer import PromptEncoder


class TurnPrompt(NamedTuple):
    """A prompt's ids (special tokens included; u32) and the local and sequence hashes of its full blocks."""

    ids: array
    local_hashes: list[int]
    seq_hashes: list[int]


class Turn:
    """A remembered prompt and where its next turn's encode resumes. Not changed once built: a tokenizer
    thread may read one the loop has since forgotten."""

    __slots__ = ("text", "key", "resume_char", "resume_ids", "cut", "prompt", "size")

    def __init__(
        self, text: str, key: tuple, resume_char: int, resume_ids: int, cut: tuple[int, int] | None, prompt: TurnPrompt
    ) -> None:
        self.text = text
        self.key = key
        self.resume_char = resume_char  # where the text's last chunk starts
        self.resume_ids = resume_ids  # how many of the ids come before it
        self.cut = cut  # the last safe cut in that chunk and how many of the ids come before it
        self.prompt = prompt
        # the text (ASCII: a byte a character), 4 bytes per id, an int object and two slots per block
        # hash, the objects themselves
        self.size = len(text) + 4 * len(prompt.ids) + 80 * len(prompt.local_hashes) + 400


class TurnMemo:
    """Recent prompts of one model (its tokenizer, block size and LoRA adapter), least recently used
    first out, bounded by an estimate of the bytes they hold."""

    FINGERPRINT_CHARS = 256
    # a prompt sharing its first characters (a system prompt) with this many remembered ones is compared
    # with each: the oldest is forgotten beyond it
    PER_FINGERPRINT = 64
    TAIL_CHARS = 16  # compared before the whole text: where two remembered prompts most likely differ
    MAX_BYTES = 8 * 1024 * 1024

    def __init__(self, encoder: PromptEncoder, block_size: int, lora_name: str | None, max_bytes: int = MAX_BYTES):
        self.encoder = encoder
        self.block_size = block_size
        self.lora_name = lora_name
        self.max_bytes = max_bytes
        self.bytes = 0
        self._turns: OrderedDict[int, Turn] = OrderedDict()  # id(turn) -> turn, least recently used first
        self._by_start: dict[tuple, list[Turn]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._turns)

    def usable(self, text: str, max_chars: int) -> bool:
        """Whether ``text`` is encoded through the memo: long enough to be cut into chunks, at most
        ``max_chars`` (the loop's bound on work that grows with a prompt)."""
        enc = self.encoder
        return enc.cuts is not None and enc.CHUNK_MIN_CHARS <= len(text) <= max_chars

    def new_chars(self, text: str, salt: str | None, specials: bool = True) -> int | None:
        """Characters of ``text`` left to encode after the remembered prompt it continues (None: none)."""
        turn = self.find(text, salt, specials)
        return None if turn is None else self.chars_after(turn, text)

    @staticmethod
    def chars_after(turn: Turn, text: str) -> int:
        """Characters of ``text`` (which continues ``turn``) its encode from ``turn`` tokenizes."""
        return len(text) - (turn.resume_char if turn.cut is None else turn.cut[0])

    def prompt(self, text: str, salt: str | None, specials: bool = True) -> TurnPrompt:
        """``text``'s ids and its block hashes; remembered for the next turn. ``specials``: with the
        tokenizer's special tokens, as vLLM encodes a completions prompt; without, as it encodes a rendered
        chat prompt (the two kinds are remembered apart). Raises PromptError."""
        before = self.find(text, salt, specials)
        turn = self.encode(text, salt, specials, before)
        self.keep(turn, before)
        return turn.prompt

    def encode(self, text: str, salt: str | None, specials: bool, before: Turn | None, nogil: bool = False) -> Turn:
        """``text`` as a turn to remember, continuing ``before`` (``find``; None: from its start). Reads and
        changes none of the memo's state, so it runs on a tokenizer thread too (``nogil``: new chunks through
        the backend call that releases the GIL). Raises PromptError."""
        enc = self.encoder
        bs = self.block_size
        prefix, suffix = (enc.prefix, enc.suffix) if specials else ((), ())
        if before is None:
            chunked = enc.encode_from(text, 0, nogil=nogil)
            head = len(prefix)
            ids = token_array(prefix)
            ids.extend(chunked.ids)
            ids.extend(suffix)
            local = local_block_hashes(ids, bs, self.lora_name, salt)
            prompt = TurnPrompt(ids, local, sequence_hashes(local))
        else:
            head = before.resume_ids
            earlier = before.prompt
            cut = before.cut
            known = (cut[0], earlier.ids[head : cut[1]].tolist()) if cut is not None else None
            chunked = enc.encode_from(text, before.resume_char, known, nogil)
            ids = earlier.ids[:head]
            ids.extend(chunked.ids)
            ids.extend(suffix)
            kept = head // bs  # full blocks inside the reused ids
            local = earlier.local_hashes[:kept]
            local += local_block_hashes(ids[kept * bs :], bs, self.lora_name, salt)
            seq = earlier.seq_hashes[:kept]
            seq += sequence_hashes(local[kept:], seq[-1] if kept else None)
            prompt = TurnPrompt(ids, local, seq)
        resume_ids = head + chunked.ids_before_last
        last = enc.last_cut(text, chunked.last_start, len(chunked.ids) - chunked.ids_before_last)
        cut = (last[0], resume_ids + last[1]) if last is not None else None
        key = (salt, specials, text[: self.FINGERPRINT_CHARS])
        return Turn(text, key, chunked.last_start, resume_ids, cut, prompt)

    def keep(self, turn: Turn, before: Turn | None) -> None:
        """Remember ``turn`` (``encode``), forgetting ``before``, the turn it continued: its conversation moved
        on (a no-op when it is already gone)."""
        if before is None:
            self.misses += 1
        else:
            self.hits += 1
            self._forget(before)
        self._remember(turn)

    def find(self, text: str, salt: str | None, specials: bool = True) -> Turn | None:
        """The longest remembered prompt of the same kind ``text`` starts with."""
        candidates = self._by_start.get((salt, specials, text[: self.FINGERPRINT_CHARS]))
        if not candidates:
            return None
        best: Turn | None = None
        size = len(text)
        tail = self.TAIL_CHARS
        for turn in candidates:
            before = turn.text
            n = len(before)
            if (
                n <= size
                and (best is None or n > len(best.text))
                and text.startswith(before[-tail:], n - tail)
                and text.startswith(before)
            ):
                best = turn
        return best

    def _remember(self, turn: Turn) -> None:
        if turn.size > self.max_bytes:
            return
        same = self._by_start.setdefault(turn.key, [])
        same.append(turn)
        if len(same) > self.PER_FINGERPRINT:
            self._forget(same[0])
        self._turns[id(turn)] = turn
        self.bytes += turn.size
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self._turns.values())))

    def _forget(self, turn: Turn) -> None:
        if self._turns.pop(id(turn), None) is None:
            return
        self.bytes -= turn.size
        same = self._by_start[turn.key]
        same.remove(turn)
        if not same:
            del self._by_start[turn.key]
