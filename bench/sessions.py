"""Text workloads of sessions: what routers that read request text (the peers) must be compared on.

A workload is a tuple of :class:`SessionGroup`; each group is a set of alike sessions. A session opens on
one of its group's shared prefixes (a system prompt, or a document) and every turn repeats the whole
history so far plus a new user message, so turn k's prompt is a prefix of turn k+1's. The other shapes
teams run are other groups, not other code:

- multi-turn agentic sessions: a few shared system prompts of 1.5-2.5k tokens, several turns (``agentic``);
- many users on a few long shared documents (RAG-like): few prefixes, long ``prefix_tokens``, 1-2 turns;
- long contexts that evict each other: ``prefixes`` = ``sessions`` (nothing shared), long prefixes;
- bursts of new sessions: a group with a later ``start_s`` and a short ``start_window_s``;
- chat requests: ``api="chat"`` (system + user/assistant messages to /v1/chat/completions).

Groups naming the same ``prefix_pool`` draw from the same prefixes (a burst on the agentic system
prompts). Text is pseudo-words from a fixed vocabulary; lengths are approximate token counts
(calibrated once on the tokenizer), and each request's ``tokens`` is the engine's own tokenization of
its text (kvroute_common.tokenizer, as vLLM computes it), so the oracle and the engines agree. Same
workload and seed -> the same schedule, byte for byte.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from bench.traces import Trace, TraceRequest
from kvroute_common.tokenizer import chat_prompt_token_ids, completion_prompt_token_ids, encode_text, load_tokenizer

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
VOCABULARY_WORDS = 4096


@dataclass(frozen=True, slots=True)
class SessionGroup:
    """Alike sessions: how many, how long, what they share, when they start, which API they use."""

    name: str
    sessions: int
    turns: int
    prefixes: int  # shared prefixes the sessions draw from (system prompts, documents)
    prefix_tokens: tuple[int, int]  # each prefix's length, drawn uniformly in this range
    prefix_pool: str = ""  # groups with the same pool share prefixes ("" = the group's own name)
    user_tokens: int = 256  # mean; each message draws uniformly in [user_tokens/2, 3*user_tokens/2]
    reply_tokens: int = 256  # the assistant's turn as it appears in the next turn's history
    output_tokens: int = 8
    start_s: float = 0.0
    start_window_s: float = 40.0  # sessions start uniformly in [start_s, start_s + start_window_s]
    think_s: float = 3.0  # mean exponential gap between a session's turns, on top of think_min_s
    think_min_s: float = 1.0
    api: Literal["completions", "chat"] = "completions"

    def describe(self) -> str:
        lo, hi = self.prefix_tokens
        return (
            f"{self.name}: {self.sessions} sessions x {self.turns} turns ({self.api}) over {self.prefixes} shared "
            f"prefixes of ~{lo}-{hi} tokens, user messages ~{self.user_tokens}, replies ~{self.reply_tokens}, "
            f"{self.output_tokens} generated tokens, starts over {self.start_window_s:g} s from {self.start_s:g} s, "
            f"think {self.think_min_s:g} s + Exp({self.think_s:g} s)"
        )


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    groups: tuple[SessionGroup, ...]

    def describe(self) -> str:
        return "; ".join(g.describe() for g in self.groups)

    def at_load(self, factor: float) -> Workload:
        """The same sessions ``factor`` times as dense: starts and think times divided by ``factor`` (2 = twice
        the request rate and about twice as many requests in flight)."""
        if factor <= 0:
            raise ValueError("the load factor must be > 0")
        if factor == 1:
            return self
        return Workload(
            self.name,
            tuple(
                replace(
                    g,
                    start_s=g.start_s / factor,
                    start_window_s=g.start_window_s / factor,
                    think_s=g.think_s / factor,
                    think_min_s=g.think_min_s / factor,
                )
                for g in self.groups
            ),
        )

    def quick(self) -> Workload:
        """A short run of the same shape: a third of the sessions (at least 4), at most 3 turns, quicker turns."""
        return Workload(
            self.name,
            tuple(
                replace(
                    g,
                    sessions=max(4, g.sessions // 3),
                    turns=min(3, g.turns),
                    start_window_s=min(g.start_window_s, 10.0),
                    start_s=min(g.start_s, 10.0),
                    think_s=min(g.think_s, 1.0),
                    think_min_s=min(g.think_min_s, 0.5),
                )
                for g in self.groups
            ),
        )


AGENTIC = SessionGroup("agentic", sessions=20, turns=5, prefixes=4, prefix_tokens=(1536, 2560), start_window_s=20.0,
                       think_s=2.0, think_min_s=0.5)  # fmt: skip
WORKLOADS: dict[str, Workload] = {
    # multi-turn agentic sessions on a few shared system prompts
    "agentic": Workload("agentic", (AGENTIC,)),
    # many users asking about a few long shared documents (RAG-like): the documents are the reuse
    "rag": Workload(
        "rag",
        (
            SessionGroup(
                "rag",
                sessions=48,
                turns=2,
                prefixes=4,
                prefix_tokens=(3072, 4608),
                user_tokens=128,
                reply_tokens=128,
                start_window_s=20.0,
                think_s=2.0,
                think_min_s=0.5,
            ),
        ),
    ),  # fmt: skip
    # long private contexts (nothing shared): together far more than one engine's cache, they evict each other
    "long-context": Workload(
        "long-context",
        (
            SessionGroup(
                "long",
                sessions=12,
                turns=3,
                prefixes=12,
                prefix_tokens=(4096, 6144),
                start_window_s=16.0,
                think_s=2.0,
                think_min_s=0.5,
            ),
        ),
    ),  # fmt: skip
    # the agentic sessions, then a burst of new sessions on the same system prompts
    "agentic-burst": Workload(
        "agentic-burst",
        (
            AGENTIC,
            replace(
                AGENTIC, name="burst", sessions=16, turns=2, prefix_pool="agentic", start_s=10.0, start_window_s=1.0
            ),
        ),
    ),  # fmt: skip
    # the agentic sessions as chat requests (system + user/assistant messages to /v1/chat/completions)
    "agentic-chat": Workload("agentic-chat", (replace(AGENTIC, api="chat"),)),
    # the data-path testbed: 48 sessions x 6 turns on shared system prompts, 2-4k-token prompts, 16 output
    # tokens, arriving fast enough that 32 are in flight (the router's own cost decides the TTFT)
    "agentic-dense": Workload(
        "agentic-dense",
        (
            replace(
                AGENTIC,
                name="dense",
                sessions=48,
                turns=6,
                output_tokens=16,
                user_tokens=192,
                reply_tokens=128,
                start_window_s=8.0,
                think_s=0.5,
                think_min_s=0.1,
            ),
        ),
    ),  # fmt: skip
}


class Words:
    """Pseudo-word text from a fixed vocabulary, with the tokenizer's tokens per word measured once."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        rng = np.random.default_rng([seed, 11])
        lengths = rng.integers(2, 10, size=VOCABULARY_WORDS)
        self.vocabulary = ["".join(rng.choice(LETTERS, size=int(n))) for n in lengths]
        sample = self.text(rng, 4000)
        self.tokens_per_word = len(encode_text(tokenizer, sample)) / 4000

    def text(self, rng: np.random.Generator, n_words: int) -> str:
        return " ".join(self.vocabulary[i] for i in rng.integers(0, len(self.vocabulary), size=max(1, n_words)))

    def about(self, rng: np.random.Generator, tokens: int) -> str:
        """Text of about ``tokens`` tokens."""
        return self.text(rng, round(tokens / self.tokens_per_word))


