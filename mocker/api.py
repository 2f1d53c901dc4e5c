"""The mocker's HTTP surface: vLLM's OpenAI server routes (and its Anthropic ``/v1/messages``) over
the simulated engine ranks.

Requests are tokenised with ``kvroute_common.tokenizer`` (the frontend's code, so both agree on
token ids), routed to the DP rank of header ``X-data-parallel-rank`` (vLLM's header; default 0)
and answered in OpenAI's shapes, streamed as SSE or folded. Errors use vLLM's envelope
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import orjson
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvroute_common import anthropic_api
from kvroute_common.multimodal import ImageContext, Placeholder, remote_image_urls
from kvroute_common.openai_api import OpenAIError, read_openai_body, responses_to_chat
from kvroute_common.tokenize_offload import TokenizeOffload, prompt_chars
from kvroute_common.tokenizer import (
    PromptError,
    chat_request_prompt,
    completion_prompt_token_ids,
    image_layout,
    load_tokenizer,
)
from mocker import anthropic
from mocker.config import MockerConfig
from mocker.engine import (
    FINISH_ABORT,
    FINISH_STOP,
    EngineRank,
    RankScheduler,
    Sequence,
    sequence_rng,
    word_token_ids,
)
from mocker.events import KvEventPublisher
from mocker.kv_cache import KvCache
from mocker.metrics import MockerMetrics, render_sglang
from mocker.perf_model import PerfModel

log = logging.getLogger("mocker.api")

DP_RANK_HEADER = "x-data-parallel-rank"
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "BadRequestError",
    415: "BadRequestError",
    499: "Client Closed Request",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_JSON = "application/json"
MAX_BODY = 64 * 1024 * 1024


def error_response(status: int, message: str, param: str | None = None) -> Response:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }
    return Response(orjson.dumps(body), status_code=status, media_type=_JSON)


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type=_JSON)


def _read_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the value itself (vLLM accepts both)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


class Mocker:
    """Everything one mocker process owns: tokenizer, engine ranks, publishers, metrics."""

    def __init__(self, cfg: MockerConfig) -> None:
        self.cfg = cfg
        self.adapters = cfg.adapters()  # LoRA adapter -> path
        self.adapter_ids = {name: i for i, name in enumerate(self.adapters, 1)}
        self.tokenizer = load_tokenizer(cfg.model_path)
        layout = image_layout(self.tokenizer)
        # images keyed as vLLM keys them, with the model id it reports as its root in /v1/models
        self.images = ImageContext(layout, cfg.model_path or cfg.served_model_name) if layout is not None else None
        if cfg.chat_template:  # a copy: the loaded tokenizer is shared per path
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.chat_template = _read_template(cfg.chat_template)
        self.started = int(time.time())
        tok = self.tokenizer
        self.eos_token_id = tok.eos_token_id
        self.special_ids = set(tok.all_special_ids)
        vocab = word_token_ids(tok)
        self.token_seed = cfg.seed if cfg.seed is not None else 0
        ext_seed = cfg.seed if cfg.seed is not None else random.SystemRandom().getrandbits(64)
        perf = PerfModel(cfg.speedup_ratio, cfg.load_profile())
        self.schedulers: list[RankScheduler] = []
        for rank in range(cfg.data_parallel_size):
            kv = KvCache(
                cfg.num_gpu_blocks, cfg.block_size, ext_seed=(ext_seed + rank) & (2**64 - 1), emit_events=cfg.kv_events
            )
            self.schedulers.append(
                RankScheduler(
                    kv, perf, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.eos_token_id, output_vocab=vocab
                )
            )
        self.metrics = MockerMetrics(cfg, self.schedulers)
        for rank, s in enumerate(self.schedulers):
            s.on_first_token = (lambda r: lambda seq, ttft: self.metrics.first_token(r, seq, ttft))(rank)
            s.on_finished = (
                lambda r: lambda seq, reason: self.metrics.finished(r, seq, reason, time.monotonic() - seq.arrival_time)
            )(rank)
        self.publishers: list[KvEventPublisher] = []
        self.ranks: list[EngineRank] = []
        self._zmq: zmq.asyncio.Context | None = None
        self._piece_cache: dict[int, str] = {}
        self.tokenize = TokenizeOffload()  # long prompts on a thread, like the frontend
        # disaggregated serving: this engine's id in the transfer params it hands out (vLLM: engine_id)
        self.engine_id = uuid.uuid4().hex
        # the ``priority`` field of recent generation requests as received (None = absent), for tests
        # that check what the frontend sent (e.g. its per-engine sign); bounded
        self.received_priorities: deque[int | None] = deque(maxlen=256)

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.kv_events:
            self._zmq = zmq.asyncio.Context()
            for rank in range(cfg.data_parallel_size):
                pub = KvEventPublisher(
                    self._zmq, rank, cfg.kv_events_endpoint, cfg.replay_endpoint, buffer_steps=cfg.replay_buffer_steps
                )
                pub.start()
                self.publishers.append(pub)
        for rank, sched in enumerate(self.schedulers):
            publish = self.publishers[rank].publish if self.publishers else None
            er = EngineRank(rank, sched, publish)
            er.start()
            self.ranks.append(er)

    async def stop(self) -> None:
        for er in self.ranks:
            await er.stop()
        for pub in self.publishers:
            await pub.close()
        self.tokenize.close()
        if self._zmq is not None:
            self._zmq.term()

    # -- helpers ---------------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        """Text of one generated token (special tokens render as nothing, like vLLM)."""
        text = self._piece_cache.get(token_id)
        if text is None:
            text = "" if token_id in self.special_ids else self.tokenizer.decode([token_id])
            self._piece_cache[token_id] = text
        return text

    def dp_rank(self, request: Request) -> int:
        raw = request.headers.get(DP_RANK_HEADER)
        if raw is None or raw.strip() == "":
            return 0
        try:
            rank = int(raw)
        except ValueError:
            raise OpenAIError(400, f"invalid {DP_RANK_HEADER} header: {raw!r}") from None
        if not 0 <= rank < self.cfg.data_parallel_size:
            raise OpenAIError(400, f"data parallel rank {rank} is out of range [0, {self.cfg.data_parallel_size})")
        return rank


# --------------------------------------------------------------------------------------------
# request parsing


async def _body(request: Request) -> dict:
    ctype = request.headers.get("content-type", "")
    if ctype and "json" not in ctype:
        raise OpenAIError(415, f"unsupported content type {ctype!r}; expected application/json")
    _raw, body = await read_openai_body(request, MAX_BODY)
    return body


def _opt_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not int:
        raise OpenAIError(400, f"{name} must be an integer", name)
    if minimum is not None and v < minimum:
        raise OpenAIError(400, f"{name} must be at least {minimum}, got {v}", name)
    return v


def _opt_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OpenAIError(400, f"{name} must be a boolean", name)
    return v


class Params:
    """Validated generation parameters of one request."""

    __slots__ = (
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "priority",
        "seed",
        "stream",
        "include_usage",
        "remote_decode",
        "remote_tokens",
    )
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop: list[str]
    stop_token_ids: frozenset[int]
    priority: int
    seed: int | None
    stream: bool
    include_usage: bool
    remote_decode: bool  # compute the prompt here for a decode engine (kv_transfer_params)
    remote_tokens: int  # prompt tokens whose KV came from a prefill engine


def _transfer(m: Mocker, body: dict, p: Params, prompt_len: int) -> None:
    """vLLM's ``kv_transfer_params`` (NIXL connector fields) for disaggregated serving.

    ``do_remote_decode``: compute the prompt here and answer with the params a decode engine needs
    (``--role prefill|both``). ``do_remote_prefill``: the prompt's KV comes from the engine named in
    ``remote_engine_id`` (``remote_block_ids``): register those blocks without computing them
    (``--role decode|both``). Absent or all-false: an ordinary request.
    """
    p.remote_decode = False
    p.remote_tokens = 0
    params = body.get("kv_transfer_params")
    if params is None:
        return
    if not isinstance(params, dict):
        raise OpenAIError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    role = m.cfg.role
    if params.get("do_remote_decode"):
        if role == "decode":
            raise OpenAIError(
                400,
                "this engine is a decode worker (--role decode): it cannot prefill for a remote decode",
                "kv_transfer_params",
            )
        p.remote_decode = True
    elif params.get("do_remote_prefill"):
        if role == "prefill":
            raise OpenAIError(
                400,
                "this engine is a prefill worker (--role prefill): it cannot decode a remotely prefilled request",
                "kv_transfer_params",
            )
        ids = params.get("remote_block_ids")
        if not isinstance(ids, list) or any(type(i) is not int for i in ids):
            raise OpenAIError(
                400, "kv_transfer_params.remote_block_ids must be a list of integers", "kv_transfer_params"
            )
        if not isinstance(params.get("remote_engine_id"), str) or not params["remote_engine_id"]:
            raise OpenAIError(
                400, "kv_transfer_params.remote_engine_id must be a non-empty string", "kv_transfer_params"
            )
        p.remote_tokens = min(prompt_len, len(ids) * m.cfg.block_size)


def _params(m: Mocker, body: dict, prompt_len: int, chat: bool) -> Params:
    p = Params()
    if _opt_int(body, "n", 1) not in (None, 1):
        raise OpenAIError(400, "the mocker supports n=1 only", "n")
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    limit = m.cfg.max_model_len
    if prompt_len >= limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
        )
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    capacity = (m.cfg.num_gpu_blocks - 1) * m.cfg.block_size  # block 0 is the null block, as in vLLM
    if prompt_len + 1 > capacity:
        raise OpenAIError(400, f"the prompt has {prompt_len} tokens but the KV cache holds only {capacity} tokens")
    p.max_tokens = max_tokens
    p.min_tokens = _opt_int(body, "min_tokens", 0) or 0
    if p.min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens ({p.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    p.ignore_eos = _opt_bool(body, "ignore_eos")
    stop = body.get("stop")
    if stop is None:
        p.stop = []
    elif isinstance(stop, str):
        p.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p.stop = [s for s in stop if s]
    else:
        raise OpenAIError(400, "stop must be a string or a list of strings", "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or any(type(t) is not int for t in ids):
        raise OpenAIError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    p.stop_token_ids = frozenset(ids)
    raw_priority = _opt_int(body, "priority")
    m.received_priorities.append(raw_priority)
    p.priority = raw_priority or 0
    p.seed = _opt_int(body, "seed")
    p.stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise OpenAIError(400, "stream_options must be an object", "stream_options")
    p.include_usage = bool(opts and opts.get("include_usage"))
    _transfer(m, body, p, prompt_len)
    return p


def _check_model(m: Mocker, body: dict) -> str:
    model = body.get("model")
    name = m.cfg.served_model_name
    if model is None or model == "":
        return name
    if model != name and model not in m.adapters:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
    return str(model)


# --------------------------------------------------------------------------------------------
# generation


class _TextTracker:
    """Detokenised output with stop-string handling (held-back text that may start a stop)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stop_reason: str | int | None = None

    def add(self, piece: str, final: bool) -> tuple[str, bool]:
        """Append a token's text; returns (text to send now, stopped by a stop string)."""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if self.stops:
            best = -1
            for s in self.stops:
                i = self.text.find(s, start)
                if i != -1 and (best == -1 or i < best):
                    best, self.stop_reason = i, s
            if best != -1:
                self.text = self.text[:best]
                out = self.text[self.sent :]
                self.sent = len(self.text)
                return out, True
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out, False


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def chat_prompt(m: Mocker, body: dict) -> tuple[list[int], list[Placeholder]]:
    """A chat body's tokens as vLLM runs them, images expanded (remote ones fetched first), and where
    the images lie."""
    images = m.images
    if images is not None:
        urls = remote_image_urls(body)
        if urls:
            images = replace(images, fetched=await fetch_images(urls, images.max_bytes))
    return await m.tokenize.run(prompt_chars(body), chat_request_prompt, m.tokenizer, body, images)


async def fetch_images(urls: list[str], max_bytes: int) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    async with httpx.AsyncClient(follow_redirects=True, timeout=10.0) as client:
        for url in urls:
            try:
                resp = await client.get(url)
            except httpx.HTTPError as exc:
                raise OpenAIError(400, f"the image at {url} could not be fetched: {exc}") from None
            if resp.status_code != 200 or len(resp.content) > max_bytes:
                raise OpenAIError(400, f"the image at {url} could not be fetched (HTTP {resp.status_code})")
            out[url] = resp.content
    return out


async def _generate(
    m: Mocker, request: Request, body: dict, prompt: list[int], chat: bool, images: list[Placeholder] | None = None
) -> Response:
    model = _check_model(m, body)
    rank = m.dp_rank(request)
    p = _params(m, body, len(prompt), chat)
    queue: asyncio.Queue[tuple[int | None, str | None]] = asyncio.Queue()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    held_blocks: list[int] = []

    def sink(token: int | None, reason: str | None) -> None:
        if reason is not None and p.remote_decode and not held_blocks:
            held_blocks.extend(b.id for b in seq.blocks)  # what a decode engine would pull (before release)
        queue.put_nowait((token, reason))

    seq = Sequence(
        rid,
        prompt,
        p.max_tokens,
        sink,
        sequence_rng(m.token_seed, p.seed, prompt),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids,
        priority=p.priority,
    )
    seq.remote_tokens = p.remote_tokens
    seq.images = images or []
    if model in m.adapters:  # its blocks are keyed by the adapter, as vLLM's are
        seq.lora_name, seq.lora_id = model, m.adapter_ids[model]
    engine = m.ranks[rank]
    engine.submit(seq)
    created = int(time.time())
    tracker = _TextTracker(p.stop)

    def usage() -> dict:
        return {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + seq.num_output,
            "completion_tokens": seq.num_output,
            "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens},
        }

    def consume(token: int | None, reason: str | None) -> tuple[str, str | None]:
        """Text for one engine output and the finish reason (stop strings end the request)."""
        text = ""
        if token is not None:
            if token in p.stop_token_ids and reason == FINISH_STOP:
                tracker.stop_reason = token
            elif token != m.eos_token_id or reason != FINISH_STOP:
                text, hit = tracker.add(m.piece(token), final=reason is not None)
                if hit:
                    engine.abort(rid, FINISH_STOP)
                    return text, FINISH_STOP
        if reason is not None:
            tail, _ = tracker.add("", final=True)
            text += tail
        return text, reason

    stall_after = m.cfg.stall_after_tokens

    if not p.stream:
        finish = None

        async def collect() -> None:
            nonlocal finish
            n = 0
            while finish is None:
                if stall_after is not None and n >= stall_after:
                    await asyncio.Event().wait()  # --stall-after-tokens: never answers (a hung worker)
                token, reason = await queue.get()
                _, finish = consume(token, reason)
                n += 1

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((collector, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if finish is None:  # client went away (or the handler was cancelled): free the engine's blocks
                collector.cancel()
                engine.abort(rid)
        if finish is None:
            return error_response(499, "client disconnected")
        if finish == FINISH_ABORT:
            return error_response(503, "request aborted by the engine")
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": tracker.text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": tracker.stop_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": tracker.text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": tracker.stop_reason,
            }
            obj = "text_completion"
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage()}
        if p.remote_decode:  # vLLM's NIXL connector: what the decode engine needs to pull this prompt's KV
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": held_blocks,
                "remote_engine_id": m.engine_id,
                "remote_host": m.cfg.host,
                "remote_port": m.cfg.port,
                "tp_size": 1,
            }
        return json_response(out)

    obj = "chat.completion.chunk" if chat else "text_completion"
    dumps = orjson.dumps

    def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = tracker.stop_reason
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if p.include_usage:
            payload["usage"] = None
        return b"data: " + dumps(payload) + b"\n\n"

    async def stream() -> AsyncIterator[bytes]:
        finish = None
        sent = 0
        try:
            if chat:
                yield chunk(None, None, role=True)
            while finish is None:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                out = bytearray()
                for token, reason in items:
                    if stall_after is not None and sent >= stall_after:
                        break
                    text, finish = consume(token, reason)
                    if text or finish is not None:
                        out += chunk(text, finish)
                        sent += 1
                    if finish is not None:
                        break
                if out:
                    yield bytes(out)
                if stall_after is not None and sent >= stall_after and finish is None:
                    # --stall-after-tokens: a hung worker; the connection stays open, nothing more is sent
                    await asyncio.Event().wait()
            if p.include_usage:
                yield (
                    b"data: "
                    + dumps(
                        {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage()}
                    )
                    + b"\n\n"
                )
            yield b"data: [DONE]\n\n"
        finally:
            if finish is None:  # client went away: free the engine's blocks now
                engine.abort(rid)

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"cache-control": "no-cache", "x-request-id": rid}
    )


EMBEDDING_DIM = 16


def _embedding_inputs(inp: Any) -> list[str | list[int]]:
    """OpenAI's ``input`` forms: a string, a list of strings, a token-id list, a list of token-id lists."""
    if isinstance(inp, str):
        return [inp]
    if isinstance(inp, list) and inp:
        if all(type(t) is int for t in inp):
            return [inp]
        if all(isinstance(t, str) for t in inp) or all(
            isinstance(t, list) and t and all(type(x) is int for x in t) for t in inp
        ):
            return list(inp)
    raise OpenAIError(
        400, "input must be a non-empty string, list of strings, list of token ids or list of token-id lists", "input"
    )


def _embed(ids: list[int], dims: int) -> list[float]:
    """A deterministic unit vector from the token ids (same input, same vector)."""
    import math

    import xxhash

    raw = b"".join(t.to_bytes(4, "little") for t in ids)
    vals = [((xxhash.xxh3_64_intdigest(raw, seed=i) % 20001) - 10000) / 10000.0 for i in range(dims)]
    norm = math.sqrt(sum(v * v for v in vals)) or 1.0
    return [v / norm for v in vals]


# --------------------------------------------------------------------------------------------
# routes


def build_app(cfg: MockerConfig, mocker: Mocker | None = None) -> Starlette:
    m = mocker or Mocker(cfg)

    def handler(fn):
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except OpenAIError as exc:
                return error_response(exc.status, exc.message, exc.param)
            except PromptError as exc:
                return error_response(400, str(exc))

        return wrapped

    def anthropic_handler(fn):
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except (OpenAIError, PromptError) as exc:
                return anthropic.error(getattr(exc, "status", 400), getattr(exc, "message", str(exc)))

        return wrapped

    async def messages_prompt(
        request: Request, generating: bool = True
    ) -> tuple[dict, tuple[list[int], list[Placeholder]]]:
        """A Messages request as vLLM takes it: validated, rendered as the chat request it generates, tokenized."""
        body = await _body(request)
        _check_model(m, body)
        anthropic_api.validate_request(body, require_max_tokens=generating)
        chat = anthropic.chat_body(body, anthropic_api.tokenizer_template(m.tokenizer))
        return chat, await chat_prompt(m, chat)

    async def messages(request: Request) -> Response:
        """Anthropic Messages, as vLLM serves them: rendered and generated as chat, answered as messages."""
        chat, (prompt, images) = await messages_prompt(request)
        answer = await _generate(m, request, chat, prompt, chat=True, images=images)
        if answer.status_code != 200:
            return anthropic.from_openai_error(answer)
        if isinstance(answer, StreamingResponse):
            return anthropic.streaming(answer)
        return json_response(anthropic.message(orjson.loads(answer.body)))

    async def count_tokens(request: Request) -> Response:
        _chat, (prompt, _images) = await messages_prompt(request, generating=False)
        return json_response({"input_tokens": len(prompt)})

    async def chat_completions(request: Request) -> Response:
        body = await _body(request)
        _check_model(m, body)
        prompt, images = await chat_prompt(m, body)
        return await _generate(m, request, body, prompt, chat=True, images=images)

    async def completions(request: Request) -> Response:
        body = await _body(request)
        _check_model(m, body)
        if "prompt" not in body:
            raise OpenAIError(400, "prompt is required", "prompt")
        prompt = await m.tokenize.run(prompt_chars(body), completion_prompt_token_ids, m.tokenizer, body["prompt"])
        return await _generate(m, request, body, prompt, chat=False)

    async def responses(request: Request) -> Response:
        """OpenAI Responses API, minimal: text input (string or message items), text output, not streamed.
        Tokenized like chat (instructions = system message), generated by the same engine."""
        body = await _body(request)
        model = _check_model(m, body)
        if _opt_bool(body, "stream"):
            raise OpenAIError(400, "the mocker answers /v1/responses without streaming only", "stream")
        chat = responses_to_chat(body)
        chat["model"] = model
        for key in ("temperature", "top_p", "seed", "priority"):
            if key in body:
                chat[key] = body[key]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        prompt, images = await chat_prompt(m, chat)
        answer = await _generate(m, request, chat, prompt, chat=True, images=images)
        if answer.status_code != 200:
            return answer
        done = orjson.loads(answer.body)
        choice = done["choices"][0]
        u = done["usage"]
        rid = "resp_" + done["id"].split("-", 1)[-1]
        return json_response(
            {
                "id": rid,
                "object": "response",
                "created_at": done["created"],
                "model": model,
                "status": "completed" if choice["finish_reason"] == "stop" else "incomplete",
                "incomplete_details": None if choice["finish_reason"] == "stop" else {"reason": "max_output_tokens"},
                "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"),
                "output": [
                    {
                        "type": "message",
                        "id": "msg_" + rid[5:],
                        "status": "completed",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": choice["message"]["content"], "annotations": []}],
                    }
                ],
                "usage": {
                    "input_tokens": u["prompt_tokens"],
                    "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                    "output_tokens": u["completion_tokens"],
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u["total_tokens"],
                },
            }
        )

    async def embeddings(request: Request) -> Response:
        """OpenAI embeddings, minimal: a deterministic unit vector per input (text or token ids),
        as floats or base64 float32 (the openai SDK asks for base64)."""
        body = await _body(request)
        model = _check_model(m, body)
        inputs = _embedding_inputs(body.get("input"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise OpenAIError(400, "encoding_format must be 'float' or 'base64'", "encoding_format")
        dims = body.get("dimensions") or EMBEDDING_DIM
        if type(dims) is not int or dims < 1 or dims > 4096:
            raise OpenAIError(400, "dimensions must be an integer in [1, 4096]", "dimensions")
        data = []
        total = 0
        for i, item in enumerate(inputs):
            ids = item if isinstance(item, list) else completion_prompt_token_ids(m.tokenizer, item)
            if len(ids) >= cfg.max_model_len:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                    f"your request has {len(ids)} input tokens. Please reduce the length of the input.",
                )
            total += len(ids)
            vec = _embed(ids, dims)
            if fmt == "base64":
                import base64
                import struct

                emb: Any = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode()
            else:
                emb = vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return json_response(
            {
                "id": "embd-" + uuid.uuid4().hex,
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
            }
        )

    async def models(request: Request) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.served_model_name,
                        "object": "model",
                        "created": m.started,
                        "owned_by": cfg.impersonate,
                        "root": cfg.model_path or cfg.served_model_name,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [],
                    }
                ]
                + [
                    {
                        "id": name,
                        "object": "model",
                        "created": m.started,
                        "owned_by": cfg.impersonate,
                        "root": path,
                        "parent": cfg.served_model_name,
                        "max_model_len": None,
                        "permission": [],
                    }
                    for name, path in m.adapters.items()
                ],
            }
        )

    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        _check_model(m, body)
        if "messages" in body:
            tokens, _images = await chat_prompt(m, body)
        elif isinstance(body.get("prompt"), str):
            if _opt_bool(body, "add_special_tokens", True):
                tokens = completion_prompt_token_ids(m.tokenizer, body["prompt"])
            else:
                tokens = m.tokenizer.encode(body["prompt"], add_special_tokens=False)
        else:
            raise OpenAIError(400, "prompt (string) or messages is required")
        return json_response({"count": len(tokens), "max_model_len": cfg.max_model_len, "tokens": tokens})

    async def render_chat(request: Request) -> Response:
        body = await _body(request)
        _check_model(m, body)
        ids, _images = await chat_prompt(m, body)
        return json_response({"request_id": uuid.uuid4().hex, "token_ids": ids})

    async def render_completion(request: Request) -> Response:
        body = await _body(request)
        _check_model(m, body)
        if "prompt" not in body:
            raise OpenAIError(400, "prompt is required", "prompt")
        ids = await m.tokenize.run(prompt_chars(body), completion_prompt_token_ids, m.tokenizer, body["prompt"])
        return json_response([{"request_id": uuid.uuid4().hex, "token_ids": ids}])

    async def render_messages(request: Request) -> Response:
        _chat, (ids, _images) = await messages_prompt(request)
        return json_response({"request_id": uuid.uuid4().hex, "token_ids": ids})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        text = render_sglang(cfg, m.schedulers) if cfg.impersonate == "sglang" else m.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def get_server_info(request: Request) -> Response:
        """SGLang's ``GET /get_server_info`` (``--impersonate sglang``): its server args at the top
        level and the scheduler's state under ``internal_states``."""
        return json_response(
            {
                "model_path": cfg.model_path or cfg.served_model_name,
                "served_model_name": cfg.served_model_name,
                "page_size": cfg.block_size,
                "chunked_prefill_size": cfg.max_num_batched_tokens,
                "max_running_requests": cfg.max_num_seqs,
                "context_length": cfg.max_model_len,
                "dp_size": cfg.data_parallel_size,
                "schedule_policy": "fcfs",
                "schedule_low_priority_values_first": False,
                "version": "mocker",
                "internal_states": [
                    {"max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size, "page_size": cfg.block_size}
                ],
            }
        )

    async def server_info(request: Request) -> Response:
        """vLLM's dev-mode ``/server_info``: the engine config (the only place vLLM exposes its
        scheduler budget); ``config_format=json`` as a structure, else as text."""
        vllm_config = {
            "model_config": {
                "model": cfg.model_path or cfg.served_model_name,
                "served_model_name": cfg.served_model_name,
                "max_model_len": cfg.max_model_len,
            },
            "cache_config": {
                "block_size": cfg.block_size,
                "num_gpu_blocks": cfg.num_gpu_blocks,
                "num_gpu_blocks_override": cfg.num_gpu_blocks,
                "enable_prefix_caching": True,
                "cache_dtype": "auto",
            },
            "scheduler_config": {
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs,
                "max_model_len": cfg.max_model_len,
            },
            "parallel_config": {"data_parallel_size": cfg.data_parallel_size},
        }
        if request.query_params.get("config_format", "text") == "json":
            return json_response({"vllm_config": vllm_config})
        return json_response({"vllm_config": str(vllm_config)})

    async def reset_prefix_cache(request: Request) -> Response:
        busy = [er.rank for er in m.ranks if not er.reset_prefix_cache()]
        if busy:
            raise OpenAIError(409, f"prefix cache not reset on DP rank(s) {busy}: requests are running")
        return Response(status_code=200)

    async def kv_blocks(request: Request) -> Response:
        """Mocker-only: the blocks a rank currently caches (for tests and debugging)."""
        try:
            rank = int(request.query_params.get("dp_rank", "0"))
        except ValueError:
            raise OpenAIError(400, "dp_rank must be an integer") from None
        if not 0 <= rank < cfg.data_parallel_size:
            raise OpenAIError(400, f"dp_rank {rank} out of range")
        s = m.schedulers[rank]
        return json_response(
            {
                "dp_rank": rank,
                "block_size": cfg.block_size,
                "num_gpu_blocks": cfg.num_gpu_blocks,
                "num_free": s.kv.num_free,
                "blocks": s.kv.snapshot(),
                "events_published": m.publishers[rank].next_seq if m.publishers else 0,
                "computed_prompt_tokens": s.stats.computed_prompt_tokens,
                "remote_kv_tokens": s.stats.remote_kv_tokens,
                "role": cfg.role,
            }
        )

    async def kv_event_sources(request: Request) -> Response:
        """vLLM's ``GET /kv_event_sources``: the KV-event publisher config of each DP rank (bind addresses,
        as configured), so a router given only this engine's URL finds its events."""
        from .events import offset_endpoint

        out = {}
        for rank in range(cfg.data_parallel_size):
            replay = offset_endpoint(cfg.replay_endpoint, rank) if cfg.replay_endpoint else None
            out[str(rank)] = {
                "enable_kv_cache_events": cfg.kv_events,
                "publisher": "zmq" if cfg.kv_events else "null",
                "endpoint": offset_endpoint(cfg.kv_events_endpoint, rank),
                "replay_endpoint": replay,
                "topic": "",
            }
        return json_response(out)

    async def priorities(request: Request) -> Response:
        """Mocker-only: the ``priority`` field of the most recent generation requests, oldest first."""
        return json_response({"priorities": list(m.received_priorities)})

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await m.start()
        try:
            yield
        finally:
            await m.stop()

    routes = [
        Route("/v1/chat/completions", handler(chat_completions), methods=["POST"]),
        Route("/v1/completions", handler(completions), methods=["POST"]),
        Route("/v1/models", handler(models), methods=["GET"]),
        Route("/v1/responses", handler(responses), methods=["POST"]),
        Route("/v1/embeddings", handler(embeddings), methods=["POST"]),
        Route("/v1/messages", anthropic_handler(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_handler(count_tokens), methods=["POST"]),
        Route("/tokenize", handler(tokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/reset_prefix_cache", handler(reset_prefix_cache), methods=["POST"]),
        Route("/kv_event_sources", handler(kv_event_sources), methods=["GET"]),
        Route("/mocker/kv_blocks", handler(kv_blocks), methods=["GET"]),
        Route("/mocker/priorities", handler(priorities), methods=["GET"]),
    ]
    if cfg.enable_scale_out:
        routes += [
            Route("/v1/chat/completions/render", handler(render_chat), methods=["POST"]),
            Route("/v1/completions/render", handler(render_completion), methods=["POST"]),
            Route("/v1/messages/render", handler(render_messages), methods=["POST"]),
        ]
    if cfg.impersonate == "sglang":
        routes.append(Route("/get_server_info", handler(get_server_info), methods=["GET"]))
    elif cfg.server_info:
        routes.append(Route("/server_info", handler(server_info), methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.mocker = m
    return app
