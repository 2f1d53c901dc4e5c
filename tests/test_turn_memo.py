"""A conversation's next turn reuses its previous prompt's ids and block hashes, and gets exactly what a
full tokenization and hashing gives (the routing decision and hash parity with the engines depend on it).

Differential: growing multi-turn histories (random texts with whitespace runs, unicode and special
tokens), branches, repeats, salts and LoRA names, through the memo against the tokenizer's own full
encode and the block hashes of its ids; for the built-in tokenizer and HF tokenizers of each known
pre-tokenizer family. Then through the frontend: a session's turns routed by a real frontend in front
of mockers report the engines' prompt lengths back as the router counted them.
"""

from __future__ import annotations

import random
from array import array

import httpx

from frontend.routing.turn_memo import TurnMemo
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions
from kvroute_common.tokenizer import PromptEncoder
from support import wait_until
from tests.test_text_chunks import SPECIALS, builtin, hf, random_text  # noqa: F401 - fixtures

BLOCK = 16


def full(tok, text: str, lora: str | None = None, salt: str | None = None) -> tuple[array, list[int], list[int]]:
    """The tokenizer's own encode (as the memo keeps ids: a u32 array) and the block hashes of its ids."""
    ids = tok.backend_tokenizer.encode(text, add_special_tokens=True).ids
    local = local_block_hashes(ids, BLOCK, lora, salt)
    return array("I", ids), local, sequence_hashes(local)


def test_each_turn_gets_the_full_encode_and_hashes_and_reuses_the_one_before(builtin, hf) -> None:  # noqa: F811
    rng = random.Random(21)
    for tok, specials in ((builtin, ["<|im_start|>", "<|im_end|>"]), (hf, SPECIALS)):
        memo = TurnMemo(PromptEncoder(tok), BLOCK, None)
        system = random_text(rng, specials, 2500)
        for session in range(3):
            history = system + f"\nsession {session}"
            for turn in range(5):
                history += "\n\nUser: " + random_text(rng, specials, rng.randint(20, 900))
                prompt = history + "\n\nAssistant:"
                hits = memo.hits
                got = memo.prompt(prompt, None)
                assert tuple(got) == full(tok, prompt), (session, turn)
                assert memo.hits == hits + (turn > 0)  # every later turn continues the one before
                history = prompt + " " + random_text(rng, specials, rng.randint(5, 300))
        assert len(memo) == 3  # a turn that was continued is forgotten: one per conversation


def test_repeats_branches_salts_and_adapters_stay_exact(builtin) -> None:  # noqa: F811
    rng = random.Random(4)
    memo = TurnMemo(PromptEncoder(builtin), BLOCK, "my-adapter")
    base = random_text(rng, [], 3000)
    assert tuple(memo.prompt(base, None)) == full(builtin, base, "my-adapter")
    again = memo.prompt(base, None)  # the same prompt again: a full hit
    assert tuple(again) == full(builtin, base, "my-adapter") and memo.hits == 1
    one = base + random_text(rng, [], 700)
    assert tuple(memo.prompt(one, None)) == full(builtin, one, "my-adapter")
    other = base + random_text(rng, [], 700)  # a second branch from the same turn: its turn is gone
    assert tuple(memo.prompt(other, None)) == full(builtin, other, "my-adapter")
    salted = one + "more"
    assert tuple(memo.prompt(salted, "tenant-a")) == full(builtin, salted, "my-adapter", "tenant-a")
    assert memo.new_chars(salted + "x", "tenant-b") is None  # another salt: nothing remembered
    assert memo.new_chars(salted + "x", "tenant-a") is not None


def test_new_chars_is_what_follows_the_remembered_turn(builtin) -> None:  # noqa: F811
    rng = random.Random(6)
    memo = TurnMemo(PromptEncoder(builtin), BLOCK, None)
    history = random_text(rng, [], 20_000)
    assert memo.new_chars(history, None) is None
    memo.prompt(history, None)
    turn = history + "\n\nUser: " + random_text(rng, [], 600)
    new = memo.new_chars(turn, None)
    assert new is not None and 600 < new <= 600 + 10 + 2 * memo.encoder.CHUNK_MIN_CHARS


