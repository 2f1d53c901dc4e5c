"""The chunk cache gives exactly the ids of a full tokenization (hash parity with the engines depends on it).

Differential: random texts (whitespace runs, newlines, unicode, special tokens, contractions) and growing
multi-turn histories, through the encoder's chunked path (inline and worker-thread) against the
tokenizer's own full encode, for the built-in tokenizer and for HF tokenizers of each known pre-tokenizer
family (GPT-2's ByteLevel regex, Llama-3's and Qwen2's split patterns, Qwen2's with its NFC normalizer),
trained here on a small corpus with the ``tokenizers`` library (no download).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_common.text_chunks import (
    CUTS_GPT2,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    ChunkCache,
    chunk_ends,
    cut_rule,
)
from kvroute_common.tokenizer import (
    PromptEncoder,
    PromptTooLong,
    chat_prompt_token_ids,
    load_tokenizer,
    render_chat_prompt,
)

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
# pieces that meet at cuts in every way the patterns treat differently
ALPHABET = list("abc XYZ019\t\n\r  .,;:!?'\"()<>|_-ünï☃€😀\u00a0\u2028") + [
    "\n\n",
    "  \n",
    "\r\n",
    "!\n",
    " \n\n ",
    "word ",
    " the",
    "'s",
    "'T",
    "123456",
    "\n\nUser: ",
    "\n\nAssistant:",
]


def random_text(rng: random.Random, specials: list[str], n: int) -> str:
    alphabet = ALPHABET + specials
    return "".join(rng.choice(alphabet) for _ in range(n))


def hf_tokenizer(family: str):
    """A real HF fast tokenizer of the given pre-tokenizer family, trained on pseudo-text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    if family == "gpt2":
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pattern = LLAMA3_PATTERN if family == "llama3" else QWEN2_PATTERN
        t.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if family == "qwen2-nfc":
        t.normalizer = normalizers.NFC()
    rng = random.Random(3)
    corpus = [random_text(rng, [], 200) for _ in range(300)]
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(corpus, trainer)
    t.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[(SPECIALS[0], 0)])
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t)


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer(None)


@pytest.fixture(scope="module", params=["gpt2", "llama3", "qwen2-nfc"])
def hf(request):
    return hf_tokenizer(request.param)


def assert_like_full_encode(tok, enc: PromptEncoder, text: str) -> None:
    for special in (False, True):
        want = tok.backend_tokenizer.encode(text, add_special_tokens=special).ids
        for nogil in (False, True):
            assert enc.encode(text, special, nogil=nogil) == want, (repr(text), special, nogil)


def test_the_builtin_tokenizer_and_every_known_family_get_a_cut_rule(builtin, hf) -> None:
    for tok in (builtin, hf):
        enc = PromptEncoder(tok)
        assert enc.cuts is not None
    assert PromptEncoder(builtin).fast  # the built-in one keeps its re-based fast path for new chunks


