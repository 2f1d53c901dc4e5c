"""The request path every transport shares: a generation request from parse to its end.

Parse -> hints (nvext + headers) -> tokenize -> admission (router queue) -> route (indexer overlaps +
tracker loads + cost) -> book -> send -> first token = prefill complete -> end / error / disconnect =
free, with migration to another worker when one fails. The HTTP API (``frontend/api/openai_routes.py``)
sends through the proxy (``RequestPath.send``); the endpoint picker (``frontend/gateway``) hands the
booking to its gateway instead."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from frontend.dispatch.context import RequestContext, RequestSource, Send
from frontend.dispatch.lifecycle import Lease
from frontend.dispatch.migration import NEW_REQUEST, ONGOING_REQUEST, SseTracker, continuation_body, migratable
from frontend.dispatch.proxy import StreamProxy, upstream_headers
from frontend.dispatch.response_rewriter import ResponseRewriter
from frontend.dispatch.unary_stream import UnaryAssembler, convertible, streaming_body
from frontend.dispatch.upstream import UpstreamConnectError, UpstreamError, UpstreamTimeout
from frontend.observability.parity import stream_body_with_usage
from frontend.request.errors import (
    UNKNOWN_MODEL,
    OpenAIError,
    RequestShapeError,
    as_anthropic,
    model_not_found,
    openai_error_response,
)
from frontend.request.hints import RequestTiming, apply_to_body, check_supported, engine_priority, parse_request_hints
from frontend.request.validation import validate_messages, validate_sampling, validate_tools
from frontend.routing import disagg as _disagg
from frontend.routing.admission import ClientDisconnected, QueueRejected
from frontend.routing.engine_polarity import for_worker as _priority_for_worker
from frontend.routing.models import ModelEntry
from frontend.routing.prompt import (
    IDS_BODY_INLINE_MAX,
    Prompt,
    engine_token_ids,
    hash_tokens,
    ids_body_off_loop,
    takes_prompt_ids,
    tokenize_request,
)
from frontend.routing.routing_record import wants_routing
from frontend.state import FrontendState
from kvroute_common import anthropic_api
from kvroute_common.http import ApiError

if TYPE_CHECKING:
    from frontend.observability.tracing import RequestTrace
    from frontend.request.hints import RequestHints

log = logging.getLogger("frontend")
_perf = time.perf_counter

BODY_LIMIT = 45 * 1024 * 1024  # DYN_HTTP_BODY_LIMIT_MB default
# Retry-After of a backpressure 529: the queue drains as prefills complete (well under a second on
# a healthy worker), so a client that waits one second finds fresh capacity numbers.
RETRY_AFTER_SECS = "1"

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class RequestPath:
    """Decide, book, send and follow one request (``generate``), for the proxy and the picker."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def generate(self, source: RequestSource, kind: str, send: Send) -> Any:
        """One generation request, whatever carries it: parse, hints, tokenize, admission, then route,
        book and ``send`` (the proxy dispatches to the worker; the endpoint picker hands the decision
        to its gateway). Returns ``send``'s result, or an error response in the API's shape."""
        tracing = self.state.tracing
        if tracing is None:
            result = await self._pipeline(source, kind, send)
        else:  # --otlp-traces-endpoint: the request's spans (frontend/observability/tracing.py)
            result = await tracing.follow(self._pipeline, source, kind, send)
        return as_anthropic(result) if kind == "messages" else result

    async def _pipeline(self, source: RequestSource, kind: str, send: Send, trace: RequestTrace | None = None) -> Any:
        state = self.state
        ctx = RequestContext()
        ctx.trace = trace
        ctx.t_start = _perf()
        ctx.receive = source.receive
        chat = kind in ("chat", "responses", "messages")
        ctx.kind = kind
        ctx.chat = chat
        ctx.endpoint, ctx.path = _KINDS[kind]
        endpoint = ctx.endpoint
        # every way out below but an answer on its way ends the request with ctx.finish_unrouted
        # (counted once, whoever ended it first: a lease, or a step that refused it)
        try:
            raw, body = await source.read(BODY_LIMIT)
            model = body.get("model")
            if not isinstance(model, str):
                raise RequestShapeError("'model' is required", "model")
            stream = body.get("stream", False)
            if stream is None:
                stream = False
            if not isinstance(stream, bool):
                raise RequestShapeError("'stream' must be a boolean", "stream")
            request_type = "stream" if stream else "unary"
            entry = state.models.get(model)
            if entry is None:
                served = model in state.prefill_models  # by prefill workers only
                label = model if served else UNKNOWN_MODEL
                ctx.count_as = state.metrics.model_children(label, endpoint, request_type)
                if served:
                    raise OpenAIError(503, f"model {model} has prefill workers but no decode worker")
                if not model:
                    raise OpenAIError(400, "'model' is required", "model")
                raise model_not_found(model)
            ctx.count_as = counted_as = state.metrics.model_children(model, endpoint, request_type)
            ctx.entry, ctx.stream, ctx.body = entry, stream, body
            if kind == "messages":  # the engine validates sampling in its own (Anthropic) terms
                anthropic_api.validate_request(body)
            elif kind != "embeddings":
                validate_sampling(body, chat)
            if kind == "chat":
                validate_messages(body.get("messages"))
                validate_tools(body)
            elif kind == "responses" and not isinstance(body.get("input"), (str, list)):
                raise RequestShapeError("'input' must be a string or a list", "input")
            ctx.count_start(counted_as)

            modified = False
            hints = None
            if parse_request_hints is not None:
                had_nvext = "nvext" in body
                try:
                    hints = parse_request_hints(body, source.headers, nvext_enabled=state.nvext_enabled)
                    check_supported(hints, chat, stream)
                except ApiError as exc:
                    raise OpenAIError(exc.status, exc.message) from None
                modified = had_nvext
                if apply_to_body(hints, body):
                    modified = True
                if hints.priority is not None and engine_priority is not None:
                    p = engine_priority(hints)
                    if p is not None:
                        body["priority"] = p
                        modified = True
                if hints.want_timing and RequestTiming is not None:
                    ctx.timing = RequestTiming()
                if not hints.cache_salt and isinstance(body.get("cache_salt"), str) and body["cache_salt"]:
                    hints.cache_salt = body["cache_salt"]  # vLLM's own field: the engine salts its blocks with it
                if hints.cache_salt and body.get("cache_salt") != hints.cache_salt:
                    body["cache_salt"] = hints.cache_salt  # vLLM's field: the worker hashes its blocks with it too
                    modified = True
            ctx.hints = hints

            t_tok = _perf()
            salt = hints.cache_salt if hints is not None else None
            if hints is not None and hints.token_data:
                prompt = await hash_tokens(state.tokenize, entry, hints.token_data, salt)
            else:
                prompt = await tokenize_request(state.tokenize, entry, body, kind, salt, state.image_cache)
            state.metrics.tokenize_ms.observe((_perf() - t_tok) * 1e3)
            if trace is not None:
                trace.tokenized(t_tok, model, len(prompt.tokens), stream)
            ctx.prompt = prompt
            ctx.tokens = tokens = prompt.tokens
            if state.rate_limits is not None:  # per-key limits: 429 before anything is queued or sent
                ctx.rate = state.rate_limits.admit(source.headers, len(tokens))
            if kind == "completions" and state.send_token_ids != "never":  # the workers that take ids get them
                ctx.engine_ids = engine_token_ids(body, prompt, hints)
            # embeddings leave no KV cache behind: no hash-parity evidence to collect
            ctx.evidence = kind != "embeddings" and state.parity.sample()
            if ctx.evidence and stream and kind != "messages" and source.reads_response:
                # the engine's usage (cached tokens) feeds the parity alarm and the decomposition (an
                # Anthropic stream always carries its usage)
                spliced, ctx.strip_usage = stream_body_with_usage(body, None if modified else raw)
                if spliced is not None:
                    raw = spliced
                elif ctx.strip_usage:
                    modified = True
            ctx.out_body = orjson.dumps(body) if modified else raw  # the text (migration and prefill use it)
            if ctx.engine_ids is not None and len(ctx.engine_ids) > IDS_BODY_INLINE_MAX:  # on the tokenizer thread
                ctx.ids_body = await ids_body_off_loop(state.tokenize, ctx.out_body, ctx.engine_ids)

            pinned_worker = hints.pinned_worker_id if hints is not None else None
            pinned_rank = hints.pinned_dp_rank if hints is not None else None
            if state.sessions is not None and hints is not None and hints.session_id:
                try:
                    ctx.session = state.sessions.lease(model, hints.session_id)
                except Exception as exc:  # router.session.SessionError
                    raise OpenAIError(getattr(exc, "status", 400), getattr(exc, "message", str(exc))) from None
                target = ctx.session.target
                if target is not None and state.config.router_session_affinity_mode == "soft":
                    ctx.soft_target = target  # a preference (also over headers and nvext), not a pin
                    pinned_worker = pinned_rank = None
                elif target is not None:  # a live binding beats headers and nvext
                    pinned_worker, pinned_rank = target
            if state.admission is not None and hints is not None:
                if ctx.timing is not None:
                    ctx.timing.router_queue_depth = state.admission.depth(model)
                try:
                    await state.admission.wait(
                        model,
                        hints,
                        new_tokens=len(tokens),
                        receive=source.receive,
                        cached_tokens=lambda: state.router.best_cached_tokens(entry, prompt.local_hashes or []),
                    )
                except ClientDisconnected:
                    ctx.finish_unrouted("cancelled", client_gone=True)
                    return Response(b"", status_code=499)
                except QueueRejected as exc:
                    return self._rejected(ctx, exc)
            if ctx.kind in ("chat", "completions") and _disagg.wants_prefill(state, model, hints):  # OpenAI only
                ctx.prefill = await _disagg.run_prefill(state, ctx)
            ctx.failed_workers = source.excluded(state)
            return await self._dispatch(ctx, pinned_worker, pinned_rank, send)
        except OpenAIError as exc:
            # the refusals before count_start that the reference counts: a model nobody serves, on every
            # API; a value out of range on chat completions and responses (text completions validate first)
            if not isinstance(exc, RequestShapeError) and (exc.status != 400 or kind in ("chat", "responses")):
                ctx.count_refused()
            ctx.finish_unrouted(_error_type(exc.status), rejected=exc.status == 529)
            return openai_error_response(exc.status, exc.message, exc.param, getattr(exc, "headers", None))
        except ClientDisconnect:
            # the client went away while still sending its body: a cancellation, not a server error
            state.metrics.disconnected.inc()
            ctx.finish_unrouted("cancelled")
            return Response(b"", status_code=499)
        except Exception as exc:  # a bug or an unexpected library error: still an OpenAI-shaped 500
            log.exception("request failed")
            ctx.finish_unrouted("internal")
            return openai_error_response(500, f"internal error: {type(exc).__name__}: {exc}")
        except BaseException:  # cancelled (the client's task, or the server going down)
            ctx.finish_unrouted("cancelled")
            raise

    def _rejected(self, ctx: RequestContext, exc: Exception) -> Response:
        """Backpressure from the router queue: 529 + Retry-After at once, nothing booked."""
        ctx.finish_unrouted("overload", rejected=True)
        reason = getattr(exc, "reason", "")
        self.state.metrics.queue_backpressure.labels(ctx.mm.model, "decode", "default", reason).inc()
        return openai_error_response(529, getattr(exc, "message", str(exc)), headers={"retry-after": RETRY_AFTER_SECS})

    async def _dispatch(
        self, ctx: RequestContext, pinned_worker: int | None, pinned_rank: int | None, send: Send
    ) -> Any:
        state = self.state
        entry = ctx.entry
        ctx.pinned = pinned_worker is not None
        attempts = 0
        # a prompt prefilled on a prefill worker is routed load-only (frontend/routing/disagg.py)
        router = state.router if ctx.prefill is None else state.disagg_decode_router
        previous: Lease | None = None  # the attempt this one re-sends (its TTFT and hooks are the request's)
        while True:
            attempts += 1
            t_route = _perf() if ctx.trace is not None else 0.0
            salt = ctx.hints.cache_salt if ctx.hints is not None else None
            record = wants_routing(ctx.hints)
            decision = None
            remote, source = (None, None)
            if router is state.router and ctx.kind != "embeddings":
                remote, source = await self.remote_overlaps(entry, ctx.prompt)
            if ctx.soft_target is not None and attempts == 1:
                try:  # soft affinity: the bound worker if it can take the request now
                    decision = router.route(
                        entry,
                        ctx.tokens,
                        ctx.soft_target[0],
                        ctx.soft_target[1],
                        salt,
                        record=record,
                        exclude=ctx.failed_workers,
                        use_overlap=ctx.kind != "embeddings",
                        hashes=ctx.prompt.hashes,
                        overlaps=remote,
                    )
                except OpenAIError:
                    decision = None  # gone, unhealthy or busy: route freely, the session follows
            if decision is None:
                decision = router.route(
                    entry,
                    ctx.tokens,
                    pinned_worker,
                    pinned_rank,
                    salt,
                    record=record,
                    exclude=ctx.failed_workers,
                    use_overlap=ctx.kind != "embeddings",
                    hashes=ctx.prompt.hashes,
                    overlaps=remote,
                )
            decision.overlap_source = source
            request_id = state.next_request_id()
            try:
                router.reserve(entry, request_id, decision)
            except Exception as exc:
                raise OpenAIError(503, f"could not book worker {decision.worker.id}: {exc}") from None
            ctx.attempt = lease = Lease(state.lifecycle, entry, request_id, decision, ctx.mm, ctx.t_start)
            if previous is not None:
                lease.inherit(previous)
            elif ctx.rate is not None:  # the key's token bucket takes the output tokens at the end
                lease.hooks.append(ctx.rate)
            if ctx.trace is not None:
                ctx.trace.routed(lease, t_route, router.label)
            # the rest of the booking waits until the request is on its way (``send`` calls ctx.sent())
            ctx.routed_notes = _RoutedNotes(self, router, ctx, lease)
            try:
                response = await send(ctx, lease)
            except BaseException:
                ctx.sent()
                lease.status, lease.error_type = "error", "cancelled"
                lease.release()
                ctx.counting = False  # the lease recorded the request's end
                raise
            ctx.sent()  # a send that ended before writing anything: the attempt is still counted
            if response is _MIGRATE:  # the worker failed before answering: the same request goes elsewhere
                lease.release(final=False)
                previous = lease
                continue
            if response is _RETRY:
                if attempts < 3 and pinned_worker is None:
                    lease.release(final=False)
                    previous = lease
                    continue
                lease.status, lease.error_type = "error", "unavailable"
                lease.release()
                if ctx.session is not None:
                    ctx.session.invalidate()
                    ctx.session.release()
                return openai_error_response(503, f"worker {decision.worker.id} is unreachable")
            return response

    async def send(self, ctx: RequestContext, lease: Lease) -> Any:
        """One attempt on the lease's worker. Returns a response, or _RETRY when the worker was unreachable."""
        state = self.state
        decision = lease.decision
        worker = decision.worker
        path = ctx.path
        headers = upstream_headers(decision.dp_rank, lease.request_id)
        hints = ctx.hints
        client_id = hints.request_id if hints is not None else None
        if hints is not None and (client_id or hints.metadata):
            from frontend.request.hints import worker_headers

            headers = worker_headers(headers, hints)
        if ctx.trace is not None:  # the engine's spans join the request's trace
            headers = ctx.trace.engine_headers(headers, worker)
        stream = ctx.stream
        session = ctx.session
        # non-streaming: streamed from the engine, reassembled here (prefill completes at its first token)
        as_stream = not stream and ctx.kind in ("chat", "completions") and convertible(ctx.body)
        body = ctx.out_body if ctx.engine_ids is None else ctx.body_for(takes_prompt_ids(state.send_token_ids, worker))
        if as_stream:
            body = streaming_body(ctx.body, body)
        body = _priority_for_worker(body, hints, worker)  # the chosen engine's priority sign
        watch = None
        upstream = None
        if not stream and ctx.receive is not None:
            # a unary request can run for a long time: a client that goes away must free its load now
            watch = _watch_disconnect(ctx.receive)
        if not ctx.dispatched:
            ctx.dispatched = True
            state.metrics.dispatch_path.observe((_perf() - ctx.t_start) * 1e3)
        try:
            upstream = await worker.upstream.request("POST", path, body, headers, stream or as_stream, ctx.sent)
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            _current_task().uncancel()
            lease.client_gone()
            lease.release()
            if session is not None:
                session.release()
            return Response(b"", status_code=499)
        except UpstreamConnectError as exc:
            # never reached the worker: take it out (it is now excluded) and let the caller route again
            state.pool.mark_failed(worker, str(exc))
            return _RETRY
        except UpstreamTimeout as exc:
            _lease_abort(lease, 504)
            if session is not None:
                session.release()
            return openai_error_response(504, str(exc))
        except (UpstreamError, OSError) as exc:
            state.pool.mark_failed(worker, f"{type(exc).__name__}: {exc}")
            if self._may_migrate(ctx):
                self._count_migration(ctx, worker.id, NEW_REQUEST)
                return _MIGRATE
            _lease_abort(lease, 502)
            if session is not None:
                session.invalidate()
                session.release()
            return openai_error_response(502, f"worker {worker.id} failed: {exc}")
        finally:
            if watch is not None and (not as_stream or upstream is None):
                watch.stop()
        if upstream.status != 200:
            if watch is not None:
                watch.stop()
            if stream or as_stream:
                try:
                    data = await upstream.aread()
                except UpstreamError:
                    data = b""
                await upstream.aclose()
            else:
                data = upstream.content
            if session is not None:
                session.release()
            return _upstream_error(lease, upstream.status, data)
        if session is not None:
            session.bind(decision.worker.id, decision.dp_rank, rebind=ctx.soft_target is not None)
            lease.hooks.append(_SessionHook(session))
        rewriter = ResponseRewriter(self.state, ctx, lease) if ctx.rewrite else None
        if stream:
            migrator = _Migrator(self, ctx) if self._may_migrate(ctx) else None
            resp_headers = _SSE_HEADERS + [(b"x-data-parallel-rank", str(decision.dp_rank).encode())]
            if client_id:
                resp_headers.append((b"x-dynamo-request-id", client_id.encode()))
            proxy = StreamProxy(
                upstream,
                lease,
                resp_headers,
                self._stream_failed,
                rewriter,
                ctx.usage_tap(),
                state.config.stream_idle_timeout,
                migrator,
                ctx.dialect,
            )
            if hints is not None and hints.annotations and ctx.kind != "messages":
                proxy.preamble = self._annotations(ctx, hints)
            return proxy
        if as_stream:
            return await self._reassemble(ctx, lease, upstream, rewriter, watch)
        data = upstream.content
        if ctx.probe is not None:
            ctx.probe.usage(*ctx.dialect.parse_usage(data))
        lease.first_token(streamed=False)
        n = ctx.dialect.body_tokens(data)
        if n:
            lease.tokens(n)
        if rewriter is not None:
            data = rewriter.unary(data)
        lease.release()
        if rewriter is not None:
            rewriter.finished(lease)
        return _PassThrough(data, upstream.header(b"content-type", b"application/json"), decision.dp_rank, client_id)

    def _annotations(self, ctx: RequestContext, hints: RequestHints) -> bytes:
        """nvext.annotations as SSE events ahead of the stream (formatted prompt, prompt token ids)."""
        from frontend.request.hints import annotation_events

        text: str | None = None
        if "formatted_prompt" in (hints.annotations or ()):
            from kvroute_common.tokenizer import chat_template_kwargs, render_chat_prompt

            if ctx.chat:
                text = render_chat_prompt(ctx.entry.tokenizer, ctx.body["messages"], **chat_template_kwargs(ctx.body))
            else:
                prompt = ctx.body.get("prompt")
                text = prompt if isinstance(prompt, str) else str(ctx.entry.tokenizer.decode(ctx.tokens))
        return annotation_events(hints, text, list(ctx.tokens))

    async def _reassemble(
        self, ctx: RequestContext, lease: Lease, upstream: Any, rewriter: ResponseRewriter | None, watch: Any
    ) -> Any:
        """A non-streaming request's engine stream: first token = prefill complete, then one OpenAI body."""
        state = self.state
        worker = lease.decision.worker
        asm = UnaryAssembler(ctx.chat)
        limit = worker.upstream.timeout  # --request-timeout bounds the whole unary answer, as before
        try:
            async with asyncio.timeout(limit):
                async for chunk in upstream.aiter_raw(state.config.stream_idle_timeout):
                    n = asm.feed(chunk)
                    if n:
                        if not lease.prefilled:
                            lease.first_token()
                            if rewriter is not None:
                                rewriter.first_token()
                        lease.tokens(n)
        except TimeoutError:
            _lease_abort(lease, 504)
            return openai_error_response(504, f"worker {worker.id} did not answer within {limit} s")
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                lease.status, lease.error_type = "error", "cancelled"
                lease.release()
                raise
            _current_task().uncancel()
            lease.client_gone()
            lease.release()
            return Response(b"", status_code=499)
        except UpstreamError as exc:
            silent = isinstance(exc, UpstreamTimeout)  # --stream-idle-timeout: silent, not dead (stays a candidate)
            if not silent:
                state.pool.mark_failed(worker, f"{type(exc).__name__}: {exc}")
            if self._may_migrate(ctx):  # nothing reached the client yet: the whole request goes elsewhere
                self._count_migration(ctx, worker.id, NEW_REQUEST)
                return _MIGRATE
            status = 504 if silent else 502
            _lease_abort(lease, status)
            return openai_error_response(
                status, f"worker {worker.id} {'went silent' if silent else 'failed'} mid-response: {exc}"
            )
        finally:
            if watch is not None:
                watch.stop()
            await upstream.aclose()
        if asm.error is not None:
            code = asm.error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            message = asm.error.get("message")
            msg = message if isinstance(message, str) else f"worker {worker.id} failed"
            _lease_abort(lease, status)
            return openai_error_response(
                status if status < 500 else 500, msg if status < 500 else "Internal server error"
            )
        data = asm.body()
        if ctx.probe is not None:
            ctx.probe.usage_from_body(data)
        if rewriter is not None:
            data = rewriter.unary(data)
        lease.release()
        if rewriter is not None:
            rewriter.finished(lease)
        return _PassThrough(
            data, b"application/json", lease.decision.dp_rank, ctx.hints.request_id if ctx.hints is not None else None
        )

    async def remote_overlaps(
        self, entry: ModelEntry, prompt: Prompt
    ) -> tuple[dict[tuple[int, int], int] | None, str | None]:
        """``--use-remote-indexer``: the overlaps for this decision and where they came from
        (``(None, None)``: the embedded index is used; an indexer that did not answer: no overlaps)."""
        remote = self.state.remote_index
        if remote is None or prompt.local_hashes is None or not self.state.config.kv_aware:
            return None, None
        from frontend.routing.remote_index import REMOTE, REMOTE_UNAVAILABLE

        hashes = prompt.local_array if prompt.local_array is not None else prompt.local_hashes
        found = await remote.overlaps(entry.base, hashes, entry.block_size)
        return (found, REMOTE) if found is not None else ({}, REMOTE_UNAVAILABLE)

    def _may_migrate(self, ctx: RequestContext) -> bool:
        """--migration-limit: budget left, not pinned, one choice."""
        return (
            ctx.migrations < self.state.config.migration_limit
            and not ctx.pinned
            and ctx.kind in ("chat", "completions")
            and migratable(ctx.body)
        )

    def _count_migration(self, ctx: RequestContext, failed_worker: int, kind: str) -> None:
        ctx.migrations += 1
        if ctx.failed_workers is None:
            ctx.failed_workers = set()
        ctx.failed_workers.add(failed_worker)
        self.state.metrics.migrations.labels(ctx.entry.name, kind).inc()
        log.warning(
            "request migrating from worker %s (%s, %d of %d)",
            failed_worker,
            kind,
            ctx.migrations,
            self.state.config.migration_limit,
        )

    async def _continue_stream(self, ctx: RequestContext, tracker: SseTracker, lease: Lease) -> tuple[Any, Lease]:
        """A stream broke mid-way: continue it on another worker (a new routing decision and
        booking; the failed worker's booking is freed at once). Returns the new upstream response,
        or None when it cannot continue (budget spent, no worker, the new worker refused), and the
        lease that now carries the request (the caller ends the request with it)."""
        state = self.state
        entry = ctx.entry
        lease.free_booking()
        from kvroute_common.tokenizer import encode_text

        body = continuation_body(
            ctx.body,
            ctx.chat,
            tracker.generated_text(),
            tracker.generated,
            lambda text: encode_text(entry.tokenizer, text),
        )
        try:
            if body is None:
                raise OpenAIError(400, "the prompt cannot be continued")
            salt = ctx.hints.cache_salt if ctx.hints is not None else None
            prompt = await tokenize_request(state.tokenize, entry, body, ctx.chat, salt, state.image_cache)
        except OpenAIError as exc:
            log.warning("cannot migrate: continued prompt rejected: %s", exc.message)
            return None, lease
        raw = orjson.dumps(body)
        path = "/v1/chat/completions" if ctx.chat else "/v1/completions"
        while self._may_migrate(ctx):
            self._count_migration(ctx, lease.decision.worker.id, ONGOING_REQUEST)
            remote, source = await self.remote_overlaps(entry, prompt)
            try:
                decision = state.router.route(
                    entry,
                    prompt.tokens,
                    None,
                    None,
                    salt,
                    exclude=ctx.failed_workers,
                    hashes=prompt.hashes,
                    overlaps=remote,
                )
                decision.overlap_source = source
            except OpenAIError as exc:
                log.warning("cannot migrate: %s", exc.message)
                return None, lease
            request_id = state.next_request_id()
            try:
                state.router.book(entry, request_id, decision)
            except Exception as exc:
                log.warning("cannot migrate: booking worker %s failed: %s", decision.worker.id, exc)
                return None, lease
            state.metrics.router_started.inc()
            new = Lease(state.lifecycle, entry, request_id, decision, ctx.mm, ctx.t_start)
            new.inherit(lease)
            new.status, new.error_type = lease.status, lease.error_type  # until it delivers
            lease.released = True  # its booking is freed; the request now ends with ``new``
            lease = new
            if state.config.router_track_output_blocks:
                lease.track_output(ctx.hints.osl if ctx.hints is not None else None)
            _record_routed(state, ctx.mm, decision)
            worker = decision.worker
            headers = upstream_headers(decision.dp_rank, request_id)
            if ctx.trace is not None:  # the continuation's decision and engine call join the request's trace
                headers = ctx.trace.migrated(lease, worker, headers, state.router.label)
            try:
                upstream = await worker.upstream.request(
                    "POST",
                    path,
                    _priority_for_worker(raw, ctx.hints, worker),
                    headers,
                    True,
                )
            except asyncio.CancelledError:
                lease.status, lease.error_type = "error", "cancelled"
                lease.release()
                raise
            except (UpstreamError, OSError) as exc:
                if not isinstance(exc, UpstreamTimeout):
                    state.pool.mark_failed(worker, f"{type(exc).__name__}: {exc}")
                lease.free_booking()
                continue
            if upstream.status != 200:
                try:
                    data = await upstream.aread()
                except UpstreamError:
                    data = b""
                await upstream.aclose()
                lease.free_booking()
                log.warning(
                    "cannot migrate: worker %s answered %s: %s", worker.id, upstream.status, _error_message(data)
                )
                return None, lease
            lease.status, lease.error_type = "success", ""
            tracker.switch()
            return upstream, lease
        return None, lease

    def _stream_failed(self, lease: Lease, exc: BaseException) -> None:
        self.state.pool.mark_failed(lease.decision.worker, f"{type(exc).__name__}: {exc}")

    async def send_pinned(self, body: dict, worker_id: int, dp_rank: int | None) -> None:
        """Speculative prefill warm-up: a non-streaming request pinned to (worker, rank), full lifecycle."""
        state = self.state
        model = body.get("model")
        entry = state.models.get(model) if isinstance(model, str) else None
        if entry is None:
            return
        ctx = RequestContext()
        ctx.t_start = _perf()
        ctx.chat = "messages" in body
        ctx.endpoint = "chat_completions" if ctx.chat else "completions"
        ctx.entry, ctx.stream, ctx.body = entry, False, body
        ctx.prompt = await tokenize_request(state.tokenize, entry, body, ctx.chat, image_cache=state.image_cache)
        ctx.tokens = ctx.prompt.tokens
        ctx.out_body = orjson.dumps(body)
        ctx.count_start(state.metrics.model_children(entry.name, ctx.endpoint, "unary"))
        try:
            await self._dispatch(ctx, worker_id, dp_rank, self.send)
        except OpenAIError as exc:
            ctx.finish_unrouted(_error_type(exc.status))
            raise


