"""Differential test: the mocker against vLLM's CPU build, request for request and KV event for KV event.

The same scripted requests go to a mocker and to a real vLLM engine configured alike: block size
32, 64 KV blocks (63 usable: block 0 is the null block in both), a token budget of 200 per step
(long prompts prefill in chunks that end mid-block), the same tokenizer (the tiny model's files
are kvroute's built-in tokenizer, which the mocker is given as ``--model-path``). The script has
shared system prompts, growing multi-turn conversations, a block-aligned prompt sent twice, one-off
long prompts that evict, requests that generate across block boundaries, a prefix-cache reset,
and, besides token-id prompts, a text completion and a two-turn chat (tokenisation and chat
template must agree too: every stored prompt token is checked against kvroute's ids).

Determinism. Requests are sent one at a time, with temperature 0, ``ignore_eos`` and a fixed
``max_tokens``, so both engines schedule the same steps in the same order; the events are
therefore compared in order, batch by batch, not as sets. A batch belongs to the request (or
reset) whose wall-clock window holds the batch's timestamp: both engines stamp a batch with
``time.time()`` when they publish it, after the request arrived and before it is answered.

What is compared, per scripted step:

* ``usage.prompt_tokens_details.cached_tokens``;
* the KV event batches, normalised: a block is named by its position in its chain and kvroute's
  own chained hash of its token ids (``kvroute_common.hashing``), never by the engine's hash; a
  ``BlockStored``'s parent by the parent's name, a ``BlockRemoved``'s hashes by the names the
  engine's earlier ``BlockStored`` events gave them; every other decoded field (token ids, block
  size, medium, LoRA, extra keys, group index, cache spec kind, locality) as it is;

and over the whole script the prefix-cache query and hit, prompt and generation token counters.

Generated tokens differ (a random model against the mocker's word list), so positions at or past
the request's prompt length are masked in ``BlockStored`` token ids. Both engines store a block
holding generated tokens once its KV is computed: the KV of ``prompt + max_tokens - 1`` tokens
(the last sampled token is never fed back), so the script ends some generations just past a block
boundary (that block is stored) and some exactly on one (it is not). The next turn of a
conversation is built by the script, not from the reply, so such blocks are never hit again.

Both engines start the script from the same state: the prefix cache reset, and the reset's
``AllBlocksCleared`` published by a prompt shorter than a block (it stores nothing), with its tokens
counted. The vLLM engine is the session's small-cache engine (tests/conftest.py, shared with the trace
test), so it may have served requests before: the stream compared is the replay from the first batch
after that reset on (complete by construction: the engine keeps 10,000 batches); the live SUB stream,
subscribed before the first request, must equal it wherever both have a batch.

Differences this test found and that were fixed in the mocker (docs/bench/mocker.md): vLLM's
null block; cached content not de-duplicated (a recomputed block is stored again under the same
hash, every copy is evicted and reported on its own); one ``BlockRemoved`` per block;
``group_idx``, ``kv_cache_spec_kind`` and ``extra_keys`` in the events; events published once per
step after it ran, so ``AllBlocksCleared`` goes out with the next step's batch. Not compared,
because they differ by design: the generated tokens, the engines' external hash values (opaque,
per engine), batch timestamps and step timing (the mocker models time, it does not measure it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from indexer import wire
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from kvroute_common.real_engines.vllm_cpu import SERVED_NAME, VllmEngine
from kvroute_common.tokenizer import chat_prompt_token_ids, completion_prompt_token_ids, load_tokenizer
from support import SMALL_CACHE_BLOCKS, SMALL_CACHE_BUDGET, free_port, free_ports, service, wait_until

BS = 32
NUM_BLOCKS = SMALL_CACHE_BLOCKS  # 64, 63 usable: the script's working set is several times larger
BUDGET = SMALL_CACHE_BUDGET  # 200 tokens a step: a 900-token prompt prefills in 5 chunks, ending mid-block
MASK = 0xFFFFFFFF  # stands for a generated token in normalised token ids (not a token id)
SEED = 20240611
# counters compared as their change over the script (the engine's own token accounting)
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
WORDS = "alpha beta gamma delta router cache block prefix worker engine token stream".split()


# -- the script ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One scripted step: a completion, sent as token ids, as ``text`` or as chat ``messages``, or a
    prefix-cache reset. ``prompt`` is always the token ids kvroute computes for the request."""

    label: str
    prompt: tuple[int, ...] = ()
    max_tokens: int = 1
    reset: bool = False
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)


