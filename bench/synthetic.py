"""Built-in synthetic multi-turn workload: chat sessions with shared system prompts and growing histories.

This is the workload where routing matters most: every turn of a session repeats the whole previous
conversation, and sessions share a handful of system prompts. A router that keeps a session on the
worker holding its history turns the repeated prefix into cache hits; one that scatters turns makes
every worker hold (and evict) every session.

Turn k of a session sends ``system + (user_1 + reply_1) + ... + user_k``; ``reply_i`` are
deterministic synthetic tokens (not the engine's output), so the schedule is identical for every
router mode. Sessions start spread over ``start_window_s``; turns follow after a minimum plus an
exponential think time. Same config (incl. seed) -> same trace, always.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from bench.traces import VOCAB_HIGH, VOCAB_LOW, Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    seed: int = 0
    # Defaults = the tuned benchmark workload (docs/bench/replay.md): long, prefix-heavy conversations
    # (mean prompt ~7.3k tokens, last turn ~13k) so that recomputing a missed history costs real time.
    sessions: int = 40
    turns: int = 10
    system_prompts: int = 4
    system_tokens: int = 1024
    user_tokens: int = 512  # mean; each message draws uniformly in [user_tokens/2, 3*user_tokens/2]
    reply_tokens: int = 768  # the assistant turn as it appears in the next prompt's history
    output_tokens: int = 4  # tokens generated per request (max_tokens, ignore_eos)
    start_window_s: float = 30.0
    think_s: float = 2.0  # mean gap between a session's turns, on top of think_min_s
    think_min_s: float = 1.0  # a user reads the reply before answering: no turn overlaps the previous one's prefill

    def describe(self) -> str:
        return (
            f"{self.sessions} sessions x {self.turns} turns, {self.system_prompts} shared system prompts of "
            f"{self.system_tokens} tokens, user messages ~{self.user_tokens} tokens, history replies "
            f"{self.reply_tokens} tokens, {self.output_tokens} generated tokens per request, sessions start "
            f"over {self.start_window_s:g} s, think time {self.think_min_s:g} s + Exp({self.think_s:g} s), seed "
            f"{self.seed}"
        )


def synthetic_trace(cfg: SyntheticConfig = SyntheticConfig()) -> Trace:
    rng = np.random.default_rng([cfg.seed, 7])
    systems = [rng.integers(VOCAB_LOW, VOCAB_HIGH, size=cfg.system_tokens).tolist() for _ in range(cfg.system_prompts)]
    pending: list[tuple[float, int, int, list[int], int]] = []  # (arrival, session, turn, tokens, max_tokens)
    lo = max(1, cfg.user_tokens // 2)
    hi = max(lo + 1, (3 * cfg.user_tokens) // 2 + 1)
    for s in range(cfg.sessions):
        history = list(systems[int(rng.integers(cfg.system_prompts))]) if cfg.system_prompts else []
        t = float(rng.uniform(0.0, cfg.start_window_s))
        for k in range(cfg.turns):
            history.extend(rng.integers(VOCAB_LOW, VOCAB_HIGH, size=int(rng.integers(lo, hi))).tolist())
            pending.append((t, s, k, list(history), cfg.output_tokens))
            history.extend(rng.integers(VOCAB_LOW, VOCAB_HIGH, size=cfg.reply_tokens).tolist())
            t += cfg.think_min_s + float(rng.exponential(cfg.think_s))
    pending.sort(key=lambda p: (p[0], p[1], p[2]))
    requests = [TraceRequest(i, round(p[0], 6), p[3], p[4], session=p[1]) for i, p in enumerate(pending)]
    return Trace("synthetic", requests, {"kind": "synthetic", **asdict(cfg), "description": cfg.describe()})
