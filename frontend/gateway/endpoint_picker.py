"""kvroute as the endpoint picker of a Kubernetes inference gateway (``--epp-port``).

A Gateway API Inference Extension gateway (Envoy and the gateways built on it) sends each request's
headers and body over Envoy's external processing protocol (``envoy.service.ext_proc.v3``, gRPC) to
the endpoint picker of its ``InferencePool``. The picker makes the proxy's own decision
(:meth:`RequestPath.generate`: hints, tokenize, admission, route, book) and answers with the chosen
engine's ``ip:port`` in the ``x-gateway-destination-endpoint`` request header and in the ``envoy.lb``
dynamic metadata; with ``--epp-fallbacks N`` the next-best candidates follow it, comma-separated, for a
gateway that retries down the list. When nothing fits it answers an immediate response in the API's
shape (429 / 503 / 529 as the proxy would).

The booking made at the decision follows the response: the endpoint the gateway reports as the one that
served (``envoy.lb`` / ``x-gateway-destination-endpoint-served``, with the response headers) moves it when
a retry went to a fallback; the response's first body chunk with a token marks prefill complete (the
proxy's :class:`ChunkPipeline`, which also counts tokens and reads the engine's usage for the parity
alarm and the hit-rate decomposition); its end of stream frees it; a stream that closes before that (the
client went away, the engine failed, the gateway gave up) frees it as a cancellation.

Processing modes (Envoy sends them in ``protocol_config``; a mode the picker cannot serve is refused at
the stream's start with a 500 that names it). Request body: ``FULL_DUPLEX_STREAMED`` (what GIE gateways
configure: the picker buffers the body, then answers the headers with the endpoint and streams the body
back), ``BUFFERED``, or ``BUFFERED_PARTIAL`` (the endpoint rides on the body response; a body larger than
the gateway's buffer arrives cut and is refused with a 413); ``STREAMED`` and ``NONE`` are refused for
requests with a body (the endpoint must be chosen from the whole body, before any of it goes upstream).
Response body: ``FULL_DUPLEX_STREAMED`` (each chunk relayed back, changed only as the proxy would change
it), ``STREAMED`` (chunks observed, replaced only when changed), ``BUFFERED`` (the answer arrives whole at
its end), or ``NONE`` (no per-chunk message at all: prefill is taken as complete at the response headers,
and the response as ended when the gateway closes the stream, which it does when the response ends or the
client leaves: the two cannot be told apart in this mode; the engine is not asked for stream usage the
client did not ask for, since nothing here could take it out of the client's stream). ``BUFFERED_PARTIAL``
is refused (a response larger than the buffer would be seen cut, with no end). Every stream's end is counted by reason
(``kvroute_epp_streams_total{end}``) and logged at debug level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response

from frontend.request.errors import OpenAIError
from frontend.routing.prompt import takes_prompt_ids

if TYPE_CHECKING:
    import grpc
    from starlette.types import Receive

    from frontend.dispatch.context import RequestContext
    from frontend.dispatch.lifecycle import Lease
    from frontend.dispatch.request_path import RequestPath
    from frontend.pool.workers import Worker
    from frontend.state import FrontendState

log = logging.getLogger("frontend.gateway.endpoint_picker")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
# the Inference Extension conformance suite's test hooks (--epp-conformance-hooks)
STEERING = "test-epp-endpoint-selection"
CONFORMANCE_SERVED = "x-conformance-test-served-endpoint"
CONFORMANCE_SELECTED = "x-conformance-test-selected-endpoint"
# path -> the kind of generation request (frontend.dispatch.request_path._KINDS)
KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
}
MAX_BODY = 45 * 1024 * 1024  # the proxy's body limit
MAX_KEPT_RESPONSE = 4 * 1024 * 1024  # a unary response is kept to read its usage, up to this size
# what a gateway answers when it could not reach the engine (Envoy: 503 on connect failure or reset)
UNREACHABLE = (502, 503, 504)

# ext_proc's ProcessingMode.BodySendMode
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX = 0, 1, 2, 3, 4
MODE_NAMES = {NONE: "NONE", STREAMED: "STREAMED", BUFFERED: "BUFFERED", BUFFERED_PARTIAL: "BUFFERED_PARTIAL",
              FULL_DUPLEX: "FULL_DUPLEX_STREAMED"}  # fmt: skip
REQUEST_MODES = (BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX)  # the picker needs the whole body before the headers go
RESPONSE_MODES = (NONE, STREAMED, BUFFERED, FULL_DUPLEX)

# why an ext_proc stream ended (kvroute_epp_streams_total{end})
END_RESPONSE = "response_end"  # the response's end passed the picker
END_CLOSED = "stream_closed"  # response body NONE: the gateway closed the stream after a 200's headers
END_CLIENT_GONE = "client_gone"  # the stream closed before the response's end
END_ENGINE_ERROR = "engine_error"  # the engine (or the gateway for it) answered an error status
END_REFUSED = "refused"  # answered at once (the proxy's refusal, a bad body, no worker)
END_NO_DECISION = "no_decision"  # not a generation request: sent to any healthy engine, nothing booked
END_UNSUPPORTED = "unsupported_mode"  # a processing mode the picker cannot serve
MESSAGE_KINDS = ("request_headers", "request_body", "request_trailers", "response_headers", "response_body",
                 "response_trailers")  # fmt: skip
END_REASONS = (END_RESPONSE, END_CLOSED, END_CLIENT_GONE, END_ENGINE_ERROR, END_REFUSED, END_NO_DECISION,
               END_UNSUPPORTED)  # fmt: skip


def endpoint_of(url: str) -> str:
    """A worker's ``host:port`` as the gateway's original-destination cluster dials it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port or 80}" if ":" in host else f"{host}:{parts.port or 80}"  # IPv6 in brackets


