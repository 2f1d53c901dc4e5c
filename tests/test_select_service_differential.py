"""Differential test: Dynamo 1.6.1's runtime-free selector (``python -m dynamo.select_service``) and
kvroute's ``kv`` mode, fed the same KV events and the same requests, choose the same worker.

Three workers: real mockers (the frontend's engines; their own KV events off) and, per worker, a real ZMQ
publisher on loopback in vLLM's wire format that this test drives, so both routers see one cache state.
Both run at temperature 0. Each request is asked of both: kvroute's dry run (``POST /admin/route``: every
candidate's cost) and the selector's ``POST /select`` (nothing booked). The selector's worker must be one
of kvroute's lowest-cost candidates (ties aside: any tied worker is accepted), with the same overlap, and
every candidate's load terms must be the selector's ``POST /potential_loads`` (prefill tokens, decode
blocks, active requests). (``/select``'s own ``potential_decode_blocks`` counts the prompt's partial last
block; the loads its cost weighs, ``/potential_loads``, count full blocks, as kvroute does.)

Most requests are then really sent through kvroute and booked on the selector on the worker kvroute chose
(``select_and_reserve`` pinned to it), so the loads both weigh stay the same: the mockers are slowed so
that no request reaches its first token, so every booked request keeps its prefill tokens and blocks
until the test frees it (closing the stream; ``DELETE /reservations/{id}``).
"""

from __future__ import annotations

import contextlib
import os
import random

import httpx
import pytest
import zmq

from indexer.wire import AllBlocksCleared, BlockStored
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from support import KvEventPub, free_port, free_ports, frontend_client, reference_installed, service, wait_until

pytestmark = pytest.mark.skipif(not reference_installed(), reason="reference dynamo (ai-dynamo-runtime) not installed")

BS = 16
WORKERS = 3
REQUESTS = int(os.environ.get("SELECT_DIFF_REQUESTS", "100"))
MODEL = "kvroute-demo"  # the mocker's served name
# a prefill step of the mocker lasts ~20 ms / this ratio: longer than the test, so no first token arrives
SLOW = "0.00001"


