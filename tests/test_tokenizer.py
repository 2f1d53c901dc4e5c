"""The built-in offline tokenizer and the shared vLLM-style prompt tokenisation."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kvroute_common import tokenizer as T
from kvroute_common.tokenizer import (
    BUILTIN_TOKENIZER_DIR,
    DEFAULT_MODEL_NAME,
    PromptError,
    chat_prompt_token_ids,
    completion_prompt_token_ids,
    load_tokenizer,
    prompt_encoder,
    render_chat_prompt,
)
from support import REPO_ROOT


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_builtin_files_are_small_and_complete():
    names = set(os.listdir(BUILTIN_TOKENIZER_DIR))
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    total = sum(os.path.getsize(os.path.join(BUILTIN_TOKENIZER_DIR, n)) for n in names)
    assert total < 1_500_000
    cfg = json.load(open(os.path.join(BUILTIN_TOKENIZER_DIR, "tokenizer_config.json")))
    assert cfg["chat_template"] and cfg["bos_token"] and cfg["eos_token"] and cfg["pad_token"]
    assert DEFAULT_MODEL_NAME == "kvroute-demo"


def test_loads_as_fast_tokenizer_with_special_tokens(tok):
    assert tok.is_fast
    assert 8000 <= len(tok) <= 16384
    assert tok.bos_token == "<|startoftext|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    ids = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>")}
    assert len(ids) == 4 and None not in ids
    assert load_tokenizer(None) is tok  # cached


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x ** 2  # square\n\n\n",
        "Ünïcödé — 日本語のテキスト, emoji 😀🚀 and € signs",
        "   leading and trailing spaces   ",
        "tabs\tand\r\nCRLF\r\n",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert prompt_encoder(tok).encode(text) == ids


def test_compresses_english_text(tok):
    text = "The router picks the worker with the lowest cost for every request it receives. " * 20
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) / 3.5


def test_chat_template_renders_chatml(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert render_chat_prompt(tok, msgs) == (
        "<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat_prompt(tok, msgs, add_generation_prompt=False).endswith("Hi there<|im_end|>\n")


def test_chat_content_parts_joined_with_newline_like_vllm(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    plain = [{"role": "user", "content": "a\nb"}]
    assert render_chat_prompt(tok, parts) == render_chat_prompt(tok, plain)


def test_chat_token_ids_match_transformers(tok):
    msgs = [
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "A cache."},
        {"role": "user", "content": "Tell me more <|im_end|> please"},
    ]
    ids = chat_prompt_token_ids(tok, msgs)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # BOS from the template only
    tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(tail) :] == tail


def test_chat_request_body_arguments_like_vllm(tok):
    from kvroute_common.tokenizer import chat_request_token_ids, chat_template_kwargs

    msgs = [{"role": "user", "content": "hi"}]
    assert chat_request_token_ids(tok, {"messages": msgs}) == chat_prompt_token_ids(tok, msgs)
    no_gen = chat_request_token_ids(tok, {"messages": msgs, "add_generation_prompt": False})
    assert no_gen == chat_prompt_token_ids(tok, msgs, add_generation_prompt=False) != chat_prompt_token_ids(tok, msgs)
    # explicit fields (and their defaults) win over chat_template_kwargs unless null or "auto"; tools stay
    # with tool_choice "none" (vLLM's default, --exclude-tools-when-tool-choice-none off)
    fn = {"name": "ls"}
    kw = chat_template_kwargs(
        {
            "chat_template_kwargs": {"add_generation_prompt": True, "x": 1, "continue_final_message": True},
            "add_generation_prompt": False,
            "tools": [{"type": "function", "function": fn}],
            "tool_choice": "none",
        }
    )
    assert kw == {
        "add_generation_prompt": False,
        "continue_final_message": False,
        "x": 1,
        "tools": [
            {
                "type": "function",
                "function": {"name": "ls", "description": None, "parameters": None},
            }
        ],
    }
    assert chat_template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False}})["add_generation_prompt"]
    assert chat_template_kwargs({"tools": []})["tools"] == []  # an Anthropic request's (OpenAI's are refused)
    thinking = chat_template_kwargs({"reasoning_effort": "low", "documents": None})
    assert thinking["reasoning_effort"] == "low" and thinking["enable_thinking"] is True and "documents" not in thinking
    assert chat_template_kwargs({"reasoning_effort": "none"})["enable_thinking"] is False
    assert (
        chat_template_kwargs({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})[
            "enable_thinking"
        ]
        is False
    )
    assert "reasoning_effort" not in chat_template_kwargs({"reasoning_effort": "auto"})
    assert chat_template_kwargs({"chat_template": "{{ 1 }}"})["chat_template"] == "{{ 1 }}"
    bad_bodies = [
        {"messages": msgs, "chat_template_kwargs": 3},
        {"messages": msgs, "add_generation_prompt": "no"},
        {},
        {"messages": msgs, "tools": {"name": "ls"}},
        {"messages": msgs, "tools": [{"type": "function"}]},
        {"messages": msgs, "tools": [{"type": "retrieval", "function": fn}]},
        {"messages": msgs, "tools": [{"function": {"name": "ls", "parameters": "none"}}]},
        {"messages": msgs, "chat_template": 7},
    ]
    for bad in bad_bodies:
        with pytest.raises(PromptError):
            chat_request_token_ids(tok, bad)


def test_completion_prompts(tok):
    ids = completion_prompt_token_ids(tok, "Hello world")
    assert ids == tok("Hello world")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert completion_prompt_token_ids(tok, [5, 6, 7]) == [5, 6, 7]
    assert completion_prompt_token_ids(tok, ["Hello world"]) == ids
    assert completion_prompt_token_ids(tok, [[9, 10]]) == [9, 10]
    for bad in ([], [1, -1], [1, len(tok)], [1, "x"], ["a", "b"], 42, None, [[1], [2]], "lone \ud800 surrogate"):
        with pytest.raises(PromptError):
            completion_prompt_token_ids(tok, bad)


def test_bad_messages_rejected(tok):
    for bad in (
        [],
        "hi",
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}],
        [{"role": "user", "content": [{"type": {}, "text": ""}]}],
        [{"role": "user", "content": ["just a string"]}],
    ):
        with pytest.raises(PromptError):
            chat_prompt_token_ids(tok, bad)


def test_media_parts_of_a_text_model_are_routed_on_the_text(tok):
    text_only = [{"role": "user", "content": [{"type": "text", "text": "look"}]}]
    for kind, part in (
        ("image_url", {"image_url": {"url": "https://example.com/a.png"}}),
        ("input_audio", {"input_audio": {"data": "", "format": "wav"}}),
        ("video_url", {"video_url": {"url": "https://example.com/a.mp4"}}),
    ):
        with_media = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": kind, **part}]}]
        assert chat_prompt_token_ids(tok, with_media) == chat_prompt_token_ids(tok, text_only)


def test_fast_encoder_is_exact_on_random_text(tok):
    enc = prompt_encoder(tok)
    assert enc.fast
    rng = random.Random(7)
    alphabet = list("abc XYZ019\t\n\r  .,;'\"()<>|_-ünï☃€😀") + [
        "<|im_start|>",
        "<|im_end|>",
        "<|startoftext|>",
        "<|endoftext|>",
        "<|pad|>",
        "<|im_",
        "  \n",
        "\r\n",
        "word ",
    ]
    for _ in range(1500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        for special in (False, True):
            assert enc.encode(s, special) == tok(s, add_special_tokens=special)["input_ids"], repr(s)
    long = "".join(rng.choice(alphabet) for _ in range(3000))
    assert enc.encode(long) == enc.encode(long) == tok(long, add_special_tokens=False)["input_ids"]  # segment cache


def test_unseen_pieces_get_the_bpe_models_merges_exactly_as_the_backend_encodes_them(tok):
    """A piece the cache has not seen goes through the BPE model's own merges on its byte-level
    characters: for every vocabulary entry and for random pieces (multi-byte characters, control bytes,
    whitespace runs) the ids are the backend's; a model that disagrees on the self-check is not used."""
    enc = T.PromptEncoder(tok)
    assert enc._bpe is not None
    backend = tok.backend_tokenizer
    rng = random.Random(3)
    alphabet = list("abcXYZ019 \t\n\r.,;'\"()<>|_-ünï☃€😀\x00\x7f\u00a0")
    pieces = [tok.convert_tokens_to_string([t]) for t in backend.get_vocab()]
    pieces += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(2000)]
    for text in pieces:
        for piece in enc.piece_re.findall(text):
            assert enc._piece_ids(piece) == backend.encode(piece, add_special_tokens=False).ids, repr(piece)

    class WrongModel:  # merges nothing: every byte its own token
        def __init__(self, model) -> None:
            self.tokenize = lambda s: [model.tokenize(c)[0] for c in s]

    class Backend:  # the real backend with that model
        def __init__(self, real) -> None:
            self.real, self.model = real, WrongModel(real.model)

        def __getattr__(self, name):
            return getattr(self.real, name)

    fake = T.PromptEncoder.__new__(T.PromptEncoder)
    fake.__dict__.update(enc.__dict__)
    fake.backend, fake._bpe = Backend(backend), None
    fake._setup_fast_path(json.loads(backend.to_str()))
    assert fake._bpe is None and fake.piece_re is not None  # the self-check caught it; the fast path stays


