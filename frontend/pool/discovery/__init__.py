"""Worker discovery: one interface (``--discovery static|file|kubernetes|etcd``), several backends.

Every backend feeds the one worker registry (``WorkerPool``) through ``DiscoveryTarget``; the admin
API (``/admin/workers``) writes to the same registry as source ``api``. ``--worker`` flags (source
``cli``) are always applied, beside whichever backend is chosen.
"""

from __future__ import annotations

import argparse
import os
import socket

from frontend.pool.discovery.base import DiscoveryBackend, DiscoveryTarget

BACKENDS = ("static", "file", "kubernetes", "etcd")

__all__ = [
    "BACKENDS",
    "DiscoveryBackend",
    "DiscoveryTarget",
    "add_discovery_args",
    "build_backends",
    "replica_advertise",
]


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    from frontend.pool.discovery.etcd import DEFAULT_LEASE_TTL, DEFAULT_PREFIX
    from frontend.pool.discovery.kubernetes import DEFAULT_SELECTOR

    g = p.add_argument_group("discovery")
    env = os.environ.get
    g.add_argument(
        "--discovery",
        "--discovery-backend",
        dest="discovery",
        choices=BACKENDS,
        default=env("DYN_DISCOVERY_BACKEND") or None,
        help="where workers come from [env DYN_DISCOVERY_BACKEND; default static, or file with --workers-file]; "
        "--worker flags are added with any backend",
    )
    g.add_argument(
        "--discovery-namespace",
        default=env("DYN_DISCOVERY_NAMESPACE") or None,
        help="kubernetes: namespace of the worker EndpointSlices [env DYN_DISCOVERY_NAMESPACE; default the pod's "
        "own, else default]",
    )
    g.add_argument(
        "--discovery-selector",
        default=env("DYN_DISCOVERY_SELECTOR") or DEFAULT_SELECTOR,
        help="kubernetes: label selector of the worker Services' EndpointSlices [env DYN_DISCOVERY_SELECTOR; "
        f"default {DEFAULT_SELECTOR}]",
    )
    g.add_argument(
        "--etcd-endpoints",
        default=env("DYN_ETCD_ENDPOINTS") or None,
        metavar="URLS",
        help="etcd: comma-separated client URLs, e.g. http://etcd:2379 [env DYN_ETCD_ENDPOINTS]",
    )
    g.add_argument(
        "--discovery-prefix",
        default=env("DYN_DISCOVERY_PREFIX") or DEFAULT_PREFIX,
        help=f"etcd: key prefix of workers/ and peers/ [env DYN_DISCOVERY_PREFIX; default {DEFAULT_PREFIX}]",
    )
    g.add_argument(
        "--discovery-lease-ttl",
        type=int,
        default=int(env("DYN_DISCOVERY_LEASE_TTL") or DEFAULT_LEASE_TTL),
        metavar="SECONDS",
        help="etcd: lease TTL of this frontend's replica-sync peer entry [env DYN_DISCOVERY_LEASE_TTL; default "
        f"{DEFAULT_LEASE_TTL}]",
    )


def replica_advertise(bind: str, advertise: str | None) -> str:
    """The replica-sync endpoint other frontends should connect to (a wildcard bind gets this host's address)."""
    if advertise:
        return advertise
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0", "", "[::]", "::"):
        addr = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
        return f"tcp://{addr}:{port}"
    return bind


def build_backends(ns: argparse.Namespace, worker_specs: list, replica_endpoint: str | None) -> list[DiscoveryBackend]:
    """The backends the flags ask for: always the static ``--worker`` list, plus the chosen one.

    Raises ValueError with a message fit for the command line.
    """
    from frontend.pool.discovery.static import StaticDiscovery

    mode = ns.discovery or ("file" if ns.workers_file else "static")
    if mode not in BACKENDS:
        raise ValueError(f"--discovery must be one of {', '.join(BACKENDS)}, got {mode!r}")
    if ns.workers_file and mode != "file":
        raise ValueError(f"--workers-file only works with --discovery file (not {mode})")
    backends: list[DiscoveryBackend] = [StaticDiscovery(worker_specs)]
    if mode == "file":
        if not ns.workers_file:
            raise ValueError("--discovery file needs --workers-file FILE")
        from frontend.pool.discovery.file import FileDiscovery

        backends.append(FileDiscovery(ns.workers_file))
    elif mode == "kubernetes":
        from frontend.pool.discovery.kubernetes import KubernetesDiscovery

        backends.append(KubernetesDiscovery(ns.discovery_namespace, ns.discovery_selector, replica_endpoint))
    elif mode == "etcd":
        from frontend.pool.discovery.etcd import EtcdDiscovery, normalize_prefix
        from frontend.pool.discovery.etcd_client import parse_endpoints

        if not ns.etcd_endpoints:
            raise ValueError("--discovery etcd needs --etcd-endpoints (or DYN_ETCD_ENDPOINTS)")
        if ns.discovery_lease_ttl < 2:
            raise ValueError("--discovery-lease-ttl must be >= 2 seconds")
        backends.append(
            EtcdDiscovery(
                parse_endpoints(ns.etcd_endpoints),
                normalize_prefix(ns.discovery_prefix),
                ns.discovery_lease_ttl,
                replica_endpoint,
            )
        )
    return backends
