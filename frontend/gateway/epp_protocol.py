"""The wire types of the endpoint picker: Envoy's ext_proc service (``envoy.service.ext_proc.v3``, the
generated code of the ``xds-protos`` package) and gRPC's standard health service, in one place so that
the picker (``frontend/gateway/endpoint_picker.py``) names messages, not import paths.

These packages are the ``epp`` extra (``pip install 'kvroute[epp]'``): only ``--epp-port`` imports them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as _grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
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
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

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
    "Health",
    "add_servicer",
]

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
Process = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]


class _Servicer(_grpc.ExternalProcessorServicer):
    def __init__(self, process: Process) -> None:
        self._process = process

    async def Process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802 (gRPC's name)
        # an async generator itself: grpc.aio tells streaming handlers by their function's kind
        async for response in self._process(request_iterator, context):
            yield response


def add_servicer(server: grpc.aio.Server, process: Process) -> None:
    """Serve ``ExternalProcessor.Process`` with ``process`` (an async generator per stream)."""
    _grpc.add_ExternalProcessorServicer_to_server(_Servicer(process), server)


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
