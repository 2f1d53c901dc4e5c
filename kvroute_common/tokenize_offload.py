"""Tokenization that never blocks the event loop: long prompts go to a worker thread.

Why: a 3 MB prompt takes ~1 s to encode; inline, every other request on the loop waits that long.
Measured on this machine (docs/benchmarks.md, ``python -m bench tokenize_stall``):

* HF ``tokenizers``' ``encode_batch_fast`` releases the GIL for the whole encode; ``encode`` and our
  ``re``-based fast path (``PromptEncoder``) hold it (one 3 MB ``re.findall`` holds it ~90 ms), so
  the thread path encodes with ``encode_batch_fast`` (same ids, ``nogil=True``).
* Rendering the chat template (jinja, pure Python) keeps the GIL only between bytecodes: the loop
  gets it back within a switch interval, so rendering in the thread is fine (0.3 ms for a 128 k-token
  message, ~1 ms for 3 MB).
* The switch interval is what every GIL hand-back costs the loop while a thread runs Python code
  (a long prompt's block hashes, its render): the loop gives the GIL up at every socket call and
  waits that long to get it back. A socket round trip beside a thread hashing a 128 k-token prompt,
  on the loaded machine (``python -m bench gil_handback``): p99 20-40 ms at CPython's 5 ms, 2.6-15.7 ms
  at 0.5 ms. The frontend runs with ``LOOP_SWITCH_INTERVAL_MS`` (``--switch-interval-ms``).
* The threads keep the loop's OS priority: a lower one (nice +10) was measured worse on a loaded
  machine, since a descheduled thread that holds the GIL mid-render stalls the loop (priority inversion).
* The tokenizer library encodes a batch (a long prompt's chunks) on its own thread pool, by default as
  many threads as the process has cores: on 2 cores a 128 k-token prompt's encode took both for ~30 ms,
  and the loop waited for a CPU meanwhile. ``bound_encoder_threads`` leaves the loop a core.
* A thread hop costs ~0.1 ms; short prompts stay inline on the cached fast path, which is quicker
  than the backend for text it has seen (shared system prompts).
* Huge prompts (over ``BULK_CHARS``) are encoded one at a time, on a thread of their own: two 3 MB prompts
  encoded at once took both cores of a 2-vCPU guest for a second, and a tiny request beside three of them
  waited up to 42-76 ms for the loop's thread to get a CPU (one at a time: 29-52 ms; docs/benchmarks.md,
  "Long agentic contexts"). They wait for each other, never for a shorter prompt, nor it for them.
* The threads are started before serving (``start``): ``Thread.start`` waits until the new thread
  runs, and started on the loop by the first long prompts, the second one held the loop 39 ms on the
  loaded machine (``--log-loop-stalls``, three 3 MB chat prompts at once).

Prompts with more than ``threshold_chars`` characters of text to encode are offloaded (the caller decides
what counts: what follows the remembered turn a prompt continues; else the text the caches do not hold,
``PromptEncoder.new_chars``, of a completion or a chat-shaped request's rendered prompt up to
``frontend.routing.prompt.COUNTED_MAX`` times the threshold, and past it the whole text; of each embeddings
input). Default 4096: text the caches do not hold costs an inline encode ~1.5 us a character on a slow
2-vCPU guest (a 5,000-token prompt: 12-14 ms of loop time inline, 3.7 ms offloaded, the same CPU in all), so
4096 bounds it near 6 ms there; a prompt repeating cached text stays inline. ``threshold_chars=0`` never offloads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

DEFAULT_OFFLOAD_CHARS = 4096
BULK_CHARS = 1 << 19
"""Prompts with more characters than this (~128 k tokens of English) are encoded one at a time, on a
thread of their own (``TokenizeOffload``)."""
LOOP_SWITCH_INTERVAL_MS = 0.5
"""The frontend's GIL switch interval (``sys.setswitchinterval``; CPython's default is 5 ms)."""
# two threads: one huge prompt does not hold up the next one; more would only fight over 2 cores
_MAX_THREADS = 2

T = TypeVar("T")

ENCODER_POOL_ENV = "RAYON_NUM_THREADS"
"""The size of the tokenizer library's encode pool (Rust, rayon); ``TOKENIZERS_PARALLELISM=false`` turns it off."""