def _matches(endpoint: str, wanted: list[str]) -> bool:
    """``endpoint`` (``ip:port``) is one of ``wanted`` (``ip:port``, or a bare ``ip`` for any port)."""
    host = endpoint.rpartition(":")[0]
    return any(w == endpoint or w.strip("[]") == host.strip("[]") for w in wanted)


class PickerSource:
    """A request as the gateway sent it: headers, the body once complete, the endpoints it may go to."""

    def __init__(
        self,
        headers: Headers,
        body: bytes,
        subset: list[str] | None,
        steering: list[str] | None,
        reads_response: bool,
    ) -> None:
        self.headers = headers
        self.receive: Receive | None = None  # the client is the gateway's: it leaving closes the ext_proc stream
        self.body = body
        self.subset = subset
        self.steering = steering
        self.reads_response = reads_response  # response body NONE: no chunk passes the picker

    async def read(self, limit: int) -> tuple[bytes, dict[str, Any]]:
        import orjson

        if len(self.body) > limit:
            raise OpenAIError(413, f"request body exceeds {limit} bytes")
        try:
            body = orjson.loads(self.body)
        except orjson.JSONDecodeError as exc:
            raise OpenAIError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        return self.body, body

    def excluded(self, state: FrontendState) -> set[int] | None:
        if self.subset is None and self.steering is None:
            return None
        excluded = set()
        for w in state.pool.workers.values():
            endpoint = endpoint_of(w.spec.url)
            if (self.subset is not None and endpoint not in self.subset) or (
                self.steering is not None and not _matches(endpoint, self.steering)
            ):
                excluded.add(w.id)
        if len(excluded) == len(state.pool.workers):
            if self.subset is not None:
                raise OpenAIError(503, "none of the gateway's endpoint subset is a worker of this pool")
            raise OpenAIError(503, f"none of the endpoints in {STEERING} is a worker of this pool")
        return excluded


class Picked:
    """What ``generate`` returns for the picker: the request's context and its booking."""

    __slots__ = ("ctx", "lease")

    def __init__(self, ctx: RequestContext, lease: Lease) -> None:
        self.ctx = ctx
        self.lease = lease


