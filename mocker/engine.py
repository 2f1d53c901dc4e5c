"""The simulated engine of one DP rank: a vLLM-style scheduler over a paged prefix cache.

``RankScheduler`` is the synchronous core (no I/O, no clock): ``schedule()`` plans one forward
pass (running sequences first, one decode token each or the next prefill chunk, then waiting
sequences by priority within the token budget, preempting the lowest-priority newest running
sequence when blocks run out, and registers the blocks the step fills in the prefix cache, as
vLLM does at scheduling) and ``commit()`` applies it once the simulated time has passed (samples
one token for every sequence whose known tokens are all computed). ``EngineRank`` drives it from
asyncio: it sleeps for the modelled step time, so an idle or busy engine costs almost no CPU, and
publishes the step's KV events once the step has run (vLLM publishes them in update_from_output).

Generated tokens are deterministic: each sequence draws from its own RNG seeded by the engine
seed, the request seed and the prompt, from a fixed list of word-like token ids; without
``ignore_eos`` the sequence ends with EOS after a natural length drawn from the same RNG.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from kvroute_common.hashing import local_block_hashes, pack_tokens, sequence_hashes
from kvroute_common.multimodal import Placeholder
from mocker.kv_cache import Block, KvCache
from mocker.mm_keys import ImageKeys, block_image_keys, image_hashes
from mocker.perf_model import PerfModel

log = logging.getLogger("mocker.engine")

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"

WAITING, RUNNING, FINISHED = 0, 1, 2

# natural output length (EOS) range when the client does not force a length
NATURAL_LEN_MIN = 16
NATURAL_LEN_MAX = 256

# sink(token_id | None, finish_reason | None); token None = finished without a new token (abort)
Sink = Callable[[int | None, str | None], None]


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "images",
        "image_keys",
        "request_id",
        "tokens",
        "prompt_len",
        "num_output",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "priority",
        "arrival_index",
        "arrival_time",
        "sink",
        "rng",
        "natural_len",
        "blocks",
        "seq_hashes",
        "local_hashes",
        "num_computed",
        "num_cached_blocks",
        "num_cached_tokens",
        "status",
        "first_token_time",
        "num_preemptions",
        "scheduled_once",
        "remote_tokens",
        "lora_name",
        "lora_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        sink: Sink,
        rng: random.Random,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.num_output = 0
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.stop_token_ids = stop_token_ids
        self.priority = priority
        self.arrival_index = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.sink = sink
        self.rng = rng
        self.natural_len = max(min_tokens, rng.randint(NATURAL_LEN_MIN, NATURAL_LEN_MAX))
        self.blocks: list[Block] = []
        self.seq_hashes: list[int] = []
        self.local_hashes: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling (usage.cached_tokens)
        self.status = WAITING
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.scheduled_once = False
        # disaggregated decode: leading prompt tokens whose KV a prefill engine computed and this
        # engine receives by transfer (vLLM NIXL do_remote_prefill); never recomputed at admission
        self.remote_tokens = 0
        self.lora_name: str | None = None  # a LoRA adapter's request: its blocks are keyed by the adapter
        self.lora_id: int | None = None
        self.images: list[Placeholder] = []  # the prompt's image token runs: their blocks are keyed by the image
        self.image_keys: list[ImageKeys | None] = []  # per full block, the images it holds (vLLM's extra keys)

    def update_hashes(self, block_size: int) -> None:
        """Extend the block hashes to every full block of the known tokens."""
        n_full = len(self.tokens) // block_size
        have = len(self.seq_hashes)
        if n_full <= have:
            return
        mm = None
        if self.images:
            keys = block_image_keys(self.images, block_size, have, n_full)
            self.image_keys.extend(keys)
            mm = image_hashes(keys)
        tokens = self.tokens[have * block_size : n_full * block_size]
        local = local_block_hashes(tokens, block_size, self.lora_name, None, mm)
        self.local_hashes.extend(local)
        self.seq_hashes.extend(sequence_hashes(local, self.seq_hashes[-1] if have else None))

    def sort_key(self) -> tuple[int, int]:
        """Lower sorts first: vLLM's priority policy (lower value = more urgent), FIFO within."""
        return (self.priority, self.arrival_index)