def test_loads_offline_without_network(tmp_path):
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
    )
    code = (
        "from kvroute_common.tokenizer import load_tokenizer, chat_prompt_token_ids as c;"
        "t=load_tokenizer(None); print(len(c(t,[{'role':'user','content':'hi'}])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) > 5


def test_load_from_explicit_directory(tmp_path):
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(BUILTIN_TOKENIZER_DIR, d)
    t2 = load_tokenizer(str(d))
    assert t2.encode("hello there") == load_tokenizer(None).encode("hello there")


def test_build_script_reproduces_committed_files():
    cfg = json.load(open(os.path.join(BUILTIN_TOKENIZER_DIR, "tokenizer_config.json")))
    built_with = cfg["kvroute_build"]["python"]
    if built_with != ".".join(map(str, sys.version_info[:3])):
        pytest.skip(f"tokenizer built with Python {built_with}; the corpus is this Python's stdlib")
    out = subprocess.run(
        [sys.executable, "-m", "kvroute_common.build_tokenizer", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["identical"] is True


def test_module_exports():
    for name in ("load_tokenizer", "chat_prompt_token_ids", "completion_prompt_token_ids", "DEFAULT_MODEL_NAME"):
        assert hasattr(T, name)


def test_an_obviously_over_long_text_is_refused_from_a_partial_count() -> None:
    """On the tokenizer thread (nogil) a text far over the limit is counted in pieces and refused once the
    pieces hold the limit (a lower bound, not the whole count); one that fits is encoded whole, exactly."""
    from kvroute_common.tokenizer import EARLY_STOP_CHARS, PromptTooLong, load_tokenizer, prompt_encoder

    enc = prompt_encoder(load_tokenizer(None))
    text = "hello " * (EARLY_STOP_CHARS // 3)  # ~87k tokens over ~2 pieces
    whole = enc.encode(text, nogil=True)
    assert enc.encode(text, nogil=True, limit=len(whole) + 1) == whole  # fits: exact ids
    limit = len(whole) // 3
    with pytest.raises(PromptTooLong) as exc:
        enc.encode(text, nogil=True, limit=limit)
    assert not exc.value.exact and limit <= exc.value.n_tokens <= len(whole)
    assert "at least" in str(exc.value)


def test_tools_reach_the_template_as_vllms_request_model_dumps_them():
    """A template that prints its tools sees vLLM's pydantic dump, not the client's JSON: nulls for a
    missing description or parameters, ``strict``/``defer_loading`` only when set, other keys dropped
    (the shapes checked against vLLM 0.32's request model)."""
    from kvroute_common.tokenizer import engine_tool_dicts

    params = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": "a"}, "x-vendor": "dropped"},
        {"function": {"name": "b", "description": "B", "parameters": params, "strict": True, "extra": 1}},
        {"type": "function", "function": {"name": "c"}, "defer_loading": True},
        {"type": "function", "function": {"name": "d", "strict": False}, "defer_loading": False},
    ]
    assert engine_tool_dicts(tools) == [
        {"type": "function", "function": {"name": "a", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "b", "description": "B", "parameters": params, "strict": True}},
        {
            "type": "function",
            "function": {"name": "c", "description": None, "parameters": None, "defer_loading": True},
            "defer_loading": True,
        },
        {
            "type": "function",
            "function": {"name": "d", "description": None, "parameters": None, "strict": False, "defer_loading": False},
            "defer_loading": False,
        },
    ]
    assert list(engine_tool_dicts(tools)[2]["function"]) == ["name", "description", "parameters", "defer_loading"]


def test_loading_a_tokenizer_renders_its_chat_template_once_so_the_first_chat_request_does_not() -> None:
    """The template's compile happens at load (off the event loop), not on the first chat request."""
    code = (
        "from transformers.utils.chat_template_utils import _compile_jinja_template as compiled\n"
        "from kvroute_common.tokenizer import load_tokenizer\n"
        "assert compiled.cache_info().currsize == 0\n"
        "load_tokenizer(None)\n"
        "print(compiled.cache_info().currsize)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "1"
