"""Write a tiny random-weight Llama that uses kvroute's built-in tokenizer, for real engines in tests
and benchmarks: router and engine then share tokenizer and chat template, and nothing is downloaded.

Run with the Python of an environment that has torch and transformers (vLLM's), not kvroute's:

    python kvroute_common/real_engines/tiny_model.py --out DIR [--lora NAME ...]

This file imports nothing from kvroute, so it runs from its path in that other environment.
``--lora NAME`` also writes a PEFT LoRA adapter for the model in ``DIR/loras/NAME`` (random, rank 8,
on the attention projections): enough for an engine to serve it as a distinct model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tokenizer_data")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# 2 layers, hidden 256: about 10 M parameters, a few ms per step on a CPU
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "vocab_size": 16384,
}
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_model(out: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    vocab = json.load(open(os.path.join(TOKENIZER_DIR, "tokenizer.json"), encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=CONFIG["hidden_size"],
        intermediate_size=CONFIG["intermediate_size"],
        num_hidden_layers=CONFIG["num_hidden_layers"],
        num_attention_heads=CONFIG["num_attention_heads"],
        num_key_value_heads=CONFIG["num_key_value_heads"],
        max_position_embeddings=CONFIG["max_position_embeddings"],
        vocab_size=CONFIG["vocab_size"],
        bos_token_id=ids[tok_cfg["bos_token"]],
        eos_token_id=ids[tok_cfg["eos_token"]],
        pad_token_id=ids[tok_cfg["pad_token"]],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(TOKENIZER_DIR, name), os.path.join(out, name))


def write_lora(model_dir: str, name: str, seed: int) -> str:
    import torch
    from safetensors.torch import save_file

    out = os.path.join(model_dir, "loras", name)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    kv = CONFIG["num_key_value_heads"] * head_dim
    out_dims = {"q_proj": CONFIG["hidden_size"], "k_proj": kv, "v_proj": kv, "o_proj": CONFIG["hidden_size"]}
    tensors = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, CONFIG["hidden_size"], generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[target], LORA_RANK, generator=gen) * 0.02
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with open(os.path.join(out, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="append", default=[], metavar="NAME")
    args = p.parse_args()
    write_model(args.out, args.seed)
    for i, name in enumerate(args.lora):
        write_lora(args.out, name, args.seed + 1 + i)
    print(args.out)


if __name__ == "__main__":
    main()
