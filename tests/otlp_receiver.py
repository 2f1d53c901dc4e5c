"""A real OTLP trace receiver on loopback for the tests: OTLP/gRPC (opentelemetry-proto's generated
stubs served with grpcio) and OTLP/HTTP protobuf (``POST /v1/traces``); what kvroute and vLLM export
arrives here, span by span."""

from __future__ import annotations

import http.server
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        self.receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _spans(request: Any) -> list[ReceivedSpan]:
    got = []
    for rs in request.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        service = str(res.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                got.append(
                    ReceivedSpan(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                    )
                )
    return got


class _HttpHandler(http.server.BaseHTTPRequestHandler):
    receiver: OtlpReceiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.receiver.add(request)
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class OtlpReceiver:
    """``with OtlpReceiver() as r``: serving on ``r.endpoint`` (http://127.0.0.1:PORT, gRPC plaintext)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        handler = type("Handler", (_HttpHandler,), {"receiver": self})
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.http_endpoint = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"  # OTLP/HTTP protobuf

    def add(self, request: Any) -> None:
        got = _spans(request)
        with self.lock:
            self.spans.extend(got)

    def received(self) -> list[ReceivedSpan]:
        """Every span received so far (a copy: the server's threads keep adding)."""
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)
        self.http.shutdown()
        self.http.server_close()