def ext_hashes(tokens: list[int]) -> list[int]:
    """Content-derived engine block hashes (the same on every worker, as in a seeded fleet)."""
    return [(h ^ 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for h in sequence_hashes(local_block_hashes(tokens, BS))]


def store(tokens: list[int], blocks: int) -> BlockStored:
    ext = ext_hashes(tokens[: blocks * BS])
    return BlockStored(ext, None, tokens[: blocks * BS], BS, None, None, None)


def marker(worker: int, rnd: int) -> list[int]:
    return [15_000 + worker * 400 + rnd % 400] * BS  # token ids below the tokenizer's 16,384


class Routers:
    """The two routers under test and the calls the test makes of them."""

    def __init__(self, kvroute: httpx.Client, selector: str) -> None:
        self.kvroute, self.selector = kvroute, selector
        self.http = httpx.Client(timeout=30)

    def kvroute_dry_run(self, tokens: list[int]) -> list[dict]:
        r = self.kvroute.post("/admin/route", json={"model": MODEL, "prompt": tokens, "max_tokens": 8})
        assert r.status_code == 200, r.text
        return r.json()["candidates"]

    def select(self, tokens: list[int]) -> dict:
        r = self.http.post(f"{self.selector}/select", json={"token_ids": tokens})
        assert r.status_code == 200, r.text
        return r.json()

    def reserve_on(self, tokens: list[int], worker: int) -> str:
        body = {"token_ids": tokens, "pinned_worker": {"worker_id": worker, "dp_rank": 0}}
        r = self.http.post(f"{self.selector}/select_and_reserve", json=body)
        assert r.status_code == 200 and r.json()["worker_id"] == worker, r.text
        return r.json()["selection_id"]

    def potential_loads(self, tokens: list[int]) -> dict[int, dict]:
        r = self.http.post(f"{self.selector}/potential_loads", json={"token_ids": tokens})
        assert r.status_code == 200, r.text
        return {x["worker_id"]: x for x in r.json()}

    def free(self, selection_id: str) -> None:
        r = self.http.delete(f"{self.selector}/reservations/{selection_id}")
        assert r.status_code == 200, r.text

    def selector_overlaps(self, tokens: list[int]) -> dict[int, int]:
        r = self.http.post(f"{self.selector}/overlap_scores", json={"token_ids": tokens})
        assert r.status_code == 200, r.text
        return {w["worker_id"]: w["device_blocks"] for w in r.json()["workers"]}

    def kvroute_overlaps(self, tokens: list[int]) -> dict[int, int]:
        return {c["worker_id"]: c["overlap_blocks"] for c in self.kvroute_dry_run(tokens)}

    def both_see(self, tokens: list[int], expected: dict[int, int]) -> bool:
        return self.kvroute_overlaps(tokens) == expected and self.selector_overlaps(tokens) == expected

    def active(self) -> dict[int, int]:
        return {c["worker_id"]: c["active_requests"] for c in self.kvroute_dry_run([1] * BS)}

    def active_after_one_more(self, before: dict[int, int]) -> dict[int, int] | None:
        """kvroute's active requests per worker once one more is booked than ``before``, else None."""
        now = self.active()
        return now if sum(now.values()) == sum(before.values()) + 1 else None


def make_prompts(rng: random.Random) -> list[list[int]]:
    """Sessions of a few shared prefixes with their own continuations (partial last blocks included)."""
    bases = [[rng.randrange(100, 9000) for _ in range(BS * rng.randint(2, 6))] for _ in range(5)]
    return [rng.choice(bases) + [rng.randrange(100, 9000) for _ in range(rng.randint(1, 5 * BS))] for _ in range(24)]


def test_kv_mode_and_dynamos_selector_choose_the_same_worker():
    rng = random.Random(int(os.environ.get("SELECT_DIFF_SEED", "20261127")))
    ctx = zmq.Context()
    pubs = [KvEventPub(ctx, p, topic=b"kv") for p in free_ports(WORKERS)]
    mocker_ports = free_ports(WORKERS)
    sel_port = free_port()
    selector = f"http://127.0.0.1:{sel_port}"
    try:
        with contextlib.ExitStack() as stack:
            for port in mocker_ports:
                stack.enter_context(
                    service(
                        ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BS),
                         "--no-kv-events", "--replay-endpoint", "", "--speedup-ratio", SLOW],
                        ready_url=f"http://127.0.0.1:{port}/v1/models",
                    )
                )  # fmt: skip
            stack.enter_context(
                service(
                    ["-m", "dynamo.select_service", "--port", str(sel_port)],
                    ready_url=f"{selector}/health",
                    env={"DYN_ROUTER_TEMPERATURE": "0"},
                )
            )
            specs = [
                f"id={i},url=http://127.0.0.1:{port},kv_events_endpoint={pub.endpoint}"
                for i, (port, pub) in enumerate(zip(mocker_ports, pubs, strict=True), 1)
            ]
            kv = stack.enter_context(
                frontend_client(specs, "--router-temperature", "0", "--kv-cache-block-size", str(BS))
            )
            routers = Routers(kv, selector)
            stack.callback(routers.http.close)
            for i, (port, pub) in enumerate(zip(mocker_ports, pubs, strict=True), 1):
                body = {"worker_id": i, "endpoint": f"http://127.0.0.1:{port}", "kv_events_endpoint": pub.endpoint,
                        "block_size": BS}  # fmt: skip
                r = routers.http.post(f"{selector}/workers", json=body)
                assert r.status_code == 201, r.text

            # both subscriptions live (ZMQ slow joiners) before anything counts
            for w, pub in enumerate(pubs):
                tokens = marker(w, 0)
                expected = {i + 1: int(i == w) for i in range(WORKERS)}

                def seen(pub: KvEventPub = pub, tokens: list[int] = tokens, expected: dict = expected) -> bool:
                    pub.send([store(tokens, 1)])
                    return routers.both_see(tokens, expected)

                wait_until(seen, timeout=60, interval=0.2, what=f"worker {w + 1}'s events seen by both routers")

            prompts = make_prompts(rng)
            open_requests: list[tuple[httpx.Response, str]] = []
            decisions = ties = booked = 0
            for rnd in range(1, REQUESTS + 1):
                # the caches change: some workers store (part of) a prompt, now and then one is cleared
                for w, pub in enumerate(pubs):
                    roll = rng.random()
                    if roll < 0.35:
                        idx = rng.randrange(len(prompts))
                        blocks = rng.randint(1, len(prompts[idx]) // BS)
                        pub.send([store(prompts[idx], blocks)])
                    elif roll < 0.38:
                        pub.send([AllBlocksCleared()])
                    tokens = marker(w, rnd)
                    pub.send([store(tokens, 1)])
                    expected = {i + 1: int(i == w) for i in range(WORKERS)}
                    wait_until(lambda t=tokens, e=expected: routers.both_see(t, e), timeout=30,
                               what=f"round {rnd}: worker {w + 1}'s events applied by both")  # fmt: skip

                tokens = rng.choice(prompts)
                cands = routers.kvroute_dry_run(tokens)
                assert len(cands) == WORKERS
                low = min(c["cost"] for c in cands)
                tied = {c["worker_id"] for c in cands if c["cost"] == low}
                picked = routers.select(tokens)
                ours = next(c for c in cands if c["worker_id"] == picked["worker_id"])
                assert picked["worker_id"] in tied, f"request {rnd}: selector chose {picked}, kvroute's costs {cands}"
                assert picked["overlap"]["gpu"] == ours["overlap_blocks"] * BS, (picked, cands)  # tokens there
                # every candidate's load terms: the selector's potential loads are kvroute's cost inputs
                loads = routers.potential_loads(tokens)
                for c in cands:
                    theirs = loads[c["worker_id"]]
                    assert (c["prefill_tokens"], c["decode_blocks"], c["active_requests"]) == (
                        theirs["potential_prefill_tokens"],
                        theirs["potential_decode_blocks"],
                        theirs["active_requests"],
                    ), f"request {rnd}: worker {c['worker_id']}: kvroute {c}, selector {theirs}"
                decisions += 1
                ties += len(tied) > 1

                if rng.random() < 0.7:  # really sent: kvroute books it, the selector books the same worker
                    before = routers.active()
                    req = kv.build_request(
                        "POST", "/v1/completions",
                        json={"model": MODEL, "prompt": tokens, "max_tokens": 8, "stream": True},
                        timeout=httpx.Timeout(30, read=None),
                    )  # fmt: skip
                    resp = kv.send(req, stream=True)
                    after = wait_until(lambda b=before: routers.active_after_one_more(b), timeout=20,
                                       what="kvroute booked the request")  # fmt: skip
                    worker = next(w for w in after if after[w] == before[w] + 1)
                    open_requests.append((resp, routers.reserve_on(tokens, worker)))
                    booked += 1
                if open_requests and rng.random() < 0.3:  # one ends: the client goes away, both free it
                    resp, selection = open_requests.pop(rng.randrange(len(open_requests)))
                    before_total = sum(routers.active().values())
                    resp.close()
                    routers.free(selection)
                    wait_until(lambda b=before_total: sum(routers.active().values()) == b - 1, timeout=20,
                               what="kvroute freed the request")  # fmt: skip
            for resp, selection in open_requests:
                resp.close()
                routers.free(selection)
            print(f"{decisions} decisions agreed ({ties} among tied workers), {booked} requests booked on both")
            assert decisions == REQUESTS and booked >= REQUESTS // 2
            # the comparison covered decisions the costs decided, not only ties
            assert decisions - ties >= REQUESTS // 3, (decisions, ties)
    finally:
        for pub in pubs:
            pub.sock.close(linger=0)
        ctx.term()
