"""Shared test plumbing: free loopback ports, real service processes, waiting on conditions.

Tests never sleep to synchronise: they poll a condition with a deadline (``wait_until``). The process
and port helpers live in the package (``kvroute_common.processes``, ``kvroute_common.ports``) because
the benchmarks use them too; they are re-exported here for the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from kvroute_common.ports import free_port, free_port_block, free_ports
from kvroute_common.processes import REPO_ROOT, http_ready, service, stop_process, wait_until

__all__ = [
    "FAST_EXPORT",
    "REPO_ROOT",
    "SMALL_CACHE_BLOCKS",
    "SMALL_CACHE_BUDGET",
    "free_port",
    "free_port_block",
    "free_ports",
    "frontend_client",
    "http_ready",
    "mocker_url",
    "reference_installed",
    "service",
    "stop_process",
    "until",
    "wait_until",
]

# the small-cache vLLM engine tests share (tests/conftest.py, ``small_cache_vllm``); the differential test
# configures the mocker alike
SMALL_CACHE_BLOCKS = 64  # --num-gpu-blocks-override: 63 usable (block 0 is the null block)
SMALL_CACHE_BUDGET = 200  # --max-num-batched-tokens: long prompts prefill in chunks that end mid-block
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # OpenTelemetry's batch exporter sends every 100 ms, not 5 s


async def until(pred: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``pred`` on the event loop until true or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def reference_installed() -> bool:
    """Whether the reference implementation (ai-dynamo-runtime) is importable."""
    return importlib.util.find_spec("dynamo") is not None


@contextlib.contextmanager
def mocker_url(model: str, *flags: str, block_size: int = 16, kv_port: int | None = None) -> Iterator[str]:
    """A mocker serving ``model`` with KV events on ``kv_port`` (a free one by default), no replay; its URL."""
    port, kv = free_port(), kv_port or free_port_block(1)
    args = ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model]
    args += ["--block-size", str(block_size), "--kv-events-endpoint", f"tcp://*:{kv}", "--replay-endpoint", ""]
    url = f"http://127.0.0.1:{port}"
    with service([*args, *flags], ready_url=f"{url}/v1/models", timeout=90):
        yield url


@contextlib.contextmanager
def frontend_client(
    workers: Sequence[str], *flags: str, events: bool = True, headers: dict[str, str] | None = None
) -> Iterator[httpx.Client]:
    """A kv-mode frontend over ``workers`` (``--worker`` values, or bare URLs numbered from 1), once every
    worker is healthy (and, with ``events``, its KV-event stream registered); a client on its URL
    sending ``headers`` (an admin token when the flags set one)."""
    port = free_port()
    args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv", *flags]
    for i, spec in enumerate(workers, 1):
        args += ["--worker", spec if spec.startswith("id=") else f"id={i},url={spec}"]
    base = f"http://127.0.0.1:{port}"
    with (
        service(args, ready_url=f"{base}/health", timeout=90),
        httpx.Client(base_url=base, timeout=60, headers=headers) as c,
    ):
        wait_until(
            lambda: all(
                w["healthy"] and (w.get("kv_events") or not events) for w in c.get("/admin/workers").json()["workers"]
            ),
            30,
            what="workers healthy" + (" with their event streams" if events else ""),
        )
        yield c


class KvEventPub:
    """One worker's KV event stream for tests: a real ZMQ PUB socket on loopback sending vLLM's wire
    format (``indexer/wire.py``) with its own sequence numbers."""

    def __init__(self, ctx: Any, port: int, topic: bytes = b"") -> None:
        import zmq

        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic
        self.seq = 0

    def send(self, events: list, dp_rank: int = 0) -> None:
        from indexer.wire import encode_batch, seq_frame

        self.sock.send_multipart([self.topic, seq_frame(self.seq), encode_batch(events, dp_rank)])
        self.seq += 1
