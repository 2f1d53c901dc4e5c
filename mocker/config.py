"""Command-line flags of ``python -m mocker`` (vLLM's names where vLLM has the flag)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvroute_common.tokenizer import DEFAULT_MODEL_NAME
from mocker.gpu_profile import GpuProfile, shipped

ROLES = ("prefill", "decode", "both")
# which engine's discovery surface the mocker shows (its scheduler stays vLLM-like either way)
IMPERSONATE = ("vllm", "sglang")


@dataclass
class MockerConfig:
    host: str = "127.0.0.1"
    port: int = 8001
    model_path: str | None = None
    served_model_name: str = DEFAULT_MODEL_NAME
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    data_parallel_size: int = 1
    kv_events_endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5567"
    replay_buffer_steps: int = 10_000
    kv_events: bool = True
    speedup_ratio: float = 1.0
    perf_profile: str | None = None  # a GPU profile (shipped name or JSON file): step times from its tables
    seed: int | None = None
    log_level: str = "warning"
    timeout_keep_alive: int = 5
    stall_after_tokens: int | None = None
    server_info: bool = True
    role: str = "both"  # disaggregated serving: prefill | decode | both
    impersonate: str = "vllm"  # vllm | sglang: what /metrics, /v1/models and the server-info endpoint look like
    # LoRA adapters served beside the model, vLLM's NAME=PATH (the path is only listed: no weights)
    lora_modules: list[str] = field(default_factory=list)
    enable_lora: bool = False
    chat_template: str | None = None  # a template file or the template itself, instead of the tokenizer's
    enable_scale_out: bool = False  # vLLM's render routes: /v1/{chat/completions,completions,messages}/render

    def load_profile(self) -> GpuProfile | None:
        """The GPU profile named by --perf-profile (ValueError naming the problem), or None."""
        return None if self.perf_profile is None else GpuProfile.load(self.perf_profile)

    def adapters(self) -> dict[str, str]:
        """Adapter name -> path, in the order given (vLLM numbers them 1, 2, ... as lora_id)."""
        return {item.split("=", 1)[0]: item.split("=", 1)[1] for item in self.lora_modules}

    def validate(self) -> None:
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "data_parallel_size",
            "replay_buffer_steps",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.num_gpu_blocks < 2:
            raise ValueError("--num-gpu-blocks must be >= 2 (block 0 is the null block, as in vLLM)")
        if self.stall_after_tokens is not None and self.stall_after_tokens < 0:
            raise ValueError("--stall-after-tokens must be >= 0")
        if self.perf_profile is not None:
            self.load_profile()
        if self.speedup_ratio < 0:
            raise ValueError("--speedup-ratio must be >= 0 (0 = no simulated delay)")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}")
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name or not path or name == self.served_model_name:
                raise ValueError(f"--lora-modules {item!r}: give NAME=PATH, NAME not the served model's")
        if self.impersonate not in IMPERSONATE:
            raise ValueError(f"--impersonate must be one of {', '.join(IMPERSONATE)}")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be a TCP port")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mocker",
        description="Simulated vLLM-like engine: OpenAI API, paged prefix cache, vLLM-format ZMQ KV events.",
    )
    d = MockerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--model-path",
        "--model",
        "--tokenizer",
        dest="model_path",
        default=None,
        help="HF tokenizer directory (default: the built-in offline tokenizer)",
    )
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=None,
        help=f"KV blocks (default: what --perf-profile's GPU holds beside the weights, else {d.num_gpu_blocks})",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size)
    p.add_argument(
        "--kv-events-endpoint",
        default=d.kv_events_endpoint,
        help="ZMQ PUB endpoint of rank 0; rank r uses port + r (default %(default)s)",
    )
    p.add_argument(
        "--replay-endpoint",
        default=d.replay_endpoint,
        help="ZMQ ROUTER replay endpoint of rank 0; rank r uses port + r ('' = none)",
    )
    p.add_argument(
        "--replay-buffer-steps",
        type=int,
        default=d.replay_buffer_steps,
        help="batches kept per rank for replay (vLLM's buffer_steps)",
    )
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false", help="publish no KV events")
    p.add_argument(
        "--speedup-ratio",
        type=float,
        default=d.speedup_ratio,
        help="divide simulated step times by this (0 = no delay)",
    )
    p.add_argument(
        "--perf-profile",
        default=None,
        metavar="PROFILE",
        help="time steps from a GPU's measured tables instead of the default polynomial: a JSON file or a "
        f"shipped profile ({', '.join(shipped())}); every prefill chunk by its new and cached tokens, decodes by "
        "batch and context",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="fixes generated tokens' randomness and the external block hashes"
    )
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=d.timeout_keep_alive,
        help="seconds an idle HTTP keep-alive connection stays open (uvicorn's and vLLM's default: 5)",
    )
    p.add_argument(
        "--stall-after-tokens",
        type=int,
        default=None,
        metavar="N",
        help="test-only fault: every response stops after N generated tokens (a stream sends nothing more, a "
        "non-streaming request never answers) and keeps its connection open until the client goes away",
    )
    p.add_argument(
        "--no-server-info",
        dest="server_info",
        action="store_false",
        help="do not serve GET /server_info (like vLLM without VLLM_SERVER_DEV_MODE=1: the scheduler "
        "budget, max_num_batched_tokens, is then exposed nowhere)",
    )
    p.add_argument(
        "--role",
        default=d.role,
        choices=ROLES,
        help="disaggregated serving (vLLM NIXL kv_transfer_params): prefill = computes prompts for remote "
        "decode and answers with transfer params; decode = takes transferred prompt blocks without "
        "computing them; both = either (default)",
    )
    p.add_argument(
        "--impersonate",
        default=d.impersonate,
        choices=IMPERSONATE,
        help="which engine the mocker looks like to discovery: vllm (default: vllm:* metrics plus "
        "kvroute_mocker_info, /server_info) or sglang (sglang:* metrics, owned_by sglang, SGLang's "
        "GET /get_server_info); the engine inside stays the same",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served beside the model (vLLM's syntax): listed in /v1/models with the model as "
        "parent; their requests' blocks are keyed by the adapter (lora_name in the KV events)",
    )
    p.add_argument("--enable-lora", action="store_true", help="accepted for vLLM compatibility (no effect)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="chat template (a file, or the template itself) used instead of the tokenizer's, as vLLM's flag",
    )
    p.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve vLLM's render routes (/v1/chat/completions/render, /v1/completions/render, /v1/messages/render): "
        "the token ids a request would be computed from, without running it",
    )
    return p


def parse_args(argv: list[str] | None = None) -> MockerConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = MockerConfig(**{k: v for k, v in vars(ns).items() if v is not None or k != "num_gpu_blocks"})
    if cfg.replay_endpoint == "":
        cfg.replay_endpoint = None
    try:
        profile = cfg.load_profile()
        if ns.num_gpu_blocks is None and profile is not None:  # block 0 is the null block, as in vLLM
            cfg.num_gpu_blocks = profile.kv_capacity_tokens() // cfg.block_size + 1
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg
