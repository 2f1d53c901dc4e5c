"""kvroute as the endpoint picker of a Kubernetes inference gateway (``--epp-port``).

A Gateway API Inference Extension gateway (Envoy and the gateways built on it) sends each request's
headers and body over Envoy's external processing protocol (``envoy.service.ext_proc.v3``, gRPC) to
the endpoint picker of its ``InferencePool``. The picker makes the proxy's own decision
(:meth:`RequestPath.generate`: hints, tokenize, admission, route, book) and answers with the chosen
engine's ``ip:port`` in the ``x-gateway-destination-endpoint`` request header and in the ``envoy.lb``
dynamic metadata; the gateway forwards the request there. When nothing fits it answers an immediate
response in the API's shape (429 / 503 / 529 as the proxy would).

The booking made at the decision lives as long as the ext_proc stream: the response's first body
chunk with a token marks prefill complete (the proxy's :class:`ChunkPipeline`, which also counts
tokens and reads the engine's usage for the parity alarm and the hit-rate decomposition), its end of
stream frees it, and a stream that closes before that (the client went away, the engine failed, the
gateway gave up) frees it as a cancellation.

Processing modes: request headers SEND and a request body mode of ``FULL_DUPLEX_STREAMED`` (what GIE
gateways configure: the picker buffers the body, then answers the headers with the endpoint and
streams the body back) or ``BUFFERED`` (the endpoint rides on the body response). The response may
come ``FULL_DUPLEX_STREAMED`` (each chunk relayed back, changed only as the proxy would change it),
``STREAMED`` (chunks observed, not relayed), or not at all (``NONE``: prefill is taken as complete at
the response headers, and the end at the stream's close).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response

from frontend.observability.parity import UsageTap
from frontend.request.errors import OpenAIError

if TYPE_CHECKING:
    import grpc
    from starlette.types import Receive

    from frontend.dispatch.context import RequestContext
    from frontend.dispatch.lifecycle import Lease
    from frontend.dispatch.request_path import RequestPath
    from frontend.state import FrontendState

log = logging.getLogger("frontend.gateway.endpoint_picker")

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
# path -> the kind of generation request (frontend.dispatch.request_path._KINDS)
KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
}
MAX_BODY = 45 * 1024 * 1024  # the proxy's body limit
MAX_KEPT_RESPONSE = 4 * 1024 * 1024
# what a gateway answers when it could not reach the engine (Envoy: 503 on connect failure or reset)
UNREACHABLE = (502, 503, 504)  # a unary response is kept to read its usage, up to this size


def endpoint_of(url: str) -> str:
    """A worker's ``host:port`` as the gateway's original-destination cluster dials it."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 80}"


class PickerSource:
    """A request as the gateway sent it: headers, the body once complete, the endpoint subset."""

    def __init__(self, headers: Headers, body: bytes, subset: list[str] | None) -> None:
        self.headers = headers
        self.receive: Receive | None = None  # the client is the gateway's: it leaving closes the ext_proc stream
        self.body = body
        self.subset = subset

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
        if self.subset is None:
            return None
        allowed = set(self.subset)
        excluded = {w.id for w in state.pool.workers.values() if endpoint_of(w.spec.url) not in allowed}
        if len(excluded) == len(state.pool.workers):
            raise OpenAIError(503, "none of the gateway's endpoint subset is a worker of this pool")
        return excluded


class Picked:
    """What ``generate`` returns for the picker: the request's context and its booking."""

    __slots__ = ("ctx", "lease")

    def __init__(self, ctx: RequestContext, lease: Lease) -> None:
        self.ctx = ctx
        self.lease = lease


async def _hand_over(ctx: RequestContext, lease: Lease) -> Picked:
    """The picker's ``send``: the gateway dispatches, so the decision is the result."""
    return Picked(ctx, lease)


