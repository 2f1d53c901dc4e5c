"""The router's text path alone, per request of a session workload: tokenize (and hash) every prompt of the
schedule in arrival order, as the frontend does, with and without the chunk cache and the turn memo.

Why: ``python -m bench peers`` measures a router's whole CPU per request; this isolates the part that
grows with the history a multi-turn prompt repeats (issue 28). Prompts above the frontend's offload
threshold take the worker-thread path (``nogil``: the backend's GIL-free encode), the others the inline
path, so both are measured. Each variant gets a fresh encoder (empty caches); the ids are checked equal.
The turn-memo row is what the frontend does for completions prompts: a prompt that continues a
remembered one reuses its ids and block hashes (frontend/routing/turn_memo.py).
``--backend-only`` encodes new text with the tokenizer's backend, as for tokenizers without the ``re``
fast path (an HF Llama-3 tokenizer).

``--idle-gap-ms G`` adds a row: the chunk-cache path with the thread idle for G ms before each prompt,
as a router between requests at light load is. On a virtual CPU that halts when idle, the same work
then costs several times its back-to-back CPU time (cold caches and branch predictors after the
halt): the cost a request pays on an idle router's critical path.

``--evict-mb M`` adds a row: the turn-memo path with M MB written before each prompt, which evicts the CPU
caches as a loaded router's other work (the relay of every other stream, KV events) does between two
requests: the cost a request's tokenization adds to its time to first token under load.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from bench.sessions import WORKLOADS, session_trace
from frontend.routing.prompt import MEMO_MAX_CHARS
from frontend.routing.turn_memo import TurnMemo
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from kvroute_common.tokenize_offload import DEFAULT_OFFLOAD_CHARS
from kvroute_common.tokenizer import PromptEncoder, load_tokenizer

CACHE_LINE = 64


def run(
    encoder: PromptEncoder,
    prompts: list[str],
    block_size: int,
    offload_chars: int,
    idle_gap_s: float = 0.0,
    turns: bool = False,
    evict: bytearray | None = None,
) -> tuple[list[float], list]:
    """CPU ms per prompt (tokenize + block and sequence hashes) and the ids; ``idle_gap_s``: the thread
    sleeps that long before each prompt; ``turns``: inline prompts through a turn memo, as the frontend
    encodes completions prompts (frontend/routing/turn_memo.py); ``evict``: a buffer written whole (a byte a
    cache line) before each prompt."""
    per: list[float] = []
    out = []
    memo = TurnMemo(encoder, block_size, None) if turns else None
    for text in prompts:
        if idle_gap_s:
            time.sleep(idle_gap_s)
        if evict is not None:
            evict[::CACHE_LINE] = bytes(len(evict) // CACHE_LINE)
        t0 = time.thread_time()
        nogil = 0 < offload_chars < len(text)
        ids: Sequence[int]
        if memo is not None and not nogil and memo.usable(text, MEMO_MAX_CHARS):
            ids = memo.prompt(text, None).ids
        else:
            ids = encoder.encode(text, add_special_tokens=True, nogil=nogil)
            sequence_hashes(local_block_hashes(ids, block_size))
        per.append(1000 * (time.thread_time() - t0))
        out.append(list(ids))  # the memo's are a u32 array: compared as lists
    return per, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench text_path", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="agentic", choices=sorted(WORKLOADS))
    ap.add_argument("--model-path", default=None, help="an HF tokenizer directory (default: the built-in one)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--offload-chars", type=int, default=DEFAULT_OFFLOAD_CHARS)
    ap.add_argument("--rounds", type=int, default=3, help="each variant this many times, alternating")
    ap.add_argument(
        "--idle-gap-ms",
        type=float,
        default=0.0,
        help="also the chunk-cache path with the thread idle this long before each prompt (0: not measured)",
    )
    ap.add_argument(
        "--backend-only",
        action="store_true",
        help="new text through the backend's encode, never the re fast path: what an HF tokenizer whose "
        "pattern Python's re cannot run (Llama-3's \\p classes) costs",
    )
    ap.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="also the turn-memo path with this many MB written before each prompt, evicting the CPU caches "
        "as a loaded router's other work does (0: not measured)",
    )
    args = ap.parse_args(argv)
    trace = session_trace(WORKLOADS[args.workload], tokenizer_path=args.model_path)
    prompts = [r.text for r in trace.requests if r.text is not None]
    tok = load_tokenizer(args.model_path)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    mean = sum(map(len, prompts)) / len(prompts)
    print(f"load average {load}; {len(prompts)} prompts, mean {mean:.0f} chars; offload above {args.offload_chars}")
    results: dict[str, list[float]] = {"whole prompts": [], "chunk cache": [], "chunk cache + turn memo": []}
    idle_row = f"chunk cache, idle {args.idle_gap_ms:g} ms before each"
    if args.idle_gap_ms > 0:
        results[idle_row] = []
    evict_row = f"chunk cache + turn memo, {args.evict_mb} MB evicted before each"
    if args.evict_mb > 0:
        results[evict_row] = []
    evict = bytearray(args.evict_mb * 1024 * 1024) if args.evict_mb > 0 else None
    reference = None
    for _ in range(args.rounds):
        for name in results:
            enc = PromptEncoder(tok)
            if args.backend_only:
                enc.piece_re = None
            if name == "whole prompts":
                enc.cuts = None
            gap = args.idle_gap_ms / 1000 if name == idle_row else 0.0
            turns = name in ("chunk cache + turn memo", evict_row)
            per, ids = run(
                enc, prompts, args.block_size, args.offload_chars, gap, turns, evict if name == evict_row else None
            )
            if reference is None:
                reference = ids
            elif ids != reference:
                raise SystemExit(f"{name}: different ids")
            results[name].append(sum(per) / len(per))
    print("| text path | CPU ms / request (tokenize + hash), each round |")
    print("| --- | --- |")
    for name, rounds in results.items():
        print(f"| {name} | {' / '.join(f'{r:.2f}' for r in rounds)} |")
    return 0