class _RoutedNotes:
    """The part of an attempt's booking its engine does not wait for, run once its request is written
    (``RequestContext.sent``): what the router learns from the decision (``RequestRouter.note_routed``),
    the routing metrics, the parity probe, output-block tracking and the nvext timing. The tracker's
    reservation is made before the request is sent."""

    __slots__ = ("path", "router", "ctx", "lease")

    def __init__(self, path: RequestPath, router: Any, ctx: RequestContext, lease: Lease) -> None:
        self.path = path
        self.router = router
        self.ctx = ctx
        self.lease = lease

    def __call__(self) -> None:
        state = self.path.state
        ctx, lease = self.ctx, self.lease
        entry, decision = lease.entry, lease.decision
        self.router.note_routed(entry, lease.request_id, decision)
        state.metrics.router_started.inc()
        ctx.probe = state.parity.begin(entry, decision, lease) if ctx.evidence else None
        if state.config.router_track_output_blocks:
            lease.track_output(ctx.hints.osl if ctx.hints is not None else None)
        _record_routed(state, ctx.mm, decision)
        if ctx.timing is not None and ctx.prefill is None:
            from frontend.request.hints import kv_hit_rate

            ctx.timing.dispatched = time.monotonic()
            ctx.timing.kv_hit_rate = kv_hit_rate(decision.overlap_blocks, decision.isl, entry.block_size)


