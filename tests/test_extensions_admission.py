"""The async router-queue gate (frontend/routing/admission.py) over a simulated capacity.

A "worker" has ``cap`` concurrent prefill slots; a request books a slot right after ``wait``
returns and frees it when its ``done`` event fires, then calls ``notify`` like the frontend does.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from frontend.request.hints import RequestHints
from frontend.routing.admission import AdmissionQueue
from frontend.routing.eligibility import DEFAULT_MAX_NUM_BATCHED_TOKENS, any_rank_free, rank_is_busy

MODEL = "m"


class Sim:
    def __init__(self, cap: int, policy: str = "fcfs", recheck: float = 0.0) -> None:
        self.cap = cap
        self.in_use = 0
        self.max_seen = 0
        self.order: list[str] = []
        self.done: dict[str, asyncio.Event] = {}
        self.checks = 0
        self.aq = AdmissionQueue(policy, 0.5, self.capacity, recheck_interval=recheck)

    def capacity(self, model: str, hints: RequestHints, threshold: float) -> bool:
        assert model == MODEL and threshold == 0.5
        self.checks += 1
        return self.in_use < self.cap

    async def request(self, name: str, hints: RequestHints | None = None, new_tokens: int = 0) -> None:
        self.done[name] = asyncio.Event()
        await self.aq.wait(MODEL, hints or RequestHints(), new_tokens=new_tokens)
        # book synchronously, as the frontend does
        self.in_use += 1
        self.max_seen = max(self.max_seen, self.in_use)
        self.order.append(name)
        try:
            await self.done[name].wait()
        finally:
            self.in_use -= 1
            self.aq.notify(MODEL)

    def finish(self, name: str) -> None:
        self.done[name].set()


async def until(pred, timeout: float = 5.0) -> None:
    """Yield to the loop until ``pred()`` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0)