@dataclass
class Step:
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    num_decodes: int = 0
    seconds: float = 0.0


@dataclass
class RankStats:
    """Counters the metrics endpoint reads (vLLM's names in comments)."""

    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries (tokens)
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits (tokens)
    prompt_tokens: int = 0  # vllm:prompt_tokens
    generation_tokens: int = 0  # vllm:generation_tokens
    preemptions: int = 0  # vllm:num_preemptions
    steps: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens this rank actually prefilled (not cached, not transferred)
    remote_kv_tokens: int = 0  # prompt tokens whose KV arrived from a prefill engine (disaggregated decode)


class RankScheduler:
    """Scheduler + KV cache of one DP rank (synchronous core)."""

    def __init__(
        self,
        kv: KvCache,
        perf: PerfModel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_id: int | None,
        on_first_token: Callable[[Sequence, float], None] | None = None,
        on_finished: Callable[[Sequence, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        output_vocab: list[int] | None = None,
    ) -> None:
        self.kv = kv
        self.output_vocab = output_vocab or list(range(100, 1000))
        self.block_size = kv.block_size
        self.perf = perf
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort key
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.stats = RankStats()
        self.on_first_token = on_first_token
        self.on_finished = on_finished
        self.clock = clock
        self._arrivals = itertools.count()

    # -- queue management ------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.by_id) - len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.by_id)

    def capacity_tokens(self) -> int:
        return self.kv.num_usable * self.block_size

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.by_id:
            raise ValueError(f"duplicate request id {seq.request_id}")
        seq.arrival_index = next(self._arrivals)
        self.by_id[seq.request_id] = seq
        heapq.heappush(self.waiting, (seq.sort_key(), seq))

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> bool:
        """Stop a request (client went away, or a stop string ended it: ``reason`` "stop");
        its blocks return to the cache at once."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def abort_all(self) -> None:
        for seq in list(self.by_id.values()):
            self._finish(seq, FINISH_ABORT)

    def _finish(self, seq: Sequence, reason: str, delivered: bool = False) -> None:
        """Retire a sequence; ``delivered`` = the sink already got the reason with a token."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        # a waiting entry stays in the heap and is skipped when popped
        if seq.blocks:
            self.kv.release(seq.blocks)
            seq.blocks = []
        seq.status = FINISHED
        self.by_id.pop(seq.request_id, None)
        if self.on_finished is not None:
            self.on_finished(seq, reason)
        if not delivered:
            seq.sink(None, reason)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed (prompt + output) when readmitted."""
        self.running.remove(seq)
        self.kv.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        seq.status = WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        heapq.heappush(self.waiting, (seq.sort_key(), seq))

    # -- one forward pass ------------------------------------------------------------------

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def schedule(self) -> Step:
        """Plan the next forward pass (mutates block allocation; see module doc)."""
        step = Step()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # id(seq) -> tokens scheduled this step
        preempted = False
        kv = self.kv

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != RUNNING:
                continue  # preempted below as a victim of an earlier sequence
            num_new = min(len(seq.tokens) - seq.num_computed, budget)
            need = self._blocks_for(seq.num_computed + num_new) - len(seq.blocks)
            while need > kv.num_free and len(self.running) > 1:
                victim = max(self.running, key=Sequence.sort_key)
                budget += scheduled.pop(id(victim), 0)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                continue
            if need > kv.num_free:
                # alone and larger than the whole cache: it can never continue
                self._finish(seq, FINISH_LENGTH)
                continue
            seq.blocks.extend(kv.allocate(need) or [])
            self._cache_full_blocks(seq, seq.num_computed + num_new)
            scheduled[id(seq)] = num_new
            step.items.append((seq, num_new))
            budget -= num_new

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                _, seq = self.waiting[0]
                if seq.status != WAITING:
                    heapq.heappop(self.waiting)  # finished (aborted) while waiting
                    continue
                admitted = self._admit(seq, budget, step, scheduled)
                if admitted is None:  # can never fit, even into an empty cache
                    heapq.heappop(self.waiting)
                    self._finish(seq, FINISH_LENGTH)
                    continue
                if not admitted:
                    break
                heapq.heappop(self.waiting)
                budget -= scheduled[id(seq)]

        step.items = [(s, n) for s, n in step.items if id(s) in scheduled and s.status == RUNNING]
        kv_tokens = 0
        prefills: list[tuple[int, int]] = []  # (new, cached) per prefill chunk
        decode_contexts: list[int] = []
        for seq, n in step.items:
            if seq.num_computed + n <= seq.prompt_len or n > 1:
                step.prefill_tokens += n
                prefills.append((n, seq.num_computed))
            else:
                step.num_decodes += 1
                decode_contexts.append(seq.num_computed + n)
            kv_tokens += n
        for seq in self.running:
            kv_tokens += seq.num_computed
        step.seconds = self.perf.step_time(prefills, decode_contexts, kv_tokens / self.capacity_tokens())
        return step

    def _admit(self, seq: Sequence, budget: int, step: Step, scheduled: dict[int, int]) -> bool | None:
        """Start (or resume) a waiting sequence from its longest cached prefix.

        False = not enough free blocks now; None = it could never fit.
        """
        kv = self.kv
        bs = self.block_size
        seq.update_hashes(bs)
        total = len(seq.tokens)
        # at least the last token is always computed (it produces the next token's logits)
        hits = kv.longest_prefix(seq.seq_hashes, (total - 1) // bs)
        local = len(hits) * bs
        remote = 0
        if seq.remote_tokens and not seq.scheduled_once:  # KV transferred in: registered, not computed
            remote = max(0, min(seq.remote_tokens, total - 1) - local)
        computed = local + remote
        num_new = min(total - computed, budget)
        need = self._blocks_for(computed + num_new) - len(hits)
        if need > kv.num_free - kv.num_evictable_in(hits):
            if not self.running and self._blocks_for(total + 1) > kv.num_usable:
                return None
            return False
        kv.touch(hits)
        seq.blocks = hits + (kv.allocate(need) or [])
        seq.num_computed = computed
        seq.num_cached_blocks = len(hits)
        if not seq.scheduled_once:
            seq.num_cached_tokens = computed
            seq.scheduled_once = True
        self.stats.prefix_cache_queries += total
        self.stats.prefix_cache_hits += local
        self.stats.remote_kv_tokens += remote
        seq.status = RUNNING
        self.running.append(seq)
        self._cache_full_blocks(seq, computed + num_new)
        scheduled[id(seq)] = num_new
        step.items.append((seq, num_new))
        return True

    def _cache_full_blocks(self, seq: Sequence, n_tokens: int) -> None:
        """Register the blocks that are full once this step has computed ``n_tokens`` tokens.

        Done when the step is scheduled, as vLLM's allocate_slots does: the step's forward pass
        writes these blocks before any later step can read them, and a sequence admitted in the
        same step can already share them (KV is written before attention runs).
        """
        n_full = n_tokens // self.block_size
        if n_full > seq.num_cached_blocks:
            seq.update_hashes(self.block_size)
            self.kv.cache_blocks(
                seq.blocks,
                seq.num_cached_blocks,
                seq.seq_hashes[:n_full],
                seq.local_hashes,
                seq.tokens,
                seq.lora_name,
                seq.lora_id,
                seq.image_keys,
            )
            seq.num_cached_blocks = n_full

    def commit(self, step: Step) -> None:
        """Apply a planned step after its simulated time: sample one token per finished sequence."""
        now = self.clock()
        self.stats.steps += 1
        for seq, num_new in step.items:
            if seq.status != RUNNING:
                continue  # aborted or preempted since it was scheduled
            if seq.num_computed < seq.prompt_len:
                self.stats.computed_prompt_tokens += min(num_new, seq.prompt_len - seq.num_computed)
            seq.num_computed += num_new
            if seq.num_computed < len(seq.tokens):
                continue  # prefill chunk, more to compute
            token, reason = self._next_token(seq)
            seq.tokens.append(token)
            seq.num_output += 1
            self.stats.generation_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.stats.prompt_tokens += seq.prompt_len
                if self.on_first_token is not None:
                    self.on_first_token(seq, now - seq.arrival_time)
            seq.sink(token, reason)
            if reason is not None:
                self._finish(seq, reason, delivered=True)

    def _next_token(self, seq: Sequence) -> tuple[int, str | None]:
        k = seq.num_output  # index of the token being generated
        if not seq.ignore_eos and k >= seq.natural_len:
            if self.eos_token_id is not None:
                return self.eos_token_id, FINISH_STOP
            return seq.rng.choice(self.output_vocab), FINISH_STOP  # a tokenizer without EOS
        token = seq.rng.choice(self.output_vocab)
        if token in seq.stop_token_ids and k >= seq.min_tokens:
            return token, FINISH_STOP
        if k + 1 >= seq.max_tokens:
            return token, FINISH_LENGTH
        return token, None

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset()


def word_token_ids(tokenizer, limit: int = 4000) -> list[int]:
    """Ids of tokens that decode to ' ' + lowercase letters: readable, self-contained text."""
    out = []
    special = set(tokenizer.all_special_ids)
    for tid in range(len(tokenizer)):
        if tid in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(tid)
        if not isinstance(piece, str) or len(piece) < 3 or piece[0] not in ("Ġ", "▁"):
            continue
        word = piece[1:]
        if word.isascii() and word.isalpha() and word.islower():
            out.append(tid)
            if len(out) >= limit:
                break
    return out or [t for t in range(min(len(tokenizer), 1000)) if t not in special]


def sequence_rng(engine_seed: int, request_seed: int | None, prompt: list[int]) -> random.Random:
    """A sequence's RNG: same engine seed + request seed + prompt -> same output tokens."""
    seed = xxhash.xxh3_64_intdigest(pack_tokens(prompt), engine_seed & 0xFFFFFFFFFFFFFFFF)
    if request_seed is not None:
        seed ^= (request_seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return random.Random(seed)


class EngineRank:
    """asyncio driver of one rank's scheduler: plan, sleep the modelled time, commit, publish."""

    def __init__(self, rank: int, scheduler: RankScheduler, publish: Callable[[list], object] | None) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.publish = publish
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-rank-{self.rank}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._wake.set()

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> None:
        self.scheduler.abort(request_id, reason)

    def flush_events(self) -> None:
        events = self.scheduler.kv.take_events()
        if events and self.publish is not None:
            self.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks. The AllBlocksCleared event is published with the next step's
        batch, not now: vLLM queues it in the block pool and publishes the queue after a step."""
        return self.scheduler.reset_prefix_cache()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            try:
                step = sched.schedule()
                if not step.items:
                    # nothing can run now (e.g. memory held by requests that just finished)
                    self.flush_events()
                    await asyncio.sleep(0.001)
                    continue
                delay = started + step.seconds - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                sched.commit(step)
                # one batch per step once it has run (its evictions and newly cached blocks, and an
                # AllBlocksCleared queued since the last step): vLLM publishes in update_from_output
                self.flush_events()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not silently stall every request of the rank
                log.exception("rank %d: engine step failed; aborting its requests", self.rank)
                sched.abort_all()
                self.flush_events()
