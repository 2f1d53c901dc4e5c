"""Router queue end to end: ``python -m frontend --router-queue-threshold`` in front of a real mocker.

The mocker runs one sequence at a time (``--max-num-seqs 1``). An *occupier* streams a long
generation; a *blocker* sent next waits inside the engine, so the frontend sees its prompt as
in-flight prefill for as long as we keep the occupier going. With threshold 0.001 x
max_num_batched_tokens (8192) ~ 8 tokens that makes the only rank busy, so every later arrival
is held by the router queue, with no time pressure on the test. Closing the occupier lets the
blocker run; each released request then makes the rank busy again until its own first token, so
requests leave the queue one at a time and their completion order is the queue's release order.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import httpx
import pytest

from support import free_port, free_port_block, service

Q_MODEL = "queue-model"

_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def prompt(n_words: int) -> str:
    tag = uuid.uuid4().hex  # unique start: nothing cached anywhere, all of it is prefill work
    rng = uuid.uuid4().int
    out = [tag]
    for _ in range(n_words):
        out.append(_WORDS[rng % len(_WORDS)])
        rng = rng // 7 + 1_000_003 * len(out)
    return " ".join(out)


@pytest.fixture(scope="module")
def queue_mocker():
    port = free_port()
    base = free_port_block(2)
    args = [
        "-m",
        "mocker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        Q_MODEL,
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "1",
        "--seed",
        "7",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{base}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{base + 1}",
    ]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=f"{url}/v1/models", timeout=90):
        yield (
            f"id=7,url={url},max_num_batched_tokens=8192,kv_events_endpoint=tcp://127.0.0.1:{base},"
            f"replay_endpoint=tcp://127.0.0.1:{base + 1}"
        )


@contextlib.contextmanager
def queue_frontend(worker_spec: str, policy: str) -> Iterator[str]:
    port = free_port()
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--router-mode",
        "kv",
        "--router-queue-threshold",
        "0.001",
        "--router-queue-policy",
        policy,
        "--worker",
        worker_spec,
    ]
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        r = httpx.get(f"{url}/v1/models", timeout=2)
        return r.status_code == 200 and any(m["id"] == Q_MODEL for m in r.json().get("data", []))

    with service(args, ready=ready, timeout=90):
        yield url


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{Q_MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Driver:
    """Concurrent clients of one frontend, recording the order in which requests complete."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.done: list[str] = []
        self.status: dict[str, int] = {}

    async def request(
        self, name: str, n_words: int = 20, nvext: dict | None = None, headers: dict | None = None
    ) -> None:
        body = {"model": Q_MODEL, "prompt": prompt(n_words), "max_tokens": 1}
        if nvext:
            body["nvext"] = nvext
        r = await self.client.post("/v1/completions", json=body, headers=headers or {})
        self.status[name] = r.status_code
        assert r.status_code == 200, r.text
        self.done.append(name)

    async def depth(self) -> float:
        return _sample((await self.client.get("/metrics")).text, "dynamo_frontend_router_queue_pending_requests")

    async def _sum(self, name: str) -> float:
        text = (await self.client.get("/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    async def until(self, pred, what: str, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await pred():
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)  # polling interval of a deadline-bounded wait

    async def occupy(self, started: asyncio.Event, release: asyncio.Event) -> None:
        """Keep the engine's only sequence slot busy with a stream until ``release`` is set."""
        body = {"model": Q_MODEL, "prompt": prompt(10), "max_tokens": 20000, "ignore_eos": True, "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():  # keep reading (tokens keep coming) until released
                started.set()
                if release.is_set():
                    break
        # leaving the block closes the stream: the frontend aborts it on the worker

    async def hold(self, specs: list[tuple[str, dict]]) -> tuple[asyncio.Event, list[asyncio.Task]]:
        """Make the rank busy (occupier + blocker), then queue ``specs`` one by one, in order.
        Returns the event that lets the engine go, and the tasks (blocker first)."""
        started, release = asyncio.Event(), asyncio.Event()
        occupier = asyncio.create_task(self.occupy(started, release))
        await asyncio.wait_for(started.wait(), 60)
        blocker = asyncio.create_task(self.request("blocker"))
        await self.until(lambda: self._busy(), "the blocker to wait in prefill")
        tasks = [occupier, blocker]
        for name, kw in specs:
            tasks.append(asyncio.create_task(self.request(name, **kw)))
            n = len(tasks) - 2
            await self.until(lambda n=n: self._depth_is(n), f"{n} held requests")
        assert not self.done, "a request finished while the rank was supposed to be busy"
        return release, tasks

    async def _busy(self) -> bool:
        return await self._sum("dynamo_frontend_worker_active_prefill_tokens") > 0

    async def _depth_is(self, n: int) -> bool:
        return await self.depth() == n

    async def _idle(self) -> bool:
        return (
            await self._sum("dynamo_frontend_worker_active_prefill_tokens") == 0
            and await self._sum("dynamo_frontend_worker_active_decode_blocks") == 0
        )


def run_queue(url: str, specs: list[tuple[str, dict]]) -> list[str]:
    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            d = Driver(client)
            release, tasks = await d.hold(specs)
            release.set()
            await asyncio.gather(*tasks)
            assert await d.depth() == 0
            assert d.done[0] == "blocker"
            await d.until(lambda: d._idle(), "loads to return to zero")
            return d.done[1:]

    return asyncio.run(asyncio.wait_for(main(), 180))


def test_fcfs_with_strict_tiers_and_priority_shift(queue_mocker):
    specs = [
        ("plain-1", {}),
        ("plain-2", {}),
        ("prio-50", {"nvext": {"agent_hints": {"priority": 50}}}),  # 50 s "earlier": ahead of plain-1
        ("tier-1", {"headers": {"x-dynamo-request-strict-priority": "1"}}),  # higher tier: first of all
        ("negative", {"nvext": {"agent_hints": {"priority": -10}}}),  # no effect in the router queue
    ]
    with queue_frontend(queue_mocker, "fcfs") as url:
        assert run_queue(url, specs) == ["tier-1", "prio-50", "plain-1", "plain-2", "negative"]


def test_lcfs_releases_newest_first(queue_mocker):
    specs = [("a", {}), ("b", {}), ("c", {}), ("d", {"nvext": {"agent_hints": {"strict_priority": 2}}})]
    with queue_frontend(queue_mocker, "lcfs") as url:
        assert run_queue(url, specs) == ["d", "c", "b", "a"]


def test_wspt_releases_shortest_uncached_work_first(queue_mocker):
    specs = [("long", {"n_words": 600}), ("short", {"n_words": 10}), ("mid", {"n_words": 150})]
    with queue_frontend(queue_mocker, "wspt") as url:
        assert run_queue(url, specs) == ["short", "mid", "long"]


def test_queue_never_loses_a_request_and_disconnected_clients_leave(queue_mocker):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            d = Driver(client)
            names = [f"r{i}" for i in range(6)]
            release, tasks = await d.hold([(n, {}) for n in names])
            held = tasks[2:]
            # two clients give up while held: their connections close
            for i in (1, 3):
                held[i].cancel()
            await d.until(lambda: d._depth_is(4), "the disconnected requests to leave the queue")
            release.set()
            await asyncio.gather(*tasks[:2], *[t for i, t in enumerate(held) if i not in (1, 3)])
            assert d.done == ["blocker", "r0", "r2", "r4", "r5"]
            assert await d.depth() == 0
            await d.until(lambda: d._idle(), "loads to return to zero")

    with queue_frontend(queue_mocker, "fcfs") as url:
        asyncio.run(asyncio.wait_for(main(), 180))