def test_a_next_turn_encodes_only_what_follows_the_previous_prompts_last_cut(builtin) -> None:  # noqa: F811
    """The previous prompt's last chunk is not encoded again up to its last safe cut (before " turn"):
    the encoder sees the text from there on, and the ids are still the full encode's."""
    rng = random.Random(8)
    enc = PromptEncoder(builtin)
    memo = TurnMemo(enc, BLOCK, None)
    first = random_text(rng, [], 3000) + " the end of the first turn"
    memo.prompt(first, None)
    encoded: list[str] = []
    encode_fast = enc._encode_fast

    def recording(text: str, cache_segments: bool = True) -> list[int]:
        encoded.append(text)
        return encode_fast(text, cache_segments)

    enc._encode_fast = recording  # type: ignore[method-assign]
    second = first + " and the second turn"
    assert tuple(memo.prompt(second, None)) == full(builtin, second)
    cut = first.rindex(" turn")
    assert "".join(encoded[:-1]) == second[cut:]  # the new chunks, from the cut on
    assert encoded[-1] == " turn"  # the next resume point: the text after the second prompt's last cut
    assert memo.new_chars(second + " and a third", None) == len(" turn and a third")


def test_the_memo_holds_at_most_its_bytes_and_forgets_the_oldest(builtin) -> None:  # noqa: F811
    rng = random.Random(7)
    memo = TurnMemo(PromptEncoder(builtin), BLOCK, None, max_bytes=200_000)
    texts = [f"conversation {i}: " + random_text(rng, [], 4000) for i in range(12)]
    for text in texts:
        memo.prompt(text, None)
        assert memo.bytes <= 200_000
    assert 0 < len(memo) < len(texts)
    assert memo.new_chars(texts[-1] + "!", None) is not None
    assert memo.new_chars(texts[0] + "!", None) is None  # forgotten first
    short = TurnMemo(PromptEncoder(builtin), BLOCK, None)
    assert not short.usable("x" * (short.encoder.CHUNK_MIN_CHARS - 1), 1 << 20)
    assert not short.usable("x" * 5000, 4000)  # beyond the loop's bound


def test_a_chat_conversation_continues_its_rendered_prompt_apart_from_completions(builtin, tmp_path) -> None:  # noqa: F811
    """A chat request's rendered prompt goes through the memo without special tokens: each turn gets the full
    chat encode and its block hashes, every later turn continues the one before; a completion of the same
    text (the tokenizer adds its BOS) is remembered apart. The built-in tokenizer and an HF one with Llama-3's
    split pattern (the regex module's pieces on ASCII text, the backend's elsewhere)."""
    import asyncio

    from bench.data_path import hf_tokenizer_dir
    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import tokenize_request, tokenize_request_sync
    from kvroute_common.tokenize_offload import TokenizeOffload
    from kvroute_common.tokenizer import load_tokenizer, render_chat_prompt
    from slot_tracker.core import SlotRegistry

    rng = random.Random(33)
    for tok in (builtin, load_tokenizer(hf_tokenizer_dir(str(tmp_path)))):
        entry = ModelEntry("m", BLOCK, tok, SlotRegistry(), None, None, BusyThresholds())
        off = TokenizeOffload()
        messages = [{"role": "system", "content": random_text(rng, [], 1200)}]  # under the offload threshold

        async def main(entry=entry, off=off, messages=messages, tok=tok) -> None:
            for turn in range(4):
                messages.append({"role": "user", "content": random_text(rng, [], rng.randint(50, 900))})
                body = {"model": "m", "messages": list(messages)}
                hits = entry.turns.hits
                got = await tokenize_request(off, entry, body, "chat")
                assert list(got.tokens) == tokenize_request_sync(entry, body, "chat"), turn
                local = local_block_hashes(list(got.tokens), BLOCK)
                assert (got.local_hashes, got.seq_hashes) == (local, sequence_hashes(local))
                assert entry.turns.hits == hits + (turn > 0)  # every later turn continues the one before
                messages.append({"role": "assistant", "content": random_text(rng, [], rng.randint(20, 300))})
            text = render_chat_prompt(tok, messages[:-1])  # the last chat turn's prompt, as a completion
            completion = {"model": "m", "prompt": text}
            hits = entry.turns.hits
            got = await tokenize_request(off, entry, completion, "completions")
            assert list(got.tokens) == tokenize_request_sync(entry, completion, "completions")
            assert entry.turns.hits == hits

        try:
            asyncio.run(main())
        finally:
            off.close()
        assert off.offloaded == 0  # each turn's new text is short: the memo's inline path