async def settle(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# --- pure helpers ---------------------------------------------------------------------------------


def test_rank_is_busy_rule():
    assert not rank_is_busy(100, 1000, 0.1)  # 100 is not above 0.1 * 1000
    assert rank_is_busy(101, 1000, 0.1)
    assert rank_is_busy(1, 1000, 0.0)  # threshold 0: any prefill in flight
    assert not rank_is_busy(0, 1000, 0.0)
    assert not rank_is_busy(5_000_000, None, 0.5)  # unknown max -> 10M
    assert rank_is_busy(5_000_001, None, 0.5)
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == 10_000_000


def test_any_rank_free():
    assert any_rank_free([], 0.5)  # no eligible rank: do not hold
    assert not any_rank_free([(600, 1000), (700, 1000)], 0.5)
    assert any_rank_free([(600, 1000), (500, 1000)], 0.5)


# --- the gate ------------------------------------------------------------------------------------


def test_disabled_queue_never_waits_or_checks():
    def boom(*a):
        raise AssertionError("no capacity check when disabled")

    aq = AdmissionQueue("fcfs", None, boom)
    assert not aq.enabled
    assert run(aq.wait(MODEL, RequestHints())) == 0.0
    assert aq.depth(MODEL) == 0


def test_threshold_must_not_be_negative():
    with pytest.raises(ValueError):
        AdmissionQueue("fcfs", -0.1, lambda *a: True)


def test_free_capacity_admits_directly():
    async def main():
        sim = Sim(cap=2)
        tasks = [asyncio.create_task(sim.request(n)) for n in ("a", "b")]
        await until(lambda: len(sim.order) == 2)
        assert sim.aq.depth(MODEL) == 0 and sim.aq.admitted_directly == 2
        for n in ("a", "b"):
            sim.finish(n)
        await asyncio.gather(*tasks)

    run(main())


def _held_order(policy: str, specs: list[tuple[str, RequestHints, int]]) -> list[str]:
    """Fill one slot, hold ``specs`` (in arrival order), then free slots one by one."""

    async def main():
        sim = Sim(cap=1, policy=policy)
        first = asyncio.create_task(sim.request("first"))
        await until(lambda: sim.order == ["first"])
        tasks = []
        for name, hints, new_tokens in specs:
            tasks.append(asyncio.create_task(sim.request(name, hints, new_tokens)))
            await until(lambda: sim.aq.depth(MODEL) == len(tasks))
        sim.finish("first")
        for i in range(len(specs)):
            await until(lambda i=i: len(sim.order) == i + 2)
            await settle()
            assert len(sim.order) == i + 2  # exactly one released per freed slot
            assert sim.aq.depth(MODEL) == len(specs) - i - 1
            sim.finish(sim.order[-1])
        await asyncio.gather(first, *tasks)
        assert sim.max_seen == 1
        return sim.order[1:]

    return run(main())


def test_fcfs_releases_in_arrival_order():
    specs = [(n, RequestHints(), 0) for n in ("a", "b", "c", "d")]
    assert _held_order("fcfs", specs) == ["a", "b", "c", "d"]


def test_lcfs_releases_newest_first():
    specs = [(n, RequestHints(), 0) for n in ("a", "b", "c", "d")]
    assert _held_order("lcfs", specs) == ["d", "c", "b", "a"]


def test_wspt_releases_smallest_job_first():
    specs = [("big", RequestHints(), 5000), ("small", RequestHints(), 10), ("mid", RequestHints(), 500)]
    assert _held_order("wspt", specs) == ["small", "mid", "big"]


def test_priority_jumps_the_queue_and_strict_tier_beats_priority():
    specs = [
        ("plain-1", RequestHints(), 0),
        ("plain-2", RequestHints(), 0),
        ("prio", RequestHints(priority=60), 0),  # arrives last but 60 s "earlier"
        ("legacy-ls", RequestHints(latency_sensitivity=30.0), 0),
        ("tier1", RequestHints(strict_priority=1), 0),
        ("negative", RequestHints(priority=-50), 0),  # no effect: plain FCFS position
    ]
    assert _held_order("fcfs", specs) == ["tier1", "prio", "legacy-ls", "plain-1", "plain-2", "negative"]


def test_many_notifies_release_only_what_capacity_allows():
    async def main():
        sim = Sim(cap=2)
        running = [asyncio.create_task(sim.request(n)) for n in ("r1", "r2")]
        await until(lambda: len(sim.order) == 2)
        held = [asyncio.create_task(sim.request(f"h{i}")) for i in range(5)]
        await until(lambda: sim.aq.depth(MODEL) == 5)
        for _ in range(10):  # spurious notifies (prefill_complete events without capacity)
            sim.aq.notify(MODEL)
        sim.aq.notify()
        await settle(50)
        assert sim.aq.depth(MODEL) == 5 and len(sim.order) == 2
        sim.finish("r1")
        await until(lambda: len(sim.order) == 3)
        await settle(50)
        assert sim.order[2] == "h0" and sim.aq.depth(MODEL) == 4 and sim.max_seen == 2
        for name in ["r2", "h0", "h1", "h2", "h3", "h4"]:
            await until(lambda name=name: name in sim.order)
            sim.finish(name)
        await asyncio.gather(*running, *held)
        assert sim.order[2:] == ["h0", "h1", "h2", "h3", "h4"] and sim.max_seen == 2

    run(main())


def test_cancelled_waiter_leaves_the_queue_without_losing_a_slot():
    async def main():
        sim = Sim(cap=1)
        first = asyncio.create_task(sim.request("first"))
        await until(lambda: sim.order == ["first"])
        a = asyncio.create_task(sim.request("a"))
        b = asyncio.create_task(sim.request("b"))
        c = asyncio.create_task(sim.request("c"))
        await until(lambda: sim.aq.depth(MODEL) == 3)
        a.cancel()  # client disconnect while held
        with pytest.raises(asyncio.CancelledError):
            await a
        assert sim.aq.depth(MODEL) == 2 and sim.aq.cancelled_while_waiting == 1
        sim.finish("first")
        await until(lambda: sim.order[-1] == "b")
        sim.finish("b")
        await until(lambda: sim.order[-1] == "c")
        sim.finish("c")
        await asyncio.gather(first, b, c)
        assert sim.order == ["first", "b", "c"] and sim.in_use == 0 and sim.aq.depth(MODEL) == 0

    run(main())


def test_waiter_cancelled_after_release_hands_its_turn_on():
    async def main():
        sim = Sim(cap=1)
        first = asyncio.create_task(sim.request("first"))
        await until(lambda: sim.order == ["first"])
        a = asyncio.create_task(sim.request("a"))
        b = asyncio.create_task(sim.request("b"))
        await until(lambda: sim.aq.depth(MODEL) == 2)
        loop = asyncio.get_running_loop()
        # free the slot: notify schedules the drain (releases "a"); cancel "a" right after the
        # drain ran but before "a" resumed to book
        sim.in_use -= 1
        sim.aq.notify(MODEL)
        loop.call_soon(a.cancel)
        with pytest.raises(asyncio.CancelledError):
            await a
        await until(lambda: sim.order == ["first", "b"])
        assert sim.aq.depth(MODEL) == 0 and sim.max_seen == 1
        sim.in_use += 1  # "first" still holds its (already counted as freed) slot in our bookkeeping
        sim.finish("b")
        sim.finish("first")
        await asyncio.gather(first, b)

    run(main())


def test_periodic_recheck_releases_without_notify():
    async def main():
        sim = Sim(cap=0, recheck=0.02)
        t = asyncio.create_task(sim.request("a"))
        await until(lambda: sim.aq.depth(MODEL) == 1)
        sim.cap = 1  # e.g. a worker was added: no prefill/free event
        await until(lambda: sim.order == ["a"], timeout=5)
        sim.finish("a")
        await t

    run(main())


def test_wait_reports_time_held():
    async def main():
        cap = {"free": True}
        aq = AdmissionQueue("fcfs", 0.5, lambda m, h, t: cap["free"], recheck_interval=0.01)
        assert await aq.wait(MODEL, RequestHints()) == 0.0
        cap["free"] = False
        t = asyncio.create_task(aq.wait(MODEL, RequestHints()))
        await until(lambda: aq.depth(MODEL) == 1)
        await asyncio.sleep(0.05)  # not synchronisation: measurable time spent held
        cap["free"] = True
        waited = await t
        assert waited >= 0.04 and aq.admitted_after_wait == 1 and aq.admitted_directly == 1

    run(main())


def test_models_are_independent():
    async def main():
        full = {"busy": True, "idle": False}
        released = []
        aq = AdmissionQueue("fcfs", 1.0, lambda model, h, th: not full[model])

        async def req(model, name):
            await aq.wait(model, RequestHints())
            released.append(name)

        t1 = asyncio.create_task(req("busy", "x"))
        await until(lambda: aq.depth("busy") == 1)
        await req("idle", "y")
        assert released == ["y"] and aq.depths() == {"busy": 1}
        full["busy"] = False
        aq.notify("busy")
        await t1
        assert released == ["y", "x"]

    run(main())


def test_close_cancels_held_requests():
    async def main():
        sim = Sim(cap=0)
        t = asyncio.create_task(sim.request("a"))
        await until(lambda: sim.aq.depth(MODEL) == 1)
        sim.aq.close()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert sim.aq.depth(MODEL) == 0

    run(main())


def test_stress_never_loses_or_double_releases():
    async def main():
        rng = random.Random(11)
        sim = Sim(cap=3, recheck=0.05)
        tasks: dict[str, asyncio.Task] = {}
        cancelled: set[str] = set()
        for i in range(120):
            name = f"r{i}"
            hints = RequestHints(priority=rng.choice([None, 0, 5, -3]), strict_priority=rng.choice([None, 0, 1]))
            tasks[name] = asyncio.create_task(sim.request(name, hints))
            await settle(rng.randrange(3))
            if rng.random() < 0.15:
                victim = rng.choice(list(tasks))
                if victim not in sim.order and victim not in cancelled:
                    tasks[victim].cancel()
                    cancelled.add(victim)
            for running in [n for n in sim.order if not sim.done[n].is_set()]:
                if rng.random() < 0.4:
                    sim.finish(running)
            assert sim.in_use <= sim.cap
        # finish everything that gets admitted
        while True:
            pending = [n for n, t in tasks.items() if not t.done()]
            if not pending:
                break
            for n in list(sim.order):
                sim.finish(n)
            await settle(5)
            assert sim.in_use <= sim.cap
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        admitted = set(sim.order)
        assert len(sim.order) == len(admitted)  # nobody admitted twice
        assert admitted | cancelled == set(tasks)  # nobody lost
        assert sim.max_seen <= sim.cap and sim.in_use == 0 and sim.aq.depth(MODEL) == 0

    run(main())


# --- client disconnect via the ASGI receive channel --------------------------------------------------


class FakeReceive:
    """An ASGI receive channel whose client disconnects when told to."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_disconnect_while_held_leaves_the_queue():
    from frontend.routing.admission import ClientDisconnected

    async def main():
        sim = Sim(cap=1)
        first = asyncio.create_task(sim.request("first"))
        await until(lambda: sim.order == ["first"])
        rx = FakeReceive()
        held = asyncio.create_task(sim.aq.wait(MODEL, RequestHints(), receive=rx))
        other = asyncio.create_task(sim.request("other"))
        await until(lambda: sim.aq.depth(MODEL) == 2)
        rx.gone.set()
        with pytest.raises(ClientDisconnected):
            await held
        assert sim.aq.depth(MODEL) == 1 and sim.aq.cancelled_while_waiting == 1
        sim.finish("first")
        await until(lambda: sim.order == ["first", "other"])
        sim.finish("other")
        await asyncio.gather(first, other)
        assert sim.max_seen == 1

    run(main())


def test_receive_watcher_is_dropped_once_admitted():
    async def main():
        sim = Sim(cap=1)
        first = asyncio.create_task(sim.request("first"))
        await until(lambda: sim.order == ["first"])
        rx = FakeReceive()
        held = asyncio.create_task(sim.aq.wait(MODEL, RequestHints(), receive=rx))
        await until(lambda: sim.aq.depth(MODEL) == 1 and rx.calls == 1)
        sim.finish("first")
        await held  # admitted; a later disconnect is the response's business, not the queue's
        rx.gone.set()
        await settle()
        assert sim.aq.cancelled_while_waiting == 0 and sim.aq.admitted_after_wait == 1
        await first

    run(main())


def test_fast_path_never_touches_receive():
    async def main():
        async def receive():
            raise AssertionError("must not read the channel when not held")

        aq = AdmissionQueue("fcfs", 0.5, lambda *a: True)
        assert await aq.wait(MODEL, RequestHints(), receive=receive) == 0.0

    run(main())


def test_close_cancels_held_request_with_receive():
    async def main():
        aq = AdmissionQueue("fcfs", 0.5, lambda *a: False)
        held = asyncio.create_task(aq.wait(MODEL, RequestHints(), receive=FakeReceive()))
        await until(lambda: aq.depth(MODEL) == 1)
        aq.close()
        with pytest.raises(asyncio.CancelledError):
            await held

    run(main())
