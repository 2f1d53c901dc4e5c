"""Standalone indexer process: CLI, start-up sequence (workers, P2P recovery, start-up gate), HTTP.

Start-up follows the reference indexer: register ``--workers`` (their listeners connect at once but
wait behind the ready gate), wait a moment past ZMQ's slow-joiner window, restore the first
reachable peer's /dump, wait for ``DYN_ROUTER_MIN_INITIAL_WORKERS`` workers, open the gate (the
listeners drain what they buffered), then bind the HTTP port: uvicorn through
``kvroute_common.fast_http.serve``, the query routes answered by ``FastJsonRoutes`` before the
Starlette app (the same fast path as the slot tracker's).

``--threads``: accepted for CLI compatibility and otherwise ignored. Everything (index, ZMQ
listeners, HTTP) runs on one asyncio loop: under the GIL a pool of threads cannot run Python index
code in parallel, and one writer needs no locks. Whatever the value, the index follows the
reference's single-threaded tree (its ``--threads 1``); its default multi-thread tree differs on
some removal / re-store sequences (tests/test_indexer_differential.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import httpx
import prometheus_client

from indexer.registry import DEFAULT_TENANT, IndexerRegistry, RegistryError, parse_workers_arg, split_urls
from indexer.service import ACCESS, PeerList, build_app
from kvroute_common.drain import Drain, add_drain_arg
from kvroute_common.fast_http import PROTOCOLS
from kvroute_common.fast_http import serve as serve_http
from kvroute_common.gc_policy import tune_gc
from kvroute_common.security import add_security_args, outgoing_token, policy_from_args, ssl_options

log = logging.getLogger("indexer")

RECOVERY_DELAY = float(os.environ.get("KVROUTE_INDEXER_RECOVERY_DELAY", "1.0"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m indexer", description="Standalone KV indexer (ZMQ KV events -> HTTP overlap queries)"
    )
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8090, help="HTTP port (default 8090)")
    p.add_argument(
        "--threads", type=int, default=4, help="accepted for compatibility; the index runs on one asyncio loop"
    )
    p.add_argument("--block-size", type=int, default=None, help="block size of --workers (required with --workers)")
    p.add_argument("--model-name", default="default", help="model of --workers (default 'default')")
    p.add_argument(
        "--tenant-id", "--routing-group", dest="tenant_id", default=DEFAULT_TENANT, help="tenant of --workers"
    )
    p.add_argument("--workers", default=None, help='initial workers "id[:dp_rank]=zmq_endpoint,..."')
    p.add_argument("--peers", default=None, help="comma-separated peer indexer URLs for start-up recovery")
    p.add_argument("--replay-timeout", type=float, default=2.0, help="seconds to wait for a replay answer (default 2)")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--http-protocol",
        choices=PROTOCOLS,
        default="fast",
        help="uvicorn HTTP protocol (kvroute_common.fast_http): fast = query routes answered in the protocol + one "
        "write per response; coalescing = one write only; httptools = stock",
    )
    add_security_args(p)  # --api-key: reads (GET, the queries); --admin-token: writes (also sent to --peers); TLS
    add_drain_arg(p)
    return p


async def recover_from_peers(
    registry: IndexerRegistry, peers: list[str], timeout: float = 10.0, token: str | None = None
) -> str | None:
    """Restore the first reachable peer's /dump; returns that peer's URL or None. ``token``: the bearer
    token peers of a protected deployment want (this indexer's own admin token or API key)."""
    headers = {"authorization": f"Bearer {token}"} if token else None
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        for url in peers:
            try:
                resp = await client.get(f"{url}/dump")
                if resp.status_code // 100 != 2:
                    log.warning("recovery: %s/dump answered %d", url, resp.status_code)
                    continue
                applied = registry.restore(resp.json())
                log.info("recovery: applied %d events from %s", applied, url)
                return url
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("recovery: %s unusable: %s", url, exc)
    return None


async def serve(args: argparse.Namespace) -> int:
    policy = policy_from_args(args, ACCESS)
    token = outgoing_token(policy, args)
    tls = ssl_options(args)
    drain = Drain(args.drain_timeout)
    ready = asyncio.Event()
    registry = IndexerRegistry(replay_timeout=args.replay_timeout, ready=ready)
    peer_urls = list(split_urls(args.peers))
    peers = PeerList()
    if args.workers:
        for instance_id, dp_rank, endpoint in parse_workers_arg(args.workers):
            try:
                registry.register(instance_id, endpoint, args.model_name, args.tenant_id, args.block_size, dp_rank)
            except RegistryError as exc:
                log.error("--workers: %s", exc.message)
                return 2
    min_workers = int(os.environ.get("DYN_ROUTER_MIN_INITIAL_WORKERS", "0") or 0)
    if peer_urls:
        await asyncio.sleep(RECOVERY_DELAY)  # past the ZMQ slow-joiner window (reference behaviour)
        await recover_from_peers(registry, peer_urls, token=token)
    while registry.known_worker_count() < min_workers:
        log.info("waiting for %d initial workers (have %d)", min_workers, registry.known_worker_count())
        await asyncio.sleep(1.0)
        if peer_urls:
            await recover_from_peers(registry, peer_urls, token=token)
    for url in peer_urls:
        peers.add(url)
    ready.set()
    # until SIGINT/SIGTERM; the app's lifespan stops the registry's listeners on the way out
    await serve_http(
        build_app(registry, peers, policy=policy, drain=drain),
        args.host,
        args.port,
        drain=drain,
        log_level=args.log_level.lower(),
        protocol=args.http_protocol,
        **tls,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers and args.block_size is None:
        print("--block-size is required with --workers", file=sys.stderr)
        return 2
    if args.workers:
        try:
            parse_workers_arg(args.workers)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    prometheus_client.disable_created_metrics()  # no *_created series, like the reference
    tune_gc()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    return asyncio.run(serve(args))