def test_a_turn_encoded_on_the_thread_is_kept_and_the_next_turn_continues_it_on_the_loop(builtin) -> None:  # noqa: F811
    """A turn with more new text than the offload threshold is encoded on a tokenizer thread (from the turn it
    continues, if any) and remembered, so the next short turn is a memo hit on the loop (encoding what it adds,
    not joining and hashing the whole history again); a long chat turn alike. Every prompt's ids and hashes are
    the full encode's."""
    import asyncio
    import threading

    from frontend.routing.models import BusyThresholds, ModelEntry
    from frontend.routing.prompt import tokenize_request, tokenize_request_sync
    from kvroute_common.tokenize_offload import DEFAULT_OFFLOAD_CHARS, TokenizeOffload
    from slot_tracker.core import SlotRegistry

    rng = random.Random(41)
    entry = ModelEntry("m", BLOCK, builtin, SlotRegistry(), None, None, BusyThresholds())
    off = TokenizeOffload()
    memo = entry.turns
    encoders: list[str] = []
    encode = memo.encode

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        encoders.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    memo.encode = recording  # type: ignore[method-assign]
    big = DEFAULT_OFFLOAD_CHARS + 3000
    text = random_text(rng, [], big)  # new: the thread
    turns = [text, text + " a short question"]  # a hit on the loop
    turns.append(turns[-1] + " " + random_text(rng, [], big))  # a long tool output: the thread, continuing it
    turns.append(turns[-1] + " and a last question")  # a hit on the loop again
    chat = [{"role": "user", "content": random_text(rng, [], 2 * DEFAULT_OFFLOAD_CHARS)}]

    async def main() -> list[tuple[int, int, int]]:
        seen = []
        for prompt in turns:
            body = {"model": "m", "prompt": prompt}
            got = await tokenize_request(off, entry, body, "completions")
            assert list(got.tokens) == builtin(prompt)["input_ids"]
            local = local_block_hashes(list(got.tokens), BLOCK)
            assert (got.local_hashes, got.seq_hashes) == (local, sequence_hashes(local))
            if got.local_array is not None:
                assert got.local_array.tolist() == local
            seen.append((off.offloaded, memo.hits, memo.misses))
        for _ in range(2):  # a fresh chat turn on the thread, then the same conversation with a reply and a question
            body = {"model": "m", "messages": list(chat)}
            got = await tokenize_request(off, entry, body, "chat")
            assert list(got.tokens) == tokenize_request_sync(entry, body, "chat")
            seen.append((off.offloaded, memo.hits, memo.misses))
            chat.extend([{"role": "assistant", "content": "sure"}, {"role": "user", "content": "and then?"}])
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        off.close()
    # (offloaded, hits, misses) after each request
    assert seen == [(1, 0, 1), (1, 1, 1), (2, 2, 1), (2, 3, 1), (3, 3, 2), (3, 4, 2)]
    main_thread = threading.main_thread().name
    assert [name == main_thread for name in encoders] == [False, True, False, True, False, True]
    assert all(name.startswith("tokenize") for name in encoders if name != main_thread)


def test_a_session_through_the_frontend_hashes_as_the_engine_does(tmp_path) -> None:
    """Every turn of a conversation (one of them repeated) routed by a real frontend: the engine's own
    prompt length and its KV events agree with the router's ids and hashes (the hash-parity monitor
    saw matches and no mismatch), and the memo's counters on /metrics show each later turn continued the
    one before."""
    rng = random.Random(12)
    history = random_text(rng, [], 1500)  # the first turn under the offload threshold: encoded here, remembered
    with Cluster(log_dir=str(tmp_path / "logs")) as cluster:
        cluster.start_mocker(MockerOptions(speedup_ratio=50))
        cluster.wait_workers_ready(60)
        url = cluster.start_frontend(extra_args=["--send-token-ids", "never"])  # the engine tokenizes the text
        cluster.wait_frontend_ready()
        with httpx.Client(base_url=url, timeout=30) as client:
            for turn in range(4):
                history += "\n\nUser: " + random_text(rng, [], 400) + "\n\nAssistant:"
                for _ in range(2 if turn == 2 else 1):
                    body = {"model": DEFAULT_MODEL, "prompt": history, "max_tokens": 2}
                    r = client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                history += " " + r.json()["choices"][0]["text"]

            def parity() -> dict:
                rows = client.get("/admin/workers").json()["workers"]
                return rows[0].get("hash_parity") or {}

            assert wait_until(lambda: parity().get("matches", 0) >= 4, 30, what="hash-parity evidence")
            seen = parity()
            metrics = client.get("/metrics").text
        # the first turn is new; every later one (and the repeat) continued the one before
        assert f'kvroute_turn_memo_prompts_total{{model="{DEFAULT_MODEL}",result="hit"}} 4.0' in metrics
        assert f'kvroute_turn_memo_prompts_total{{model="{DEFAULT_MODEL}",result="miss"}} 1.0' in metrics
        assert seen["mismatches"] == 0 and "prompt_tokens_router_vs_engine" not in seen, seen