def session_trace(workload: Workload, seed: int = 0, tokenizer_path: str | None = None) -> Trace:
    """The workload's schedule: every turn of every session at its arrival time, with its text (or
    messages) and the tokens the engine computes for it."""
    tok = load_tokenizer(tokenizer_path)
    words = Words(tok, seed)
    pools: dict[str, list[str]] = {}
    pending: list[tuple[float, int, int, str | None, list[dict[str, str]] | None, int]] = []
    session = 0
    for gi, g in enumerate(workload.groups):
        pool = g.prefix_pool or g.name
        if pool not in pools:
            prng = np.random.default_rng([seed, zlib.crc32(pool.encode())])
            lo, hi = g.prefix_tokens
            pools[pool] = [words.about(prng, int(prng.integers(lo, hi + 1))) for _ in range(g.prefixes)]
        prefixes = pools[pool]
        rng = np.random.default_rng([seed, gi, 7])
        lo_u = max(1, g.user_tokens // 2)
        hi_u = max(lo_u + 1, (3 * g.user_tokens) // 2 + 1)
        for _ in range(g.sessions):
            prefix = prefixes[int(rng.integers(len(prefixes)))]
            messages: list[dict[str, str]] = [{"role": "system", "content": prefix}]
            t = g.start_s + float(rng.uniform(0.0, g.start_window_s))
            for k in range(g.turns):
                messages.append({"role": "user", "content": words.about(rng, int(rng.integers(lo_u, hi_u)))})
                if g.api == "chat":
                    pending.append((t, session, k, None, [dict(m) for m in messages], g.output_tokens))
                else:
                    pending.append((t, session, k, completion_text(messages), None, g.output_tokens))
                messages.append({"role": "assistant", "content": words.about(rng, g.reply_tokens)})
                t += g.think_min_s + float(rng.exponential(g.think_s))
            session += 1
    pending.sort(key=lambda p: (p[0], p[1], p[2]))
    requests = []
    for i, (t, s, _, text, msgs, max_tokens) in enumerate(pending):
        tokens = chat_prompt_token_ids(tok, msgs) if msgs else completion_prompt_token_ids(tok, text)
        requests.append(TraceRequest(i, round(t, 6), tokens, max_tokens, session=s, text=text, messages=msgs))
    scaling = {
        "kind": "sessions",
        "workload": workload.name,
        "groups": [asdict(g) for g in workload.groups],
        "seed": seed,
        "description": workload.describe(),
    }
    return Trace(workload.name, requests, scaling)


def completion_text(messages: list[dict[str, str]]) -> str:
    """A conversation as one completions prompt; each turn's text is a prefix of the next turn's."""
    parts = [messages[0]["content"]]
    for m in messages[1:]:
        parts.append(f"\n\n{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}")
    return "".join(parts) + "\n\nAssistant:"
