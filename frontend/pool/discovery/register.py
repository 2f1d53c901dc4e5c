"""``python -m frontend register``: a worker sidecar that keeps a worker registered in etcd.

Puts the worker spec under ``<prefix>workers/<id>`` with a lease and keeps the lease alive until
SIGTERM / SIGINT (then revokes it, so the worker leaves at once). If the process dies, the lease
expires after ``--discovery-lease-ttl`` seconds and every frontend drops the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from frontend.pool.discovery.etcd import DEFAULT_LEASE_TTL, DEFAULT_PREFIX, normalize_prefix, register_worker
from frontend.pool.discovery.etcd_client import parse_endpoints
from frontend.pool.workers import parse_worker_arg


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m frontend register",
        description="Register one worker in etcd under a lease and keep it alive (a worker sidecar).",
    )
    p.add_argument(
        "--etcd-endpoints",
        default=env("DYN_ETCD_ENDPOINTS"),
        metavar="URLS",
        help="comma-separated etcd client URLs [env DYN_ETCD_ENDPOINTS]",
    )
    p.add_argument(
        "--discovery-prefix",
        default=env("DYN_DISCOVERY_PREFIX") or DEFAULT_PREFIX,
        help=f"key prefix [env DYN_DISCOVERY_PREFIX; default {DEFAULT_PREFIX}]",
    )
    p.add_argument(
        "--discovery-lease-ttl",
        type=int,
        default=int(env("DYN_DISCOVERY_LEASE_TTL") or DEFAULT_LEASE_TTL),
        metavar="SECONDS",
        help="the worker leaves this long after this process dies [env DYN_DISCOVERY_LEASE_TTL; default "
        f"{DEFAULT_LEASE_TTL}]",
    )
    p.add_argument(
        "--worker",
        required=True,
        metavar="SPEC",
        help="the worker, as the frontend's --worker: id=1,url=http://host:8001[,...]",
    )
    p.add_argument("--log-level", default=env("DYN_LOG", "info"))
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        endpoints = parse_endpoints(ns.etcd_endpoints or "")
        spec = parse_worker_arg(ns.worker)
        prefix = normalize_prefix(ns.discovery_prefix)
    except ValueError as exc:
        p.error(str(exc))
    if ns.discovery_lease_ttl < 2:
        p.error("--discovery-lease-ttl must be >= 2 seconds")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await register_worker(endpoints, prefix, ns.discovery_lease_ttl, spec, stop)

    asyncio.run(run())
    return 0
