"""The wire types of the endpoint picker: Envoy's ext_proc service (``envoy.service.ext_proc.v3``, the
generated code of the ``xds-protos`` package) and gRPC's standard health service, in one place so that
the picker (``frontend/gateway/endpoint_picker.py``) names messages, not import paths.

These packages are the ``epp`` extra (``pip install 'kvroute[epp]'``): only ``--epp-port`` imports them.
"""

from __future__ import annotations

import os

# gRPC's socket I/O on the poller thread grpc.aio already runs (the completion queue's), not on its
# EventEngine threads: one thread hand-off less per message, about 1 ms of CPU less per request through
# Envoy (measured: docs/deploy.md). gRPC reads this when it is imported; an operator's own setting wins.
IO_ON_POLLER = "-event_engine_listener,-event_engine_for_all_other_endpoints"
os.environ.setdefault("GRPC_EXPERIMENTS", IO_ON_POLLER)

from collections.abc import AsyncIterator, Callable  # noqa: E402 (gRPC's setting first)
from typing import Any  # noqa: E402

import grpc  # noqa: E402
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption  # noqa: E402
from envoy.service.ext_proc.v3.external_processor_pb2 import (  # noqa: E402
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus  # noqa: E402
from google.protobuf.struct_pb2 import Struct  # noqa: E402

__all__ = [
    "BodyMutation",
    "BodyResponse",
    "CommonResponse",
    "HeaderMutation",
    "HeaderValue",
    "HeaderValueOption",
    "HeadersResponse",
    "HttpStatus",
    "ImmediateResponse",
    "ProcessingRequest",
    "ProcessingResponse",
    "StreamedBodyResponse",
    "Struct",
    "TrailersResponse",
    "SERVICE",
    "Answers",
    "Health",
    "add_servicer",
]

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
Process = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]


def add_servicer(server: grpc.aio.Server, process: Process) -> None:
    """Serve ``ExternalProcessor.Process`` with ``process`` (an async generator per stream), registered
    as it is: no servicer class around it, whose generator would relay every answer once more."""
    handler = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    handlers = {"Process": handler}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # matched by the C core, not looked up per call


class Answers:
    """The answers that carry nothing but "go on", built once: the same message serves every stream
    (gRPC serialises it at each send; nothing changes it)."""

    def __init__(self) -> None:
        self.request_headers = ProcessingResponse(request_headers=HeadersResponse())
        self.request_trailers = ProcessingResponse(request_trailers=TrailersResponse())
        self.response_headers = ProcessingResponse(response_headers=HeadersResponse())
        self.response_body = ProcessingResponse(response_body=BodyResponse())
        self.response_trailers = ProcessingResponse(response_trailers=TrailersResponse())


class Health:
    """gRPC health: ``liveness`` SERVING while the process answers; ``readiness`` and the ext_proc service
    SERVING while the frontend is ready for requests (``set_ready``)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._pb = health_pb2
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.ready: bool | None = None

    async def start(self) -> None:
        await self.servicer.set("liveness", self._pb.HealthCheckResponse.SERVING)
        await self.set_ready(False)

    async def set_ready(self, ready: bool) -> None:
        if ready == self.ready:
            return
        self.ready = ready
        status = self._pb.HealthCheckResponse.SERVING if ready else self._pb.HealthCheckResponse.NOT_SERVING
        for name in ("", "readiness", SERVICE):
            await self.servicer.set(name, status)
