"""Write a tiny random-weight vision-language model shaped like Idefics3 / SmolVLM that uses kvroute's
built-in tokenizer plus Idefics3's image tokens, for real multimodal engines in tests and benchmarks.

Run with the Python of an environment that has torch and transformers (vLLM's), not kvroute's:

    python kvroute_common/real_engines/tiny_vlm.py --out DIR

This file imports nothing from kvroute, so it runs from its path in that other environment. It writes
what an Idefics3 checkpoint holds: ``config.json`` and weights (a 2-layer Llama of hidden 256 and a
2-layer SigLIP-style vision tower of width 64 reading 64x64 tiles in 8x8 patches, 16 image tokens per
tile after the 2x pixel shuffle), ``tokenizer.json`` (the built-in vocabulary, then ``<image>``,
``<fake_token_around_image>``, ``<global-img>``, ``<end_of_utterance>`` and the ``<row_R_col_C>`` tile
tags appended), ``tokenizer_config.json`` with a chat template that renders an image part as ``<image>``,
and the processor configs: images are split into 64-pixel tiles after scaling the longest edge to at
most 256, so an image becomes 1-17 tiles (16-272 placeholder tokens) and a CPU encodes it in
milliseconds. Qwen2-VL would be the other obvious shape; its processor needs torchvision, which the CPU
build of torch on these machines has no matching wheel for.
"""

from __future__ import annotations

import argparse
import json
import os

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tokenizer_data")
IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
TILE_TAGS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
TILE = 64  # the vision tower's input side and the processor's tile side
LONGEST_EDGE = 4 * TILE
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
# vLLM hands OpenAI image parts to a template as {"type": "image"}; text parts render in order.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tokenizer(out: str) -> dict[str, int]:
    """The built-in tokenizer with the image tokens appended as special tokens; returns every special id."""
    with open(os.path.join(TOKENIZER_DIR, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    next_id = len(tok["model"]["vocab"])
    for content in IMAGE_TOKENS + TILE_TAGS:
        tok["added_tokens"].append(
            {
                "id": next_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        next_id += 1
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg.pop("kvroute_build", None)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["additional_special_tokens"] = list(cfg.get("additional_special_tokens", [])) + list(IMAGE_TOKENS)
    cfg["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tok["added_tokens"]}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1, ensure_ascii=False)
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token")}
    special["additional_special_tokens"] = cfg["additional_special_tokens"]
    with open(os.path.join(out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=1)
    return ids


def write_processor(out: str) -> None:
    image = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": TILE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    with open(os.path.join(out, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(image, f, indent=1)
    with open(os.path.join(out, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}, f, indent=1)


def write_model(out: str, seed: int = 0) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    ids = write_tokenizer(out)
    write_processor(out)
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    torch.manual_seed(seed)
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            **TEXT,
            "num_key_value_heads": 2,
            "vocab_size": (max(ids.values()) + 1 + 63) // 64 * 64,
            "max_position_embeddings": 8192,
            "bos_token_id": ids[tok_cfg["bos_token"]],
            "eos_token_id": ids[tok_cfg["eos_token"]],
            "pad_token_id": ids[tok_cfg["pad_token"]],
            "tie_word_embeddings": True,
        },
        vision_config={**VISION, "num_channels": 3, "image_size": TILE, "patch_size": PATCH},
        scale_factor=SCALE_FACTOR,
        image_token_id=ids["<image>"],
        tie_word_embeddings=True,
    )
    config.pad_token_id = ids[tok_cfg["pad_token"]]
    model = Idefics3ForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="only the tokenizer and processor files (what a router or a mocker reads; needs no torch)",
    )
    args = p.parse_args()
    if args.no_weights:
        write_tokenizer(args.out)
        write_processor(args.out)
    else:
        write_model(args.out, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
