"""Request traces for the replay benchmark: the Mooncake traces, scaling, and the prefix-reuse oracle.

A trace is a fixed schedule of token-id prompts. Mooncake traces describe prompts as ids of 512-token
blocks (equal id at equal position = identical prefix); each id is turned into deterministic tokens
with a generator seeded by (seed, id), so equal ids always give equal tokens and every router mode
replays byte-identical requests. Everything that makes the trace fit this small machine (time window,
rate, tokens per trace block, output length) is recorded in :class:`Scaling` and printed with the
results, so a number is never shown without how it was obtained.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvroute_common.hashing import block_hashes

MOONCAKE_BLOCK_TOKENS = 512
# Token ids drawn for synthetic content: inside the offline tokenizer's 16k vocabulary (and any real one), clear of
# the low special ids.
VOCAB_LOW = 1000
VOCAB_HIGH = 16000
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Mooncake traces ship with the repository (bench/data/, gzip-compressed; source, license and
# checksums in bench/data/README.md), so the benchmark needs nothing outside the clone.
VENDORED_TRACES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TRACES_DIR = VENDORED_TRACES_DIR
MOONCAKE_TRACES = {"conversation": "conversation_trace.jsonl", "mooncake_synthetic": "synthetic_trace.jsonl"}
# sha256 of the uncompressed JSONL: byte-identical to kvcache-ai/Mooncake FAST25-release/traces/
MOONCAKE_SHA256 = {
    "conversation_trace.jsonl": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    "synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
}


def find_trace(name: str, traces_dir: str = DEFAULT_TRACES_DIR) -> str | None:
    """Path of a built-in trace (``conversation``, ``mooncake_synthetic``) or a file name in
    ``traces_dir``, plain ``.jsonl`` or ``.jsonl.gz``; None when neither exists."""
    fname = MOONCAKE_TRACES.get(name, name)
    for candidate in (os.path.join(traces_dir, fname), os.path.join(traces_dir, fname + ".gz")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _open_text(path: str):
    """Text reader for ``.jsonl`` and gzip-compressed ``.jsonl.gz`` (by the gzip magic, not the name)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def trace_sha256(path: str) -> str:
    """sha256 of a trace's uncompressed bytes (the same for ``x.jsonl`` and ``x.jsonl.gz``)."""
    h = hashlib.sha256()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a schedule: when to send it (seconds from replay start) and what.

    ``tokens`` is the prompt as the engine sees it (the oracle's input). A request with ``text`` is sent
    as that text prompt to /v1/completions, one with ``messages`` to /v1/chat/completions (routers that
    read text must see text); ``tokens`` is then the engine's tokenization of it.
    """

    index: int
    arrival_s: float
    tokens: list[int]
    max_tokens: int
    session: int | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Trace:
    name: str
    requests: list[TraceRequest]
    scaling: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def summary(self) -> dict:
        n = len(self.requests)
        prompt = [len(r.tokens) for r in self.requests]
        out = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "requests": n,
            "span_s": round(self.duration_s, 2),
            "rate_rps": round(n / self.duration_s, 2) if self.duration_s > 0 else None,
            "mean_prompt_tokens": round(sum(prompt) / n, 1) if n else 0,
            "max_prompt_tokens": max(prompt, default=0),
            "mean_output_tokens": round(sum(out) / n, 1) if n else 0,
        }


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a Mooncake trace is shrunk to this machine (all stated in the benchmark output).

    * ``start_s``/``window_s``: the slice of trace time replayed (seconds of the original trace);
    * ``rate_scale``: arrival times divided by this (2.0 = the slice is replayed twice as fast);
    * ``tokens_per_block``: tokens generated per 512-token trace block (lengths scale by tokens_per_block/512);
    * ``max_prompt_tokens``: longer scaled prompts are cut (prefix kept, so reuse structure survives);
    * ``output_scale``/``max_output_tokens``: generated tokens = clamp(round(output_length * scale), 1, max);
    * ``max_requests``: stop after this many requests of the window.
    """

    start_s: float = 0.0
    window_s: float | None = 60.0
    rate_scale: float = 1.0
    tokens_per_block: int = 32
    max_prompt_tokens: int | None = 4096
    output_scale: float = 0.1
    max_output_tokens: int = 32
    max_requests: int | None = None

    def describe(self) -> str:
        window = f"{self.window_s:g} s" if self.window_s is not None else "all"
        parts = [
            f"trace time [{self.start_s:g} s, +{window}] replayed {self.rate_scale:g}x faster",
            f"each 512-token trace block -> {self.tokens_per_block} tokens (lengths "
            f"x{self.tokens_per_block / MOONCAKE_BLOCK_TOKENS:g})",
        ]
        if self.max_prompt_tokens:
            parts.append(f"prompts cut to {self.max_prompt_tokens} tokens")
        parts.append(f"output tokens = clamp(output_length x {self.output_scale:g}, 1, {self.max_output_tokens})")
        if self.max_requests:
            parts.append(f"first {self.max_requests} requests")
        return "; ".join(parts)


class BlockTokens:
    """Deterministic token content per Mooncake hash id: same (seed, id) -> same tokens, always."""

    def __init__(self, tokens_per_block: int, seed: int = 0, low: int = VOCAB_LOW, high: int = VOCAB_HIGH) -> None:
        self.tokens_per_block = tokens_per_block
        self.seed = seed
        self.low = low
        self.high = high
        self._cache: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        toks = self._cache.get(hash_id)
        if toks is None:
            rng = np.random.default_rng([self.seed, int(hash_id)])
            toks = rng.integers(self.low, self.high, size=self.tokens_per_block).tolist()
            self._cache[hash_id] = toks
        return toks

    def prompt(self, hash_ids: Sequence[int], n_tokens: int) -> list[int]:
        """Concatenated blocks, the last one cut so the prompt has exactly ``n_tokens`` tokens."""
        out: list[int] = []
        for hid in hash_ids:
            if len(out) >= n_tokens:
                break
            out.extend(self(hid))
        del out[n_tokens:]
        return out


def read_mooncake(path: str) -> list[dict]:
    """Rows of a Mooncake JSONL trace (plain or gzip), validated (clear error naming the line on bad input)."""
    rows: list[dict[str, Any]] = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
                ts = float(row["timestamp"])
                inp = int(row["input_length"])
                out = int(row["output_length"])
                ids = [int(h) for h in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({exc!r})") from None
            rows.append({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def scale_mooncake(rows: Iterable[dict], scaling: Scaling, seed: int = 0, name: str = "mooncake") -> Trace:
    """Turn Mooncake rows into a replayable :class:`Trace` under ``scaling``."""
    gen = BlockTokens(scaling.tokens_per_block, seed=seed)
    start_ms = scaling.start_s * 1000.0
    end_ms = math.inf if scaling.window_s is None else start_ms + scaling.window_s * 1000.0
    requests: list[TraceRequest] = []
    for row in rows:
        ts = row["timestamp"]
        if ts < start_ms or ts >= end_ms:
            continue
        if scaling.max_requests is not None and len(requests) >= scaling.max_requests:
            break
        ids = row["hash_ids"]
        n = max(1, round(row["input_length"] * scaling.tokens_per_block / MOONCAKE_BLOCK_TOKENS))
        n = min(n, len(ids) * scaling.tokens_per_block) if ids else n
        if scaling.max_prompt_tokens:
            n = min(n, scaling.max_prompt_tokens)
        tokens = gen.prompt(ids, n) if ids else gen(-1 - len(requests))[:n]
        max_tokens = min(scaling.max_output_tokens, max(1, round(row["output_length"] * scaling.output_scale)))
        arrival = (ts - start_ms) / 1000.0 / scaling.rate_scale
        requests.append(TraceRequest(len(requests), arrival, tokens, max_tokens))
    if requests:  # the schedule starts with the first request of the window, not with empty time
        t0 = requests[0].arrival_s
        requests = [TraceRequest(r.index, r.arrival_s - t0, r.tokens, r.max_tokens) for r in requests]
    return Trace(
        name, requests, {"kind": "mooncake", "seed": seed, **asdict(scaling), "description": scaling.describe()}
    )


def load_mooncake(path: str, scaling: Scaling, seed: int = 0, name: str | None = None) -> Trace:
    stem = os.path.basename(path).removesuffix(".gz").removesuffix(".jsonl")
    return scale_mooncake(read_mooncake(path), scaling, seed=seed, name=name or stem)


@dataclass(frozen=True, slots=True)
class Oracle:
    """Prefix reuse an infinite, perfectly shared cache would get on a schedule.

    ``block_share``: full prompt blocks whose whole prefix appeared in an earlier request / all full
    prompt blocks. ``token_share``: the same hits in tokens / all prompt tokens; this is the bound for
    the engines' ``prefix_cache_hits / prefix_cache_queries`` (which count tokens, partial tails included).
    """

    block_size: int
    prompt_tokens: int
    prompt_blocks: int
    hit_blocks: int

    @property
    def block_share(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_share(self) -> float:
        return self.hit_blocks * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
            "block_share": round(self.block_share, 4),
            "token_share": round(self.token_share, 4),
        }


def oracle(prompts: Iterable[Sequence[int]], block_size: int, recompute_last_token: bool = True) -> Oracle:
    """Best possible prefix reuse of ``prompts`` in order, at ``block_size`` (the engine's block size).

    With ``recompute_last_token`` (what vLLM does: a prompt always computes at least its last token),
    a prompt of n tokens can hit at most (n - 1) // block_size blocks.
    """
    keyed = ((len(tokens), block_hashes(list(tokens), block_size)[1]) for tokens in prompts)
    return oracle_of_keys(keyed, block_size, recompute_last_token)


def oracle_of_keys(
    prompts: Iterable[tuple[int, Sequence[int]]], block_size: int, recompute_last_token: bool = True
) -> Oracle:
    """:func:`oracle` over prompts given as (token count, sequence hashes of the full blocks): for keys
    that tokens alone do not give (blocks holding an image are keyed by the image's identity too)."""
    seen: set[int] = set()
    prompt_tokens = prompt_blocks = hits = 0
    for n_tokens, seq in prompts:
        prompt_tokens += n_tokens
        prompt_blocks += len(seq)
        cap = (n_tokens - 1) // block_size if recompute_last_token else len(seq)
        for i, h in enumerate(seq):
            if i < cap and h in seen:
                hits += 1
        seen.update(seq)
    return Oracle(block_size, prompt_tokens, prompt_blocks, hits)


def distinct_blocks(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """Distinct full prompt blocks (by prefix hash) in a schedule: the cache an infinite-cache oracle uses."""
    seen: set[int] = set()
    for tokens in prompts:
        seen.update(block_hashes(list(tokens), block_size)[1])
    return len(seen)


def pooled_lru_hits(
    prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int, recompute_last_token: bool = True
) -> Oracle:
    """Prefix reuse of one LRU cache of ``capacity_blocks`` blocks (all workers' caches pooled).

    The infinite-cache oracle ignores capacity; on traces whose prefixes come back long after they
    were first seen (Mooncake's conversations) the workers' finite caches, not the router, bound the
    hit rate. This is a single shared LRU cache with every block of a request touched when it is
    served and requests run one after another: an estimate of what perfect routing over this much
    cache could reach, not a strict bound for separate per-worker caches with concurrency.
    """
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    prompt_tokens = prompt_blocks = hits = 0
    for tokens in prompts:
        _, seq = block_hashes(list(tokens), block_size)
        prompt_tokens += len(tokens)
        prompt_blocks += len(seq)
        cap = (len(tokens) - 1) // block_size if recompute_last_token else len(seq)
        for i, h in enumerate(seq):
            if i >= cap or h not in cache:
                break
            hits += 1
        for h in seq:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return Oracle(block_size, prompt_tokens, prompt_blocks, hits)