def bound_encoder_threads(environ: MutableMapping[str, str] | None = None, cores: int | None = None) -> int | None:
    """Size the tokenizer library's encode pool to the cores this process may run on less one (at least one),
    so a long prompt's encode never takes the event loop's core. An operator's ``RAYON_NUM_THREADS`` or
    ``TOKENIZERS_PARALLELISM`` is left alone (returns None). Takes effect only before the first batch
    encode, which builds the pool: call it first thing in a process that serves requests."""
    env = os.environ if environ is None else environ
    if ENCODER_POOL_ENV in env or "TOKENIZERS_PARALLELISM" in env:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    threads = max(1, cores - 1)
    env[ENCODER_POOL_ENV] = str(threads)
    return threads


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of prompt text in an OpenAI body (chat messages, completion prompt, responses
    input), counted without copying; token-id prompts count 0."""
    n = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, Mapping):
                n += _content_chars(m.get("content"))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n += len(prompt)
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        n += len(prompt[0])
    inp = body.get("input")
    if isinstance(inp, str):
        n += len(inp)
    elif isinstance(inp, list):
        for item in inp:
            if isinstance(item, str):
                n += len(item)
            elif isinstance(item, Mapping):
                n += _content_chars(item.get("content"))
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        n += len(instructions)
    return n


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    n = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                n += len(part["text"])
    return n


class TokenizeOffload:
    """Runs a tokenize function inline, on a small thread pool, or on the bulk thread, by prompt size."""

    def __init__(self, threshold_chars: int = DEFAULT_OFFLOAD_CHARS, bulk_chars: int = BULK_CHARS) -> None:
        if threshold_chars < 0:
            raise ValueError("the tokenizer offload threshold must be >= 0 (0 = never offload)")
        self.threshold_chars = threshold_chars
        self.bulk_chars = bulk_chars
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bulk: concurrent.futures.ThreadPoolExecutor | None = None
        self.offloaded = 0  # prompts tokenized in a thread (tests and metrics read it)

    def offloads(self, chars: int) -> bool:
        return 0 < self.threshold_chars < chars

    def start(self, timeout: float = 30.0) -> None:
        """Start every thread of both pools now, off the event loop (before serving): a pool started by
        ``run`` starts its threads on the loop, which waits for each to run. No-op when it never offloads."""
        if self.threshold_chars == 0 or self._pool is not None:
            return
        pools = [(self._new_pool(), _MAX_THREADS), (self._new_bulk_pool(), 1)]
        # each task holds its thread until all are running, so every submit starts a new thread
        ready = threading.Barrier(sum(threads for _, threads in pools) + 1)  # the pools' threads and this one
        for pool, threads in pools:
            for _ in range(threads):
                pool.submit(ready.wait, timeout)
        ready.wait(timeout)

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._pool = concurrent.futures.ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="tokenize")
        return self._pool

    def _new_bulk_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._bulk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize-bulk")
        return self._bulk

    async def run(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, nogil=..., **kwargs)``: inline for short prompts, in a thread (``nogil=True``) for long ones,
        on the bulk thread for those over ``bulk_chars`` (a pool not ``start``-ed starts here, on the loop)."""
        if not self.offloads(chars):
            return fn(*args, nogil=False, **kwargs)
        if chars > self.bulk_chars:
            pool = self._bulk if self._bulk is not None else self._new_bulk_pool()
        else:
            pool = self._pool if self._pool is not None else self._new_pool()
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: fn(*args, nogil=True, **kwargs))

    def close(self) -> None:
        for pool in (self._pool, self._bulk):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._bulk = None