async def _hand_over(ctx: RequestContext, lease: Lease) -> Picked:
    """The picker's ``send``: the gateway dispatches, so the decision is the result."""
    ctx.sent()
    return Picked(ctx, lease)


def _metadata_value(request: Any, namespace: str, key: str) -> Any:
    """A value of the request's forwarded filter metadata (None: absent)."""
    fields = request.metadata_context.filter_metadata
    if namespace not in fields:
        return None
    return fields[namespace].fields.get(key)


def _endpoint_list(value: Any) -> list[str] | None:
    """A metadata value holding endpoints: a list, or a comma-separated string."""
    if value is None:
        return None
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


class _Stream:
    """One ext_proc stream = one HTTP request through the gateway."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.headers: list[tuple[bytes, bytes]] = []  # as Starlette's Headers holds them
        self.body_parts: list[bytes] = []  # the request body as it arrives (one part, mostly: no copy)
        self.body_size = 0
        self.subset: list[str] | None = None
        self.request_mode = BUFFERED  # without protocol_config (Envoy before 1.33): the headers are answered first
        self.response_mode = NONE  # the proto's default; protocol_config says what the gateway sends
        self.picked: Picked | None = None
        self.endpoint: str | None = None  # the first choice sent to the gateway
        self.chunks: Any = None  # proxy.ChunkPipeline of a streamed response
        self.rewriter: Any = (
            None  # dispatch.response_rewriter.ResponseRewriter, when the request asked for response nvext
        )
        self.kept = bytearray()  # a unary response, for its usage
        self.first_seen = False
        self.status: int | None = None  # the response's status, once its headers passed
        self.body_seen = False
        self.end: str | None = None  # why the stream ended (END_*), once it did
        self.served: str | None = None  # the endpoint the gateway reports as the one that served
        self.last_message = ""  # the kind of the last message the gateway sent (debug log)
        self.headers_answered = False  # BUFFERED: the request headers were let through before the body

    async def handle(self, request: Any) -> AsyncIterator[Any]:
        pb = self.picker.pb
        which = self.last_message = request.WhichOneof("request")
        self.picker.count_message(which)
        if request.HasField("protocol_config"):
            self.request_mode = request.protocol_config.request_body_mode
            self.response_mode = request.protocol_config.response_body_mode
        if which == "request_headers":
            if request.HasField("metadata_context"):
                self.subset = _endpoint_list(_metadata_value(request, SUBSET_NAMESPACE, SUBSET))
            for h in request.request_headers.headers.headers:
                self.headers.append((h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1")))
            if request.request_headers.end_of_stream:  # no body: not a generation request
                yield self._route_to_any()
                return
            refusal = self._unsupported_modes()
            if refusal is not None:
                self.end = END_UNSUPPORTED
                yield self._immediate(500, OpenAIError(500, refusal))
            elif self.request_mode != FULL_DUPLEX:  # buffered: the endpoint rides on the body response
                self.headers_answered = True
                yield self.picker.answers.request_headers
        elif which == "request_body":
            part = request.request_body.body
            if part:
                self.body_parts.append(part)
                self.body_size += len(part)
            if self.body_size > MAX_BODY:
                self.end = END_REFUSED
                yield self._immediate(413, OpenAIError(413, f"request body exceeds {MAX_BODY} bytes"))
                return
            if request.request_body.end_of_stream:
                async for r in self._pick():
                    yield r
            elif self.request_mode == BUFFERED_PARTIAL:  # the rest goes upstream without the picker
                self.end = END_REFUSED
                message = "request body larger than the gateway's buffer (BUFFERED_PARTIAL): the picker needs it whole"
                yield self._immediate(413, OpenAIError(413, message))
        elif which == "request_trailers":
            if self.picked is None and self.end is None:
                async for r in self._pick():
                    yield r
            yield self.picker.answers.request_trailers
        # the stream's state is settled before each answer is yielded: once Envoy has the answer to the
        # response's last message it may close the stream, and this generator is not resumed after that
        elif which == "response_headers":
            self._response_started(request)
            answer = self._response_headers_answer()
            if request.response_headers.end_of_stream:
                self.finish(END_RESPONSE)
            yield answer
        elif which == "response_body":
            self.body_seen = True
            data = request.response_body.body
            end = request.response_body.end_of_stream or self.response_mode == BUFFERED
            out = self._response_chunk(data, end)
            if self.response_mode == FULL_DUPLEX:  # every chunk comes back through the picker
                streamed = pb.StreamedBodyResponse(body=out, end_of_stream=request.response_body.end_of_stream)
                answer = pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
                    )
                )
            elif out == data:  # STREAMED / BUFFERED, unchanged: the gateway sends its own copy on
                answer = self.picker.answers.response_body
            else:  # the chunk replaced (nvext added, the usage the client did not ask for taken out)
                mutation = pb.BodyMutation(body=out) if out else pb.BodyMutation(clear_body=True)
                common = pb.CommonResponse(body_mutation=mutation)
                if self.response_mode == BUFFERED:  # the headers wait for the body: its new length goes with it
                    length = pb.HeaderValue(key="content-length", raw_value=str(len(out)).encode())
                    common.header_mutation.CopyFrom(
                        pb.HeaderMutation(set_headers=[pb.HeaderValueOption(header=length)])
                    )
                answer = pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
            if end:
                self.finish(END_RESPONSE)
            yield answer
        elif which == "response_trailers":
            self.finish(END_RESPONSE)
            yield self.picker.answers.response_trailers

    def _unsupported_modes(self) -> str | None:
        """Why this stream's processing modes cannot be served (None: they can)."""
        problems = []
        if self.request_mode not in REQUEST_MODES:
            problems.append(
                f"request body mode {MODE_NAMES.get(self.request_mode, self.request_mode)} (the endpoint is chosen "
                "from the whole body before any of it goes upstream: use FULL_DUPLEX_STREAMED or BUFFERED)"
            )
        if self.response_mode not in RESPONSE_MODES:
            problems.append(
                f"response body mode {MODE_NAMES.get(self.response_mode, self.response_mode)} (a response larger "
                "than the buffer would be seen cut: use FULL_DUPLEX_STREAMED, STREAMED or NONE)"
            )
        if not problems:
            return None
        message = "kvroute endpoint picker: unsupported ext_proc processing mode: " + "; ".join(problems)
        self.picker.warn_once(message)
        return message

    def _any_endpoint(self) -> str | None:
        """For a request without a routing decision (``GET /v1/models``, health): a healthy worker of the subset."""
        allowed = set(self.subset) if self.subset is not None else None
        for w in sorted(self.picker.state.pool.workers.values(), key=lambda w: w.id):
            if w.healthy and (allowed is None or endpoint_of(w.spec.url) in allowed):
                return endpoint_of(w.spec.url)
        return None

    def _route_to_any(self) -> Any:
        self.end = END_NO_DECISION
        endpoint = self._any_endpoint()
        if endpoint is None:
            self.end = END_REFUSED
            return self._immediate(503, OpenAIError(503, "no healthy worker"))
        return self._route_to([endpoint], None)

    def _steering(self, headers: Headers) -> list[str] | None:
        """The conformance suite's steering header, when the hooks are on."""
        if not self.picker.conformance_hooks:
            return None
        value = headers.get(STEERING)
        return [e.strip() for e in value.split(",") if e.strip()] if value else None

    async def _pick(self) -> AsyncIterator[Any]:
        """The request is complete: decide, answer the endpoint, and (full duplex) stream the body back."""
        headers = Headers(raw=self.headers)
        kind = KINDS.get(headers.get(":path", "").split("?", 1)[0])
        if not self.picker.state.serving:  # starting (no engine known yet) or draining: not a 404
            self.end = END_REFUSED
            yield self._immediate(503, OpenAIError(503, "kvroute is not ready: no healthy worker yet"))
            return
        sent = self._body()  # as the gateway has it
        if kind is None:  # not a generation route: no decision to make, any worker answers it
            self.end = END_NO_DECISION
            endpoint, body = self._any_endpoint(), sent
            if endpoint is None:
                self.end = END_REFUSED
                yield self._immediate(503, OpenAIError(503, "no healthy worker"))
                return
            endpoints = [endpoint]
        else:
            source = PickerSource(headers, sent, self.subset, self._steering(headers), self.response_mode != NONE)
            result = await self.picker.path.generate(source, kind, _hand_over)
            if isinstance(result, Response):  # refused: the error the proxy would have answered
                self.end = END_REFUSED
                yield self._immediate_response(result)
                return
            assert isinstance(result, Picked)
            self.picked = result
            endpoints = self.picker.endpoints(result)
            worker = result.lease.decision.worker
            body = result.ctx.body_for(takes_prompt_ids(self.picker.state.send_token_ids, worker))
        self.endpoint = endpoints[0]
        yield self._route_to(endpoints, None if body is sent else body)
        if self.request_mode == FULL_DUPLEX:  # the body goes on as the picker streams it back
            pb = self.picker.pb
            mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True))
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
            )

    def _body(self) -> bytes:
        parts = self.body_parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _route_to(self, endpoints: list[str], body: bytes | None) -> Any:
        """The decision as the gateway takes it: the header and the ``envoy.lb`` metadata (the same value:
        the choice, then the fallbacks), on the answer to the request's headers, or (buffered body, headers
        already answered) on the body's with, when the proxy changed it (nvext applied, usage requested),
        the body the engine gets and its length (None: the gateway's own copy goes on)."""
        pb = self.picker.pb
        value = ",".join(endpoints)
        set_headers = [pb.HeaderValueOption(header=pb.HeaderValue(key=DESTINATION, raw_value=value.encode()))]
        common = pb.CommonResponse(clear_route_cache=True)
        meta = pb.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: value}})
        if not self.headers_answered:
            common.header_mutation.CopyFrom(pb.HeaderMutation(set_headers=set_headers))
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
        if body is not None:
            length = str(len(body)).encode()
            set_headers.append(pb.HeaderValueOption(header=pb.HeaderValue(key="content-length", raw_value=length)))
            common.body_mutation.body = body
        common.header_mutation.CopyFrom(pb.HeaderMutation(set_headers=set_headers))
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)

    def _immediate(self, status: int, exc: OpenAIError) -> Any:
        from frontend.request.errors import openai_error_response

        return self._immediate_response(openai_error_response(status, exc.message, exc.param))

    def _immediate_response(self, response: Response) -> Any:
        pb = self.picker.pb
        headers = [
            pb.HeaderValueOption(header=pb.HeaderValue(key=k.decode(), raw_value=v))
            for k, v in response.raw_headers
            if k.lower() not in (b"content-length",)
        ]
        return pb.ProcessingResponse(
            immediate_response=pb.ImmediateResponse(
                status=pb.HttpStatus(code=response.status_code),
                headers=pb.HeaderMutation(set_headers=headers),
                body=bytes(response.body),
                details="kvroute endpoint picker",
            )
        )

    def _response_headers_answer(self) -> Any:
        """The answer to the response headers: empty, or with the conformance hooks, the endpoints the
        picker chose and the gateway says served, for the suite to compare."""
        pb = self.picker.pb
        if not self.picker.conformance_hooks:
            return self.picker.answers.response_headers
        served = self.served or "fail: missing destination endpoint served metadata"
        values = [(CONFORMANCE_SERVED, served)]
        if self.endpoint is not None:
            values.append((CONFORMANCE_SELECTED, self.endpoint))
        set_headers = [pb.HeaderValueOption(header=pb.HeaderValue(key=k, raw_value=v.encode())) for k, v in values]
        mutation = pb.HeaderMutation(set_headers=set_headers)
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )

    def _response_started(self, request: Any) -> None:
        served = _metadata_value(request, LB_NAMESPACE, SERVED) if request.HasField("metadata_context") else None
        if served is not None and served.string_value:
            self.served = served.string_value.split(",")[0].strip()
        picked = self.picked
        status = 200
        for h in request.response_headers.headers.headers:
            if h.key == ":status":
                status = int((h.raw_value or h.value.encode()).decode() or 200)
        self.status = status
        if picked is None:
            return
        if self.served is not None and self.served != self.endpoint:
            self.picker.state.pool.suspect(picked.lease.decision.worker)  # the gateway could not use it
            self.picker.move_booking(picked, self.served)
        lease = picked.lease
        ctx = picked.ctx
        if status != 200:  # the engine refused: the request ends with its status, as through the proxy
            from frontend.request.errors import error_type_label

            lease.status, lease.error_type = "error", error_type_label(status)
            if status in UNREACHABLE:  # as the proxy does with an engine it cannot reach: out until healthy
                self.picker.state.pool.mark_failed(lease.decision.worker, f"the gateway got {status} from it")
            return
        if ctx.session is not None:
            ctx.session.bind(lease.decision.worker.id, lease.decision.dp_rank, rebind=ctx.soft_target is not None)
        if self.response_mode in (NONE, BUFFERED):  # no chunk before the end: the headers are the first output
            # (an engine sends them before its first token: not a TTFT the latency model may learn from)
            lease.first_token(streamed=False)
            if self.response_mode == NONE:
                return
        from frontend.dispatch.response_rewriter import ResponseRewriter

        # response nvext / speculative prefill (a unary body is held and rewritten whole at its end)
        if ctx.rewrite:
            self.rewriter = ResponseRewriter(self.picker.state, ctx, lease)
        if ctx.stream:
            from frontend.dispatch.proxy import ChunkPipeline

            self.chunks = ChunkPipeline(lease, ctx.dialect, self.rewriter, ctx.usage_tap())

    def _response_chunk(self, data: bytes, end: bool) -> bytes:
        picked = self.picked
        if picked is None or picked.lease.status == "error":
            return data
        if self.chunks is not None:
            out = self.chunks.feed(data)
            if end:
                out += self.chunks.flush()
            return out
        lease, ctx = picked.lease, picked.ctx
        if not self.first_seen and data:
            self.first_seen = True
            lease.first_token(streamed=False)
        if self.rewriter is not None or len(self.kept) + len(data) <= MAX_KEPT_RESPONSE:
            self.kept += data  # for its usage, and whole when it is to be rewritten
        if not end:
            return b"" if self.rewriter is not None else data
        whole = bytes(self.kept)
        if ctx.probe is not None and whole:
            ctx.probe.usage(*ctx.dialect.parse_usage(whole))
        n = ctx.dialect.body_tokens(whole) if whole else 0
        if n:
            lease.tokens(n)
        return self.rewriter.unary(whole) if self.rewriter is not None else data

    def closed(self) -> None:
        """The gateway closed the stream (or the picker stops): what has not ended ends now, and the stream
        is counted by how it ended (a stream cut mid-response once its engine has answered a probe)."""
        if self.end is None:
            if self.picked is None:  # closed before the decision (the client left while sending)
                self.finish(END_CLIENT_GONE)
            elif self.status == 200 and self.response_mode == NONE:
                self.finish(END_CLOSED)  # the gateway closes the stream at the response's end
            elif self.status is not None and self.status != 200:
                self.finish(END_ENGINE_ERROR)
            elif not self.picked.lease.released:
                self._cut(self.picked.lease)
                return
        self.picker.ended(self)

    def _cut(self, lease: Lease) -> None:
        """Cut before the response's end: the client left, or the engine died mid-response (the gateway
        closes the stream the same way for both). The booking is freed now; the engine is probed at once
        (one probe a gap for a burst of cuts) and the request ends as the proxy would end it: cancelled
        when the engine answers, an engine failure when it does not."""
        lease.free_booking()
        probe = self.picker.state.pool.suspect(lease.decision.worker)
        self.picker.spawn(self._end_cut(lease, probe))

    async def _end_cut(self, lease: Lease, probe: asyncio.Task[bool] | None) -> None:
        answered = False  # no probe: the worker is already unhealthy, or gone from the pool
        worker = lease.decision.worker
        try:
            if probe is not None:
                # a probe that failed once without a refusal (a stalled or dying engine) leaves the worker
                # healthy (``failures_to_unhealthy``), but the engine did not answer it
                answered = await asyncio.shield(probe) and worker.failures == 0
        except asyncio.CancelledError:  # the picker stops: nothing says the engine is gone
            answered = True
            raise
        except Exception:  # the probe itself failed (a bug): nor does this
            log.exception("probing worker %s after a cut stream", lease.decision.worker.id)
            answered = True
        finally:
            if answered:
                self.finish(END_CLIENT_GONE)
            else:
                lease.fail(500, "internal")
                self.finish(END_ENGINE_ERROR)
            self.picker.ended(self)

    def finish(self, reason: str) -> None:
        """The stream ended for ``reason``: the booking freed and the request's end recorded, once (a
        cancellation when the client left before the response's end)."""
        if self.end is None or self.end == reason:
            self.end = reason
        picked = self.picked
        if picked is None or picked.lease.released:
            return
        lease = picked.lease
        if lease.status == "error" and reason in (END_RESPONSE, END_CLOSED):
            self.end = reason = END_ENGINE_ERROR
        if reason == END_CLIENT_GONE and lease.status != "error":
            lease.client_gone()
        lease.release()
        ctx = picked.ctx
        if ctx.session is not None and lease.status == "error":
            ctx.session.invalidate()
        if ctx.session is not None:
            ctx.session.release()
        if self.rewriter is not None:
            self.rewriter.finished(lease)