class _RecordingSplit:
    """A split pattern that records the texts it splits."""

    def __init__(self, pattern: Any) -> None:
        self.pattern, self.texts = pattern, []

    def findall(self, text: str) -> list[str]:
        self.texts.append(text)
        return self.pattern.findall(text)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_unicode_class_split_patterns_take_the_fast_path_on_ascii_text_only(family: str) -> None:
    """Llama-3's and Qwen2's split patterns (``\\p{L}``, ``\\s``, a case-insensitive group) are compiled with
    the ``regex`` module and trusted on ASCII text: there random strings over every ASCII character (and the
    runs where the patterns differ) split as the tokenizer's own pre-tokenizer splits them and encode to its
    ids; a segment with any other character goes to the backend whole, never through the pattern."""
    from tokenizers import Regex, pre_tokenizers

    tok = hf_tokenizer(family)
    enc = PromptEncoder(tok)
    assert enc.fast and enc.ascii_only
    backend = tok.backend_tokenizer
    pattern = LLAMA3_PATTERN if family == "llama3" else QWEN2_PATTERN
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    rng = random.Random(17)
    alphabet = [chr(i) for i in range(128)] + ["'s", "'LL", "'Ve", "123456", "!\n\n", " \n ", "\r\n", "word ", "  x"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert enc.piece_re.findall(text) == [p for p, _ in split.pre_tokenize_str(text)], repr(text)
        for special in (False, True):
            assert enc.encode(text, special) == backend.encode(text, add_special_tokens=special).ids, repr(text)
    recording = enc.piece_re = _RecordingSplit(enc.piece_re)
    mixed = "plain ascii words, then ünï and ☃ " * 3
    assert enc.encode(mixed) == backend.encode(mixed, add_special_tokens=False).ids
    assert enc.encode("only ascii here") == backend.encode("only ascii here", add_special_tokens=False).ids
    assert recording.texts == ["only ascii here"]


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_ascii_text_encodes_like_the_llama3_tokenizer(text: str) -> None:
    enc = _llama3_encoder()
    assert enc.encode(text, True) == enc.backend.encode(text, add_special_tokens=True).ids


_LLAMA3: list[PromptEncoder] = []


def _llama3_encoder() -> PromptEncoder:
    if not _LLAMA3:
        _LLAMA3.append(PromptEncoder(hf_tokenizer("llama3")))
    return _LLAMA3[0]


def test_random_texts_encode_like_the_full_tokenization(builtin, hf) -> None:
    rng = random.Random(11)
    for tok, specials in ((builtin, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]), (hf, SPECIALS)):
        enc = PromptEncoder(tok)
        for _ in range(150):
            text = random_text(rng, specials, rng.randint(200, 1500))
            assert_like_full_encode(tok, enc, text)
        assert enc.chunks.hits > 0  # each text was encoded four times: the later ones came from the cache


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET + ["<|im_end|>", "<|im_start|>"]), min_size=0, max_size=600))
def test_any_text_encodes_like_the_full_tokenization_with_the_builtin_tokenizer(parts: list[str]) -> None:
    tok = load_tokenizer(None)
    enc = PromptEncoder(tok)
    enc.CHUNK_MIN_CHARS = 8  # many cuts in short texts
    assert_like_full_encode(tok, enc, "".join(parts))


def test_growing_sessions_reuse_their_history_and_stay_exact(builtin, hf) -> None:
    """Each turn repeats the previous prompt and adds to it: its ids are the full encode's, and only a
    tail is new to the cache."""
    rng = random.Random(5)
    for tok in (builtin, hf):
        enc = PromptEncoder(tok)
        system = random_text(rng, [], 3000)
        for session in range(3):
            history = system
            for turn in range(5):
                history += f"\n\nUser: {random_text(rng, [], rng.randint(50, 900))}"
                prompt = history + "\n\nAssistant:"
                misses = enc.chunks.misses
                assert_like_full_encode(tok, enc, prompt)
                new_chunks = enc.chunks.misses - misses
                if session or turn:  # the shared system prompt (and the history) came from the cache
                    assert new_chunks <= 1 + (len(prompt) - len(system)) // enc.CHUNK_MIN_CHARS, (session, turn)
                history += f"\n\nAssistant: {random_text(rng, [], rng.randint(50, 900))}"


def test_new_chars_counts_what_the_chunk_cache_does_not_hold(builtin, hf) -> None:
    """What decides the worker thread for a completion prompt: a session's next turn is mostly its
    cached history, a new text is new throughout."""
    rng = random.Random(8)
    for tok in (builtin, hf):
        enc = PromptEncoder(tok)
        history = random_text(rng, [], 20_000)
        assert enc.new_chars(history) == len(history)
        enc.encode(history, add_special_tokens=True)
        assert enc.new_chars(history) == 0
        turn = history + "\n\nUser: " + random_text(rng, [], 600)
        assert 600 <= enc.new_chars(turn) <= 600 + 10 + 2 * enc.CHUNK_MIN_CHARS  # the tail chunk and the turn
        short = random_text(rng, [], enc.CHUNK_MIN_CHARS - 1)
        assert enc.new_chars(short) == len(short)


def test_rendered_chat_prompts_encode_like_the_full_tokenization(builtin) -> None:
    rng = random.Random(9)
    messages = [{"role": "system", "content": random_text(rng, [], 2000)}]
    for _ in range(6):
        messages.append({"role": "user", "content": random_text(rng, [], rng.randint(100, 1500))})
        text = render_chat_prompt(builtin, messages)
        want = builtin.backend_tokenizer.encode(text, add_special_tokens=False).ids
        for nogil in (False, True):
            assert chat_prompt_token_ids(builtin, messages, nogil=nogil) == want
        messages.append({"role": "assistant", "content": random_text(rng, [], rng.randint(100, 1500))})