def gen_to_boundary(prompt_len: int, extra_blocks: int) -> int:
    """max_tokens making prompt + output end exactly ``extra_blocks`` block boundaries on."""
    return (-(-prompt_len // BS) + extra_blocks - 1) * BS - prompt_len or BS


def build_script() -> list[Op]:
    """Deterministic: system prompts, 4 conversations over 5 rounds, repeats, evictions, a reset;
    a text completion and a two-turn chat check that both engines tokenise and template alike."""
    rng = random.Random(SEED)
    tok = load_tokenizer(None)  # the tiny model's tokenizer files are these

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 16_000) for _ in range(n))

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))

    def text_op(label: str, text: str) -> Op:
        return Op(label, tuple(completion_prompt_token_ids(tok, text)), text=text)

    def chat_op(label: str, messages: tuple[tuple[str, str], ...], max_tokens: int) -> Op:
        ids = chat_prompt_token_ids(tok, [{"role": r, "content": c} for r, c in messages])
        return Op(label, tuple(ids), max_tokens, messages=messages)

    chat = (("system", words(120)), ("user", words(40)))
    chat_2 = (*chat, ("assistant", words(30)), ("user", words(25)))  # the reply is the script's

    systems = [toks(96), toks(150), toks(81)]  # the first is exactly 3 blocks
    ops = [
        Op("system 0", systems[0]),
        # all 3 blocks cached, but the last token is always recomputed: its block is computed again
        Op("system 0 again (block-aligned repeat)", systems[0]),
        Op("system 1", systems[1], max_tokens=gen_to_boundary(150, 1)),  # ends on a boundary: 150+10 = 160
        text_op("text completion", words(150)),
        chat_op("chat turn 0", chat, 20),
    ]
    convs = [list(systems[c % 3]) for c in range(4)]
    last: dict[int, Op] = {}

    def turn(c: int, rnd: int) -> None:
        hist = convs[c]
        hist += toks(rng.randint(30, 90))  # the user's message
        n = len(hist)
        if (rnd + c) % 3 == 0:
            max_tokens = n % BS and BS - n % BS + 12  # crosses the next boundary: that block is stored
        elif (rnd + c) % 3 == 1:
            max_tokens = gen_to_boundary(n, 2)  # ends exactly on the boundary after next
        else:
            max_tokens = 1
        last[c] = Op(f"conversation {c} turn {rnd}", tuple(hist), max(1, max_tokens))
        ops.append(last[c])
        hist += toks(rng.randint(20, 60))  # the "assistant reply": the script's tokens, the same on both sides

    for rnd in range(5):
        for c in range(4):
            turn(c, rnd)
        if rnd in (1, 3):
            ops.append(Op(f"one-off long prompt {rnd}", toks(900)))
            ops.append(Op(f"system {rnd % 3} on its own", systems[rnd % 3] + toks(7)))
        if rnd == 0:
            ops.append(chat_op("chat turn 1", chat_2, 1))
        if rnd == 2:
            ops.append(Op(f"{last[0].label} repeated", last[0].prompt))
    ops.append(Op("reset", reset=True))
    for c in (0, 2):
        turn(c, 5)
    ops.append(Op("fence", toks(70)))  # a fresh prompt: its BlockStored is the last event of the script
    return ops


SCRIPT = build_script()


# -- running it ----------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    kv_endpoint: str
    replay_endpoint: str