class _SessionHook:
    """Ends the session's lease with the request (restarting its idle TTL); failures unbind it."""

    __slots__ = ("session",)

    def __init__(self, session: Any) -> None:
        self.session = session

    def on_tokens(self, lease: Lease, n: int) -> None:
        pass

    def on_release(self, lease: Lease) -> None:
        if lease.status == "error" and lease.error_type not in ("cancelled", ""):
            self.session.invalidate()
        self.session.release()


_RETRY = object()


_MIGRATE = object()


class _Migrator:
    """What a migratable stream needs to continue elsewhere (see frontend/dispatch/migration.py)."""

    __slots__ = ("routes", "ctx", "tracker")

    def __init__(self, routes: RequestPath, ctx: RequestContext) -> None:
        self.routes = routes
        self.ctx = ctx
        self.tracker = SseTracker(ctx.chat, len(ctx.tokens))

    async def resume(self, lease: Lease, exc: BaseException) -> tuple[Any, Lease] | None:
        return await self.routes._continue_stream(self.ctx, self.tracker, lease)


_KINDS = {
    "chat": ("chat_completions", "/v1/chat/completions"),
    "completions": ("completions", "/v1/completions"),
    "responses": ("responses", "/v1/responses"),
    "embeddings": ("embeddings", "/v1/embeddings"),
    "messages": ("messages", "/v1/messages"),
}


