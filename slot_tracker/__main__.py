"""``python -m slot_tracker``: the standalone slot tracker service (thin CLI over service.build_app)."""

from __future__ import annotations

import argparse
import sys

from kvroute_common.drain import Drain, add_drain_arg
from kvroute_common.security import add_security_args, policy_from_args, ssl_options
from slot_tracker.core import SlotRegistry, expiry_from_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slot_tracker",
        description="Standalone KV router slot tracker (active-request accounting over HTTP).",
    )
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8091, help="HTTP port (default 8091)")
    p.add_argument(
        "--replica-sync-bind",
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint to bind, e.g. tcp://*:8092; enables replica sync",
    )
    p.add_argument(
        "--replica-sync-advertise",
        metavar="ENDPOINT",
        help="externally reachable form of the bind endpoint (never registered as a peer)",
    )
    p.add_argument("--replica-sync-peers", metavar="LIST", default="", help="comma-separated peer PUB endpoints")
    p.add_argument(
        "--replica-sync-port", type=int, metavar="PORT", help="1.6.1 spelling: same as --replica-sync-bind tcp://*:PORT"
    )
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--http-protocol",
        choices=["fast", "coalescing", "httptools"],
        default="fast",
        help="uvicorn HTTP protocol (kvroute_common.fast_http): fast = hot route answered in the protocol + one "
        "write per response; coalescing = one write only; httptools = stock",
    )
    add_security_args(p)  # --api-key: reads (GET, /potential_loads); --admin-token: writes; TLS
    add_drain_arg(p)
    ns = p.parse_args(argv)
    if ns.replica_sync_port is not None and ns.replica_sync_bind is None:
        ns.replica_sync_bind = f"tcp://*:{ns.replica_sync_port}"
    if ns.replica_sync_peers and ns.replica_sync_bind is None:
        p.error("--replica-sync-peers requires --replica-sync-bind (or --replica-sync-port)")
    if ns.replica_sync_advertise and ns.replica_sync_bind is None:
        p.error("--replica-sync-advertise requires --replica-sync-bind")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from kvroute_common.fast_http import run
    from slot_tracker.service import ACCESS, build_app

    policy = policy_from_args(ns, ACCESS)
    tls = ssl_options(ns)
    drain = Drain(ns.drain_timeout)
    registry = SlotRegistry(expiry_secs=expiry_from_env())
    sync = None
    if ns.replica_sync_bind:
        from slot_tracker.replica_sync import ReplicaSync

        peers = [p.strip() for p in ns.replica_sync_peers.split(",") if p.strip()]
        sync = ReplicaSync(registry, ns.replica_sync_bind, ns.replica_sync_advertise, peers)
    # uvicorn with the lean settings measured in docs/bench/slot_tracker.md (kvroute_common.fast_http)
    run(
        build_app(registry, sync, policy=policy, drain=drain),
        ns.host,
        ns.port,
        drain=drain,
        log_level=ns.log_level,
        protocol=ns.http_protocol,
        **tls,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