@dataclass
class Run:
    """What one engine did with the script."""

    windows: list[tuple[float, float]] = field(default_factory=list)  # wall clock around each op
    cached_tokens: list[int | None] = field(default_factory=list)
    first_seq: int = 0  # the script's first batch: the engine's earlier ones are not the script's
    batches: list[tuple[int, bytes]] = field(default_factory=list)  # the script's whole stream, from replay
    live_seqs: list[int] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # change over the script


def read_metrics(url: str) -> dict[str, float]:
    """Prometheus samples summed over their labels, by name."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def replay_all(ctx: zmq.Context, endpoint: str) -> list[tuple[int, bytes]]:
    """Every batch the engine still buffers, from sequence 0 (vLLM's replay protocol)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", wire.seq_frame(0)])
        out: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(10_000), f"no replay answer from {endpoint}"
            frames = dealer.recv_multipart()
            if frames[-1] == b"" and frames[-2] == wire.REPLAY_END_SEQ:
                return out
            out.append((wire.parse_seq(frames[2]), frames[3]))
    finally:
        dealer.close()


def start_clean(target: Target, ctx: zmq.Context) -> int:
    """Reset the target's prefix cache and publish the reset (vLLM sends ``AllBlocksCleared`` with the next
    step's batch: a prompt shorter than a block, which stores nothing, makes that step); once that batch
    is out and the prompt's tokens are counted, the sequence number the script's first batch will get."""
    flush = {"model": SERVED_NAME, "prompt": list(range(200, 208)), "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=target.url, timeout=120) as http:

        def reset() -> bool:
            r = http.post("/reset_prefix_cache")  # vLLM answers {"success": false} while blocks are held
            return r.status_code == 200 and (not r.content or bool(r.json().get("success")))

        wait_until(reset, timeout=30, what=f"{target.name}'s prefix cache reset")
        before = read_metrics(target.url)
        r = http.post("/v1/completions", json=flush)
        assert r.status_code == 200, f"{target.name}: the reset's flush: {r.status_code} {r.text}"

    def published() -> int | None:
        batches = replay_all(ctx, target.replay_endpoint)
        if not batches or not any(isinstance(e, wire.Cleared) for e in wire.decode_batch(batches[-1][1]).events):
            return None
        after = read_metrics(target.url)
        counted = [after.get(n, 0.0) - before.get(n, 0.0) for n in COUNTERS[2:]] == [len(flush["prompt"]), 1]
        return batches[-1][0] + 1 if counted else None

    return wait_until(published, timeout=30, interval=0.05, what=f"{target.name}'s reset published and counted")


def stores_first_block(payload: bytes, tokens: tuple[int, ...]) -> bool:
    """Whether the batch stores the chain that starts with the block of ``tokens``."""
    return any(
        isinstance(e, wire.Stored) and e.parent_block_hash is None and e.token_ids[:BS] == list(tokens)
        for e in wire.decode_batch(payload).events
    )


def run_script(target: Target, ops: list[Op]) -> Run:
    """From a clean prefix cache, send the ops one at a time; then collect the script's event stream
    (live SUB + replay)."""
    ctx = zmq.Context()
    try:
        run = Run(first_seq=start_clean(target, ctx))
    except BaseException:
        ctx.term()
        raise
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)  # keep everything until drained
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # connected before the first request: the mocker runs the whole script in well under a second
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(target.kv_endpoint)
    assert monitor.poll(10_000), f"{target.name}: no ZMTP handshake with {target.kv_endpoint}"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    sub.disable_monitor()
    monitor.close()
    live: dict[int, bytes] = {}
    before = read_metrics(target.url)
    try:
        with httpx.Client(base_url=target.url, timeout=120) as http:
            for op in ops:
                t0 = time.time()
                if op.reset:
                    r = http.post("/reset_prefix_cache")
                    assert r.status_code == 200, f"{target.name}: reset: {r.status_code} {r.text}"
                    cached = None
                else:
                    body: dict[str, Any] = {
                        "model": SERVED_NAME,
                        "max_tokens": op.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    if op.messages is not None:
                        body["messages"] = [{"role": role, "content": c} for role, c in op.messages]
                        r = http.post("/v1/chat/completions", json=body)
                    else:
                        body["prompt"] = op.text if op.text is not None else list(op.prompt)
                        r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, f"{target.name}: {op.label}: {r.status_code} {r.text}"
                    usage = r.json()["usage"]
                    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(op.prompt), op.max_tokens)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                run.windows.append((t0, time.time()))
                run.cached_tokens.append(cached)

        fence = ops[-1].prompt[:BS]

        def complete() -> bool:
            """The replay holds the fence's block and the live stream has caught up with the replay."""
            while sub.poll(0):
                _topic, seq, payload = sub.recv_multipart()
                if wire.parse_seq(seq) >= run.first_seq:
                    live[wire.parse_seq(seq)] = payload
            run.batches = [(s, p) for s, p in replay_all(ctx, target.replay_endpoint) if s >= run.first_seq]
            fenced = any(stores_first_block(p, fence) for _, p in run.batches)
            return fenced and bool(live) and max(live) == run.batches[-1][0]

        wait_until(complete, timeout=60, interval=0.05, what=f"{target.name}'s KV events up to the fence")

        # vLLM's API server counts a step's tokens when it handles the step's output: wait for the last
        prompt_total = sum(len(op.prompt) for op in ops)
        gen_total = sum(op.max_tokens for op in ops if not op.reset)

        def counted() -> dict[str, float]:
            """The counters' change once the script's tokens are all counted, else {}."""
            after = read_metrics(target.url)
            delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
            tokens = (delta["vllm:prompt_tokens_total"], delta["vllm:generation_tokens_total"])
            done = tokens == (prompt_total, gen_total)
            return {**delta, "vllm:kv_cache_usage_perc": after["vllm:kv_cache_usage_perc"]} if done else {}

        run.counters = wait_until(counted, timeout=30, what=f"{target.name}'s token counters")
    finally:
        sub.close()
        ctx.term()
    seqs = [s for s, _ in run.batches]
    first, end = run.first_seq, run.first_seq + len(seqs)
    assert seqs == list(range(first, end)), f"{target.name}: replay is not the whole stream from {first}: {seqs[:5]}..."
    replayed = dict(run.batches)
    run.live_seqs = sorted(live)
    assert run.live_seqs == list(range(run.live_seqs[0], end)), f"{target.name}: live stream has gaps"
    assert all(live[s] == replayed[s] for s in live), f"{target.name}: a live batch differs from its replay"
    return run


# -- normalising ---------------------------------------------------------------------------------


class Ref(NamedTuple):
    """A block as kvroute names it: position in its chain and kvroute's chained hash of its tokens."""

    pos: int
    seq_hash: int

    def __repr__(self) -> str:
        return f"#{self.pos}:{self.seq_hash:016x}"


@dataclass
class Normaliser:
    """One engine's events with its hashes replaced by kvroute's names (engine hash -> Ref)."""

    names: dict[int, Ref] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def ref(self, engine_hash: int, what: str) -> Ref:
        ref = self.names.get(engine_hash)
        if ref is None:
            self.problems.append(f"{what}: engine hash {engine_hash:#x} was never stored")
            return Ref(-1, engine_hash)
        return ref

    def stored(self, ev: wire.Stored, op: Op) -> tuple[Any, ...]:
        parent = None if ev.parent_block_hash is None else self.ref(ev.parent_block_hash, op.label)
        first = 0 if parent is None else parent.pos + 1
        start = first * BS
        masked = [MASK if start + i >= len(op.prompt) else t for i, t in enumerate(ev.token_ids)]
        for i, t in enumerate(masked):
            if t != MASK and t != op.prompt[start + i]:
                self.problems.append(f"{op.label}: stored token {start + i} is not the prompt's")
                break
        local = local_block_hashes(masked, BS)
        chain = sequence_hashes(local, None if parent is None else parent.seq_hash)
        refs = [Ref(first + i, h) for i, h in enumerate(chain)]
        if len(refs) != len(ev.block_hashes):
            self.problems.append(f"{op.label}: {len(ev.block_hashes)} hashes for {len(ev.token_ids)} tokens")
        for engine_hash, ref in zip(ev.block_hashes, refs, strict=False):
            if self.names.setdefault(engine_hash, ref) != ref:
                self.problems.append(f"{op.label}: engine hash {engine_hash:#x} names two different blocks")
        rest = msgspec.structs.asdict(ev)
        for name in ("block_hashes", "parent_block_hash", "token_ids"):
            del rest[name]
        return ("stored", parent, tuple(refs), tuple(masked), tuple(sorted(rest.items(), key=lambda kv: kv[0])))

    def removed(self, ev: wire.Removed, op: Op) -> tuple[Any, ...]:
        refs = tuple(self.ref(h, op.label) for h in ev.block_hashes)
        return ("removed", refs, ev.medium, ev.group_idx, ev.locality)

    def batch(self, payload: bytes, op: Op) -> list[tuple[Any, ...]]:
        """The batch's DP rank, then its events, each with the keys it carries on the wire (the
        decoder drops some fields, e.g. ``lora_id``; the keys show that both engines send them)."""
        decoded = wire.decode_batch(payload)
        raw = msgspec.msgpack.decode(payload)[1]
        out: list[tuple[Any, ...]] = [("batch", decoded.dp_rank)]
        for ev, raw_ev in zip(decoded.events, raw, strict=True):
            keys = tuple(raw_ev) if isinstance(raw_ev, dict) else ("array-form",)
            if isinstance(ev, wire.Stored):
                out.append((*self.stored(ev, op), keys, raw_ev.get("lora_id")))
            elif isinstance(ev, wire.Removed):
                out.append((*self.removed(ev, op), keys))
            else:
                out.append(("cleared", keys))
        return out


@dataclass
class Recording:
    """A run normalised: per scripted op, its batches of normalised events."""

    per_op: list[list[list[tuple[Any, ...]]]]
    cached_tokens: list[int | None]
    unattributed: list[float]  # timestamps of batches outside every op's window
    problems: list[str]
    live_from: int
    counters: dict[str, float]


def normalise(run: Run, ops: list[Op]) -> Recording:
    norm = Normaliser()
    per_op: list[list[list[tuple[Any, ...]]]] = [[] for _ in ops]
    unattributed: list[float] = []
    k = 0
    for _seq, payload in run.batches:
        ts = wire.decode_batch(payload).ts
        while k < len(ops) and ts > run.windows[k][1]:
            k += 1
        if k == len(ops) or ts < run.windows[k][0]:
            unattributed.append(ts)
            continue
        per_op[k].append(norm.batch(payload, ops[k]))
    live_from = run.live_seqs[0] - run.first_seq
    return Recording(per_op, run.cached_tokens, unattributed, norm.problems, live_from, run.counters)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(small_cache_vllm: VllmEngine) -> VllmEngine:
    """The session's small-cache engine (tests/conftest.py): 64 blocks, a 200-token step budget, KV events
    with replay, ``POST /reset_prefix_cache``; shared with the trace test, so the script starts from a reset."""
    return small_cache_vllm


@pytest.fixture(scope="module")
def mocker_target(tiny_model: str, vllm_engine: VllmEngine) -> Iterator[Target]:
    """A mocker configured like the engine, with the tiny model's tokenizer."""
    port = free_port()
    pub, replay = free_ports(2)
    args = [
        "-m",
        "mocker",
        "--port",
        str(port),
        "--model-path",
        tiny_model,
        "--served-model-name",
        SERVED_NAME,
        "--block-size",
        str(BS),
        "--num-gpu-blocks",
        str(NUM_BLOCKS),
        "--max-num-batched-tokens",
        str(BUDGET),
        "--max-model-len",
        str(vllm_engine.max_model_len),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        "--speedup-ratio",
        "0",
        "--seed",
        "0",
    ]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=url + "/health", timeout=60):
        yield Target("mocker", url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")


@pytest.fixture(scope="module")
def recordings(vllm_engine: VllmEngine, mocker_target: Target) -> dict[str, Recording]:
    """The script run on both engines (the mocker first: it takes well under a second)."""
    real = Target("vllm", vllm_engine.url, vllm_engine.kv_endpoint(), vllm_engine.replay_endpoint())
    return {t.name: normalise(run_script(t, SCRIPT), SCRIPT) for t in (mocker_target, real)}


# -- the comparisons -----------------------------------------------------------------------------


def describe(ev: tuple[Any, ...]) -> str:
    if ev[0] == "stored":
        n_gen = sum(1 for t in ev[3] if t == MASK)
        fields = f"{dict(ev[4])} wire keys={ev[5]} lora_id={ev[6]}"
        return f"stored parent={ev[1]} blocks={list(ev[2])} ({n_gen} generated tokens) {fields}"
    return " ".join(map(str, ev))


def test_streams_are_complete_and_attributable(recordings: dict[str, Recording]) -> None:
    """Every batch falls in one scripted op's window and names blocks the engine stored before; the
    live stream (equal to the replay where both have a batch, checked while collecting) carried all
    of it but at most a first batch or two (the subscription is set up before the first request, but
    a SUB's subscription reaches the PUB asynchronously)."""
    for name, rec in recordings.items():
        assert rec.unattributed == [], f"{name}: batches outside every request's window"
        assert rec.problems == [], f"{name}: {rec.problems[:5]}"
        assert rec.live_from <= 2, f"{name}: the live stream started at batch {rec.live_from}"


def test_cached_tokens_match(recordings: dict[str, Recording]) -> None:
    mocker, vllm = recordings["mocker"], recordings["vllm"]
    diffs = [
        f"{op.label}: mocker {m} vllm {v}"
        for op, m, v in zip(SCRIPT, mocker.cached_tokens, vllm.cached_tokens, strict=True)
        if m != v
    ]
    assert diffs == []


def test_counters_match(recordings: dict[str, Recording]) -> None:
    """Prefix-cache queries and hits, prompt and generated tokens over the script; nothing held after."""
    mocker, vllm = recordings["mocker"].counters, recordings["vllm"].counters
    assert mocker == vllm and vllm["vllm:kv_cache_usage_perc"] == 0.0


def test_kv_events_match(recordings: dict[str, Recording]) -> None:
    """Batch for batch, event for event, per scripted op (see the module doc for the normalisation)."""
    mocker, vllm = recordings["mocker"], recordings["vllm"]
    diffs: list[str] = []
    for op, m, v in zip(SCRIPT, mocker.per_op, vllm.per_op, strict=True):
        if m == v:
            continue
        lines = [f"== {op.label} (prompt {len(op.prompt)}, max_tokens {op.max_tokens})"]
        for side, batches in (("mocker", m), ("vllm", v)):
            lines.append(f"  {side}:")
            lines += [f"    [{i}] {describe(ev)}" for i, b in enumerate(batches) for ev in b]
        diffs.append("\n".join(lines))
    assert not diffs, f"{len(diffs)} of {len(SCRIPT)} ops differ; the first:\n" + "\n".join(diffs[:3])


def test_script_exercises_what_it_claims(recordings: dict[str, Recording]) -> None:
    """The comparison means something: on vLLM's side the script hit, evicted, re-stored a copy,
    chunked a prefill, stored generated tokens and cleared."""
    vllm = recordings["vllm"]
    events = [ev for batches in vllm.per_op for b in batches for ev in b]
    stored = [ev for ev in events if ev[0] == "stored"]
    refs = [r for ev in stored for r in ev[2]]
    removed = [r for ev in events if ev[0] == "removed" for r in ev[1]]
    assert sum(1 for c in vllm.cached_tokens if c) >= 10
    assert len(removed) >= 60 and all(len(ev[1]) == 1 for ev in events if ev[0] == "removed")
    assert len(refs) > len(set(refs))  # a block stored again (the recomputed copy)
    assert any(sum(1 for b in batches if any(ev[0] == "stored" for ev in b)) >= 4 for batches in vllm.per_op)
    assert any(MASK in ev[3] for ev in stored)
    assert sum(1 for ev in events if ev[0] == "cleared") == 1