def _subset(request: Any) -> list[str] | None:
    """The endpoint subset the gateway allows, from the request's filter metadata (None: any)."""
    fields = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fields:
        return None
    value = fields[SUBSET_NAMESPACE].fields.get(SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


class _Stream:
    """One ext_proc stream = one HTTP request through the gateway."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()
        self.subset: list[str] | None = None
        self.request_mode = 0
        self.response_mode = 0
        self.picked: Picked | None = None
        self.chunks: Any = None  # proxy.ChunkPipeline of a streamed response
        self.rewriter: Any = (
            None  # dispatch.response_rewriter.ResponseRewriter, when the request asked for response nvext
        )
        self.kept = bytearray()  # a unary response, for its usage
        self.first_seen = False
        self.ended = False  # the response reached its end (not a stream closed early)
        self.headers_answered = False  # BUFFERED: the request headers were let through before the body

    async def handle(self, request: Any) -> AsyncIterator[Any]:
        pb = self.picker.pb
        which = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            self.request_mode = request.protocol_config.request_body_mode
            self.response_mode = request.protocol_config.response_body_mode
        if request.HasField("metadata_context") and self.subset is None:
            self.subset = _subset(request)
        if which == "request_headers":
            for h in request.request_headers.headers.headers:
                self.headers.append((h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value))
            if request.request_headers.end_of_stream:  # no body: not a generation request
                yield self._route_to_any()
            elif self.request_mode != FULL_DUPLEX:  # BUFFERED: the endpoint rides on the body response
                self.headers_answered = True
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        elif which == "request_body":
            self.body += request.request_body.body
            if len(self.body) > MAX_BODY:
                yield self._immediate(413, OpenAIError(413, f"request body exceeds {MAX_BODY} bytes"))
                return
            if request.request_body.end_of_stream:
                async for r in self._pick():
                    yield r
        elif which == "request_trailers":
            if self.picked is None:
                async for r in self._pick():
                    yield r
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif which == "response_headers":
            self._response_started(request.response_headers)
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            if request.response_headers.end_of_stream:
                self.ended = True
                self.finish()
        elif which == "response_body":
            data = request.response_body.body
            out = self._response_chunk(data, request.response_body.end_of_stream)
            if self.response_mode == FULL_DUPLEX:  # every chunk comes back through the picker
                streamed = pb.StreamedBodyResponse(body=out, end_of_stream=request.response_body.end_of_stream)
                mutation = pb.BodyMutation(streamed_response=streamed)
            elif out == data:  # STREAMED, unchanged: the gateway sends its own copy on
                mutation = None
            else:  # STREAMED: the chunk replaced (nvext added, the usage the client did not ask for taken out)
                mutation = pb.BodyMutation(body=out) if out else pb.BodyMutation(clear_body=True)
            common = pb.CommonResponse(body_mutation=mutation) if mutation is not None else None
            yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
            if request.response_body.end_of_stream:
                self.ended = True
                self.finish()
        elif which == "response_trailers":
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            self.ended = True
            self.finish()

    def _any_endpoint(self) -> str | None:
        """For a request without a routing decision (``GET /v1/models``, health): a healthy worker of the subset."""
        allowed = set(self.subset) if self.subset is not None else None
        for w in sorted(self.picker.state.pool.workers.values(), key=lambda w: w.id):
            if w.healthy and (allowed is None or endpoint_of(w.spec.url) in allowed):
                return endpoint_of(w.spec.url)
        return None

    def _route_to_any(self) -> Any:
        endpoint = self._any_endpoint()
        if endpoint is None:
            return self._immediate(503, OpenAIError(503, "no healthy worker"))
        return self._route_to(endpoint, None)

    async def _pick(self) -> AsyncIterator[Any]:
        """The request is complete: decide, answer the endpoint, and (full duplex) stream the body back."""
        headers = Headers(raw=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers])
        kind = KINDS.get(headers.get(":path", "").split("?", 1)[0])
        if not self.picker.state.serving:  # starting (no engine known yet) or draining: not a 404
            yield self._immediate(503, OpenAIError(503, "kvroute is not ready: no healthy worker yet"))
            return
        if kind is None:  # not a generation route: no decision to make, any worker answers it
            endpoint, body = self._any_endpoint(), bytes(self.body)
            if endpoint is None:
                yield self._immediate(503, OpenAIError(503, "no healthy worker"))
                return
        else:
            source = PickerSource(headers, bytes(self.body), self.subset)
            result = await self.picker.path.generate(source, kind, _hand_over)
            if isinstance(result, Response):  # refused: the error the proxy would have answered
                yield self._immediate_response(result)
                return
            assert isinstance(result, Picked)
            self.picked = result
            endpoint, body = endpoint_of(result.lease.decision.worker.spec.url), result.ctx.out_body
        yield self._route_to(endpoint, body)
        if self.request_mode == FULL_DUPLEX:  # the body goes on as the picker streams it back
            pb = self.picker.pb
            mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True))
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
            )

    def _route_to(self, endpoint: str, body: bytes | None) -> Any:
        """The decision as the gateway takes it: the header and the ``envoy.lb`` metadata, on the answer to
        the request's headers, or (buffered body, headers already answered) on the body's with the body
        the engine gets (the proxy's: nvext applied, usage requested) and its length."""
        pb = self.picker.pb
        set_headers = [pb.HeaderValueOption(header=pb.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()))]
        common = pb.CommonResponse(clear_route_cache=True)
        meta = pb.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: endpoint}})
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

    def _response_started(self, headers: Any) -> None:
        picked = self.picked
        if picked is None:
            return
        status = 200
        for h in headers.headers.headers:
            if h.key == ":status":
                status = int((h.raw_value or h.value.encode()).decode() or 200)
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
        if self.response_mode == NONE:  # no body will be seen: the headers are the first sign of output
            lease.first_token(streamed=ctx.stream)
            return
        from frontend.dispatch.response_rewriter import ResponseRewriter

        # response nvext / speculative prefill (a unary body is held and rewritten whole at its end)
        if ctx.rewrite:
            self.rewriter = ResponseRewriter(self.picker.state, ctx, lease)
        if ctx.stream:
            from frontend.dispatch.proxy import ChunkPipeline

            tap = UsageTap(ctx.probe, ctx.strip_usage, ctx.dialect.usage_key, ctx.dialect.parse_usage)
            self.chunks = ChunkPipeline(lease, ctx.dialect, self.rewriter, tap)

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

    def finish(self) -> None:
        """The response ended (or the stream closed first: a cancellation). Frees the booking once."""
        picked = self.picked
        if picked is None or picked.lease.released:
            return
        lease = picked.lease
        if lease.status != "error" and not self.ended:
            lease.client_gone()
        lease.release()
        ctx = picked.ctx
        if ctx.session is not None and lease.status == "error":
            ctx.session.invalidate()
        if ctx.session is not None:
            ctx.session.release()
        if self.rewriter is not None:
            self.rewriter.finished(lease)


NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX = 0, 1, 2, 3, 4


class EndpointPicker:
    """The ext_proc service on ``--epp-port`` (gRPC, plaintext HTTP/2), on the frontend's event loop."""

    def __init__(self, state: FrontendState, path: RequestPath) -> None:
        from frontend.gateway import epp_protocol

        self.state = state
        self.path = path
        self.pb = epp_protocol
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health: Any = None  # epp_protocol.Health
        self._watch: asyncio.Future[None] | None = None
        self.streams = 0  # ext_proc streams open (one per HTTP request the gateway carries)
        state.busy_probes.append(lambda: self.streams > 0)

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

    async def process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """``ExternalProcessor.Process``: one bidirectional stream per HTTP request."""
        stream = _Stream(self)
        self.streams += 1
        try:
            async for request in requests:
                async for response in stream.handle(request):
                    yield response
                if stream.picked is not None and stream.picked.lease.released:
                    return
        finally:
            self.streams -= 1
            stream.finish()  # the gateway closed the stream before the response ended: free at once
