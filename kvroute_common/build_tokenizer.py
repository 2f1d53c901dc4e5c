"""Build the built-in offline tokenizer shipped in ``kvroute_common/tokenizer_data/``.

The product must run with no download, so kvroute ships its own small byte-level BPE tokenizer
(GPT-2-like pre-tokenisation, 16k vocabulary) with a ChatML-like chat template. It is trained
with the ``tokenizers`` library on text every Python installation carries: the Python
documentation topics (``pydoc_data/topics.py``, English prose) plus the top-level standard-library
modules (code and docstrings), read in sorted order so a rebuild on the same Python version gives
byte-identical files. The build records the Python version and a corpus digest in
``tokenizer_config.json`` (``kvroute_build``).

Run ``python -m kvroute_common.build_tokenizer`` (``--out DIR`` to write elsewhere, ``--check``
to verify that the committed files are what this script produces).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from typing import Any

VOCAB_SIZE = 16384
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|im_end|>"  # end of an assistant turn = end of generation for chat
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
END_OF_TEXT = "<|endoftext|>"
# ids 0..4, in this order
SPECIAL_TOKENS = [END_OF_TEXT, BOS_TOKEN, IM_START, EOS_TOKEN, PAD_TOKEN]

# ChatML with a BOS at the start (the template is expected to carry BOS: vLLM encodes the rendered
# prompt with add_special_tokens=False). Content may be a string or OpenAI content parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('\\n') %}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pre-tokenisation (GPT-2 style, ASCII classes): an optional space + letters | digits | other
# non-space characters, whitespace runs that leave the last space to the next word, other whitespace.
# Every character class is spelled out (no \\s, \\p{L}) so Python's ``re`` splits text exactly like
# the tokenizer's Oniguruma regex: kvroute_common.tokenizer uses that for its fast cached encoder.
PRETOKENIZE_PATTERN = r" ?[A-Za-z]+| ?[0-9]+| ?[^ \t\r\nA-Za-z0-9]+|[ \t\r\n]+(?![^ \t\r\n])|[ \t\r\n]+"

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_data")


def corpus_files() -> list[str]:
    """The training text: Python's documentation topics, then the top-level stdlib modules."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, "pydoc_data", "topics.py")]
    files += sorted(glob.glob(os.path.join(stdlib, "*.py")))
    return [f for f in files if os.path.isfile(f)]


def corpus_lines(files: list[str]) -> list[str]:
    lines: list[str] = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines.extend(fh.read().splitlines())
    return lines


def build(out_dir: str) -> dict:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = corpus_files()
    lines = corpus_lines(files)
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    bos_id = tok.token_to_id(BOS_TOKEN)
    # plain encode (completions) adds BOS, like Llama-family tokenizers; the chat template carries its own
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [END_OF_TEXT, IM_START],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "kvroute_build": {
            "script": "python -m kvroute_common.build_tokenizer",
            "python": ".".join(map(str, sys.version_info[:3])),
            "corpus_files": len(files),
            "corpus_sha256": digest,
            "vocab_size": tok.get_vocab_size(),
            "pretokenize_pattern": PRETOKENIZE_PATTERN,
        },
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [END_OF_TEXT, IM_START],
    }
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as fh:
        json.dump(special_map, fh, indent=2)
        fh.write("\n")
    return config["kvroute_build"]


def _file_digests(directory: str) -> dict[str, str]:
    out = {}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        with open(os.path.join(directory, name), "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: the shipped tokenizer_data)")
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            info = build(tmp)
            same = _file_digests(tmp) == _file_digests(args.out)
        print(json.dumps({**info, "identical": same}))
        return 0 if same else 1
    info = build(args.out)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