def test_a_prompt_over_the_limit_is_refused_on_the_chunked_path(builtin) -> None:
    enc = PromptEncoder(builtin)
    text = "\n".join(f"line number {i} of a long prompt" for i in range(400))
    n = len(builtin.backend_tokenizer.encode(text, add_special_tokens=True).ids)
    assert enc.encode(text, True, nogil=True, limit=n + 1) == builtin.backend_tokenizer.encode(text).ids
    with pytest.raises(PromptTooLong) as exc:
        enc.encode(text, True, nogil=True, limit=n)  # now every chunk is cached
    assert exc.value.n_tokens == n and exc.value.exact


def test_cuts_land_only_where_the_rule_allows_and_depend_only_on_the_text_before(builtin) -> None:
    text = "first line\n\nsecond line with words\nthird " * 40
    ends = chunk_ends(text, CUTS_GPT2, 64)
    assert ends[-1] == len(text)
    for a, b in zip([0, *ends], ends, strict=False):
        assert b - a >= 64 or b == len(text)
    for end in ends[:-1]:
        assert text[end] in "\n " and text[end - 1] not in " \t\r\n"
    longer = text + "more text after it"
    assert chunk_ends(longer, CUTS_GPT2, 64)[: len(ends) - 1] == ends[:-1]


def test_unknown_pre_tokenizers_and_risky_added_tokens_get_no_cuts(builtin) -> None:
    spec = json.loads(builtin.backend_tokenizer.to_str())
    assert cut_rule(spec) is not None
    other = json.loads(json.dumps(spec))
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    assert cut_rule(other) is None
    newline_token = json.loads(json.dumps(spec))
    newline_token["added_tokens"].append({**spec["added_tokens"][0], "id": 99_999, "content": "x\ny"})
    assert cut_rule(newline_token) is None
    lowercase = json.loads(json.dumps(spec))
    lowercase["normalizer"] = {"type": "Lowercase"}
    assert cut_rule(lowercase) is None
    prefix_space = json.loads(json.dumps(spec))
    prefix_space["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}
    assert cut_rule(prefix_space) is None
    prefix_space["pre_tokenizer"]["add_prefix_space"] = False
    assert cut_rule(prefix_space) is CUTS_GPT2  # GPT-2: ByteLevel with its own regex


def test_the_cache_keeps_to_its_byte_budget_and_drops_the_least_recently_used() -> None:
    cache = ChunkCache(max_bytes=4000)
    ids = list(range(20))
    for i in range(100):
        cache.put(f"chunk {i:03d} " * 10, ids)
        if i == 50:
            assert cache.get("chunk 001 " * 10) is None  # long gone
        assert cache.bytes <= cache.max_bytes
    assert 0 < len(cache) < 100
    newest = "chunk 099 " * 10
    assert cache.get(newest) == ids
    cache.put("too big" * 1000, ids)  # larger than the whole budget: not kept
    assert cache.get("too big" * 1000) is None and cache.get(newest) == ids


def test_a_completion_repeating_its_cached_history_is_tokenized_inline(builtin) -> None:
    """The worker thread is for text still to encode: a session's next turn over a long cached history
    stays on the loop (no hand-over, no hashing under the GIL beside it); a long new text goes to the
    thread; both give the full encode's ids."""
    import asyncio

    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import tokenize_request
    from kvroute_common.tokenize_offload import TokenizeOffload
    from slot_tracker.core import SlotRegistry

    rng = random.Random(11)
    entry = ModelEntry("m", 16, builtin, SlotRegistry(), None, None, BusyThresholds())
    off = TokenizeOffload(16384)
    history = random_text(rng, [], 20_000)
    turn = history + "\n\nUser: " + random_text(rng, [], 300)

    async def main() -> list[list[int]]:
        prompts = [
            await tokenize_request(off, entry, {"model": "m", "prompt": p}, "completions") for p in (history, turn)
        ]
        return [list(p.tokens) for p in prompts]

    try:
        first, second = asyncio.run(main())
    finally:
        off.close()
    assert off.offloaded == 1  # the new 20k characters; not the turn that repeats them
    assert first == builtin(history)["input_ids"] and second == builtin(turn)["input_ids"]


def test_a_long_prompt_continuing_no_remembered_turn_goes_to_the_thread_though_its_chunks_are_cached(
    builtin,
) -> None:
    """A document asked a second question (the first question's prompt is remembered, but the second does not
    continue it): its chunks are cached, yet its whole ids and hashes would be built on the loop, so past
    ``COUNTED_MAX`` times the threshold it goes to the thread; a shorter one is counted and stays inline."""
    import asyncio

    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import COUNTED_MAX, tokenize_request
    from kvroute_common.tokenize_offload import DEFAULT_OFFLOAD_CHARS, TokenizeOffload
    from slot_tracker.core import SlotRegistry

    rng = random.Random(14)
    entry = ModelEntry("m", 16, builtin, SlotRegistry(), None, None, BusyThresholds())
    off = TokenizeOffload()
    long_doc = random_text(rng, [], COUNTED_MAX * DEFAULT_OFFLOAD_CHARS + 500)
    short_doc = random_text(rng, [], 2 * DEFAULT_OFFLOAD_CHARS)
    prompts = [doc + question for doc in (long_doc, short_doc) for question in ("\nWho wrote it?", "\nWhen?")]
    offloaded: list[int] = []

    async def main() -> list[list[int]]:
        out = []
        for prompt in prompts:
            got = await tokenize_request(off, entry, {"model": "m", "prompt": prompt}, "completions")
            out.append(list(got.tokens))
            offloaded.append(off.offloaded)
        return out

    try:
        got = asyncio.run(main())
    finally:
        off.close()
    assert offloaded == [1, 2, 3, 3]  # the long document's second question too; the short one's inline
    assert got == [builtin(p)["input_ids"] for p in prompts]


def test_text_the_caches_lack_goes_to_the_thread_whatever_the_request_shape(builtin) -> None:
    """At the default threshold a completion, a chat request (its rendered prompt counted, rendered once),
    a Messages request and an embeddings input with a few thousand characters of new text are encoded on the
    thread, and the same text again inline (its chunks are cached); a chat request past four times the
    threshold goes to the thread uncounted. Every path gives the full encode's ids."""
    import asyncio
    import copy

    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import COUNTED_MAX, embedding_tokens, tokenize_request, tokenize_request_sync
    from kvroute_common.tokenize_offload import DEFAULT_OFFLOAD_CHARS, TokenizeOffload
    from slot_tracker.core import SlotRegistry

    rng = random.Random(12)
    tok = copy.copy(builtin)  # the real tokenizer and template; its renders are counted
    renders: list[int] = []
    render = tok.apply_chat_template

    def counted(*args: Any, **kwargs: Any) -> Any:
        renders.append(1)
        return render(*args, **kwargs)

    tok.apply_chat_template = counted
    entry = ModelEntry("m", 16, tok, SlotRegistry(), None, None, BusyThresholds())
    off = TokenizeOffload()
    assert off.threshold_chars == DEFAULT_OFFLOAD_CHARS
    fresh = random_text(rng, [], DEFAULT_OFFLOAD_CHARS + 2000)

    def chat(n: int) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": random_text(rng, [], n)}]}

    mid_chat = chat(DEFAULT_OFFLOAD_CHARS * 2)
    messages = {"model": "m", "max_tokens": 4, "messages": chat(DEFAULT_OFFLOAD_CHARS * 2)["messages"]}
    long_chat = chat(DEFAULT_OFFLOAD_CHARS * COUNTED_MAX + 100)
    embed = {"model": "m", "input": ["short", random_text(rng, [], DEFAULT_OFFLOAD_CHARS + 500)]}
    offloaded: list[int] = []
    rendered: list[int] = []

    async def main() -> list[list[int]]:
        out = []
        for body, kind in (
            ({"model": "m", "prompt": fresh}, "completions"),
            ({"model": "m", "prompt": fresh}, "completions"),
            (mid_chat, "chat"),
            (mid_chat, "chat"),
            (messages, "messages"),
            (messages, "messages"),
            (long_chat, "chat"),
            (embed, "embeddings"),
            (embed, "embeddings"),
        ):
            out.append(list((await tokenize_request(off, entry, body, kind)).tokens))
            offloaded.append(off.offloaded)
            rendered.append(len(renders))
        return out

    try:
        first, again, mid, mid_again, msg, msg_again, long, emb, emb_again = asyncio.run(main())
    finally:
        off.close()
    # new text; cached text inline; fresh chat, then inline; Messages the same; long chat; embeddings the same
    assert offloaded == [1, 1, 2, 2, 3, 3, 4, 5, 5]
    assert rendered == [0, 0, 1, 2, 3, 4, 5, 5, 5]  # one render a request, on the thread or on the loop
    assert first == again == builtin(fresh)["input_ids"]
    assert mid == mid_again == tokenize_request_sync(entry, mid_chat, "chat")
    assert msg == msg_again == tokenize_request_sync(entry, messages, "messages")
    assert long == tokenize_request_sync(entry, long_chat, "chat")
    assert emb == emb_again == embedding_tokens(entry, embed)