class EndpointPicker:
    """The ext_proc service on ``--epp-port`` (gRPC, plaintext HTTP/2), on the frontend's event loop.

    ``fallbacks``: how many next-best endpoints follow the choice in the destination list (a gateway that
    dials only the first, Envoy's original-destination cluster, refuses a list: 0 for those).
    ``conformance_hooks``: honour the conformance suite's steering header and report the served endpoint
    in a response header (any client could steer its own requests within the pool: tests only)."""

    def __init__(
        self, state: FrontendState, path: RequestPath, fallbacks: int = 0, conformance_hooks: bool = False
    ) -> None:
        from frontend.gateway import epp_protocol

        self.state = state
        self.path = path
        self.pb = epp_protocol
        self.answers = epp_protocol.Answers()
        self.fallbacks = fallbacks
        self.conformance_hooks = conformance_hooks
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health: Any = None  # epp_protocol.Health
        self._watch: asyncio.Future[None] | None = None
        self._warned: set[str] = set()
        self.streams = 0  # ext_proc streams open (one per HTTP request the gateway carries)
        state.busy_probes.append(lambda: self.streams > 0)
        m = state.metrics
        self._ends = {r: m.epp_streams.labels(r) for r in END_REASONS}
        self._messages = {k: m.epp_messages.labels(k) for k in MESSAGE_KINDS}
        self._moved = m.epp_moved
        self._tasks: set[asyncio.Task[None]] = set()  # cut streams waiting for their engine's probe

    async def start(self, host: str, port: int) -> int:
        import grpc

        from frontend.gateway import epp_protocol

        server = grpc.aio.server()
        epp_protocol.add_servicer(server, self.process)
        self.health = epp_protocol.Health(server)
        bound = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        await self.health.start()
        self.server, self.port = server, bound
        self._watch = asyncio.ensure_future(self._follow_readiness())
        log.info("endpoint picker (ext_proc) listening on %s:%s", host, bound)
        return bound

    async def _follow_readiness(self) -> None:
        """Readiness follows the frontend's (``/health``): checked every half second, as a prober would."""
        while True:
            await self.health.set_ready(self.state.serving)
            await asyncio.sleep(0.5)

    async def stop(self, grace: float = 1.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self._tasks:  # cut streams still waiting for a probe: ended now, as when their engine answered
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def count_message(self, kind: str) -> None:
        counter = self._messages.get(kind)
        if counter is not None:
            counter.inc()

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.error("%s", message)

    def endpoints(self, picked: Picked) -> list[str]:
        """The destination list: the choice, then up to ``fallbacks`` next-best candidates that fit (by
        cost in the cost-based modes, by worker id otherwise; none for a pinned request)."""
        decision, ctx = picked.lease.decision, picked.ctx
        chosen = endpoint_of(decision.worker.spec.url)
        out = [chosen]
        if self.fallbacks <= 0 or ctx.pinned:
            return out
        workers = ctx.entry.workers
        if decision.costs is not None:
            ids = [c.worker_id for c in sorted(decision.costs, key=lambda c: c.cost)]
        else:
            from frontend.routing.eligibility import candidates

            ids = sorted({w.id for w, _ in candidates(ctx.entry, None, None, decision.isl)[0]})
        excluded = ctx.failed_workers or set()
        for wid in ids:
            w = workers.get(wid)
            if w is None or wid in excluded or not w.healthy:
                continue
            endpoint = endpoint_of(w.spec.url)
            if endpoint not in out:
                out.append(endpoint)
                if len(out) > self.fallbacks:
                    break
        return out

    def move_booking(self, picked: Picked, served: str) -> None:
        """The gateway served the request elsewhere (a retry down the fallback list): the booking moves
        to the engine that serves it, with what that engine holds of the prompt."""
        old, ctx = picked.lease, picked.ctx
        worker: Worker | None = next((w for w in ctx.entry.workers.values() if endpoint_of(w.spec.url) == served), None)
        if worker is None or old.released:
            log.warning("the gateway reports %s served request %s: not a worker of its model", served, old.request_id)
            return
        from frontend.dispatch.lifecycle import Lease

        state, entry, d = self.state, ctx.entry, old.decision
        rank = d.dp_rank if d.dp_rank in worker.spec.ranks else worker.spec.ranks[0]
        overlap = 0
        if entry.index is not None and d.local_hashes and ctx.kind != "embeddings":
            overlap = entry.index.find_matches(d.local_hashes).get((worker.id, rank), 0)
        decision = dataclasses.replace(
            d,
            worker=worker,
            dp_rank=rank,
            overlap_blocks=overlap,
            new_isl_tokens=max(0, d.isl - overlap * entry.block_size),
            cost=None,
        )
        old.release(final=False)
        request_id = state.next_request_id()
        state.router.book(entry, request_id, decision)
        lease = Lease(state.lifecycle, entry, request_id, decision, ctx.mm, ctx.t_start)
        lease.inherit(old)
        lease.hooks = [h for h in lease.hooks if h is not ctx.probe]  # its evidence was about the first choice
        ctx.probe = state.parity.begin(entry, decision, lease) if ctx.evidence else None
        if state.config.router_track_output_blocks:
            lease.track_output(ctx.hints.osl if ctx.hints is not None else None)
        picked.lease = lease
        self._moved.inc()
        log.info("request %s served by %s, not its first choice: booked on worker %s", request_id, served, worker.id)

    async def process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """``ExternalProcessor.Process``: one bidirectional stream per HTTP request."""
        stream = _Stream(self)
        self.streams += 1
        try:
            async for request in requests:
                async for response in stream.handle(request):
                    yield response
                if stream.end in (END_REFUSED, END_UNSUPPORTED) or (
                    stream.picked is not None and stream.picked.lease.released
                ):
                    return  # answered for good (the response ended, or an immediate answer): nothing more to hear
        finally:
            self.streams -= 1
            stream.closed()  # the gateway closed the stream before the response ended: free at once

    def ended(self, stream: _Stream) -> None:
        """Count a stream by how it ended (``kvroute_epp_streams_total{end}``)."""
        reason = stream.end or END_CLIENT_GONE
        self._ends[reason].inc()
        if log.isEnabledFor(logging.DEBUG):
            picked = stream.picked
            log.debug(
                "ext_proc stream ended: %s (request %s, endpoint %s, served %s, status %s, last message %s)",
                reason,
                picked.lease.request_id if picked is not None else None,
                stream.endpoint,
                stream.served,
                stream.status,
                stream.last_message,
            )

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the loop, kept until it ends (``stop`` waits for what is still running)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