class _watch_disconnect:
    """Cancels the current task when the client disconnects (one extra task, only for unary requests)."""

    __slots__ = ("task", "gone", "_owner")

    def __init__(self, receive: Any) -> None:
        self.gone = False
        self._owner = _current_task()
        self.task = asyncio.get_running_loop().create_task(self._run(receive))

    async def _run(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._owner.cancel()
                return

    def stop(self) -> None:
        if not self.task.done():
            self.task.cancel()


class _PassThrough:
    """A worker's complete JSON answer, sent as is (cheaper than building a starlette Response)."""

    __slots__ = ("body", "content_type", "rank", "request_id")

    def __init__(self, body: bytes, content_type: bytes, rank: int, request_id: str | None = None) -> None:
        self.body, self.content_type, self.rank, self.request_id = body, content_type, rank, request_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [
            (b"content-type", self.content_type),
            (b"content-length", str(len(self.body)).encode()),
            (b"x-data-parallel-rank", str(self.rank).encode()),
        ]
        if self.request_id:
            headers.append((b"x-dynamo-request-id", self.request_id.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def _record_routed(state: FrontendState, mm: Any, decision: Any) -> None:
    isl = decision.isl
    mm.isl.observe(isl)
    mm.cached.observe(decision.cached_tokens)
    m = state.metrics
    m.router_isl.observe(isl)
    if isl:
        m.router_kv_hit_rate.observe(decision.cached_tokens / isl)
    state.worker_gauges(decision.worker.id, decision.dp_rank)[1].set(isl)


def _current_task() -> asyncio.Task[Any]:
    """The running task (a coroutine of a request handler always has one)."""
    task = asyncio.current_task()
    assert task is not None
    return task


def _lease_abort(lease: Lease, status: int) -> None:
    lease.status, lease.error_type = "error", _error_type(status)
    lease.release()


def _upstream_error(lease: Lease, status: int, data: bytes) -> Response:
    """Worker said no: 4xx passes through with its message, 5xx becomes a generic 500."""
    _lease_abort(lease, status)
    if 400 <= status < 500:
        msg = _error_message(data) or f"worker returned {status}"
        return openai_error_response(status, msg)
    return openai_error_response(500, "Internal server error")


def _error_message(data: bytes) -> str | None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace")[:500] or None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return obj["message"]
    return None


def _error_type(status: int) -> str:
    from frontend.request.errors import error_type_label

    return error_type_label(status)
