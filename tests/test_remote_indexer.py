"""Remote and sharded indexing (``--use-remote-indexer``, ``--serve-indexer``) on real processes.

Two mockers publish KV events. Frontend A ingests them into its embedded index and serves it
(``--serve-indexer``); two standalone indexers are shards, each subscribed to one worker (shard 2
with a replica); frontend B routes on the shards, frontend C on A's index. On the same event streams
the three find the same overlaps for every prompt, and B and C route there. A shard killed under
traffic makes B's decisions load-only (no client error, counted, visible in the routing record); the
shard restarted with its replica as peer recovers the index from it and B routes on overlaps again.
A shard that stalls (stopped: connections accepted, nothing answered) costs each decision at most the
remote-indexer timeout, load-only, and is used again once it answers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import httpx

from support import free_port, free_port_block, frontend_client, mocker_url, service, wait_until

MODEL = "remote-index"
BS = 16


def mocker(kv: int) -> contextlib.AbstractContextManager[str]:
    return mocker_url(MODEL, block_size=BS, kv_port=kv)


def indexer_args(port: int, workers: str, peers: str = "") -> list[str]:
    args = ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BS)]
    args += ["--model-name", MODEL, "--workers", workers]
    return args + (["--peers", peers] if peers else [])


def frontend(workers: list[str], *flags: str) -> contextlib.AbstractContextManager[httpx.Client]:
    return frontend_client(workers, *flags, events=False)  # remote-index frontends register no event streams


def overlaps(fe: httpx.Client, prompt: str) -> dict[int, int]:
    cands = fe.post("/admin/route", json={"model": MODEL, "prompt": prompt}).json()["candidates"]
    return {c["worker_id"]: c["overlap_blocks"] for c in cands}


def complete(fe: httpx.Client, prompt: str, **headers: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "nvext": {"extra_fields": ["routing"]}}
    r = fe.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def metric(fe: httpx.Client, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in fe.get("/metrics").text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def test_remote_and_sharded_indexing_route_as_the_embedded_index_and_survive_a_shard_restart() -> None:
    kv1, kv2 = free_port_block(1), free_port_block(1)
    p1, p2, p2b = free_port(), free_port(), free_port()
    shard1, shard2, shard2b = (f"http://127.0.0.1:{p}" for p in (p1, p2, p2b))
    with contextlib.ExitStack() as stack:
        m1, m2 = stack.enter_context(mocker(kv1)), stack.enter_context(mocker(kv2))
        ev1, ev2 = f"tcp://127.0.0.1:{kv1}", f"tcp://127.0.0.1:{kv2}"
        shard1_proc = stack.enter_context(
            service(indexer_args(p1, f"1={ev1}"), ready_url=f"{shard1}/health", timeout=90)
        )
        stack.enter_context(service(indexer_args(p2b, f"2={ev2}"), ready_url=f"{shard2b}/health", timeout=90))
        shard2_proc = stack.enter_context(
            service(indexer_args(p2, f"2={ev2}"), ready_url=f"{shard2}/health", timeout=90)
        )
        with_events = [f"id=1,url={m1},kv_events_endpoint={ev1}", f"id=2,url={m2},kv_events_endpoint={ev2}"]
        by_url = [f"id=1,url={m1}", f"id=2,url={m2}"]
        a = stack.enter_context(frontend(with_events, "--serve-indexer"))
        b = stack.enter_context(frontend(by_url, "--use-remote-indexer", f"{shard1},{shard2}"))
        c = stack.enter_context(frontend(by_url, "--use-remote-indexer", str(a.base_url)))

        # prompts computed on each worker (pinned through A), with shared prefixes
        system = "You are a careful agent. " * 30
        prompts = [system + f"task {i}: " + "do the thing " * (5 + 3 * i) for i in range(6)]
        for i, prompt in enumerate(prompts):
            complete(a, prompt, **{"x-dynamo-worker-instance-id": str(1 + i % 2)})

        def same_everywhere() -> bool:
            return all(
                overlaps(a, p) == overlaps(b, p) == overlaps(c, p) and max(overlaps(a, p).values()) > 0 for p in prompts
            )

        wait_until(same_everywhere, 30, what="embedded, sharded and served-index overlaps agree")
        # index lag per worker rank: how late the newest batch was applied (here: promptly)
        for row in a.get("/admin/workers").json()["workers"]:
            health = row["kv_events"]["health"]["0"]
            assert 0 <= health["index_lag_seconds"] < 5 and health["newest_event_age_seconds"] >= 0, health
            assert health["batches_waiting"] >= 0, health
        assert metric(a, "kvroute_kv_index_lag_seconds") >= 0
        text = a.get("/metrics").text
        assert "kvroute_kv_index_lag_seconds{" in text and "kvroute_kv_event_batches_waiting{" in text
        assert metric(a, "kvroute_kv_index_apply_lag_seconds_count") >= 1  # every applied batch
        for fe in (b, c):
            for i, prompt in enumerate(prompts):
                record = complete(fe, prompt)["nvext"]["routing"]
                assert record["overlap_source"] == "remote"
                assert record["worker_id"] == 1 + i % 2 and record["overlap_blocks"] > 0, record
        assert complete(a, prompts[0])["nvext"]["routing"]["overlap_source"] == "embedded"

        # a shard stalls: the decision waits at most --remote-indexer-timeout (0.25 s), then is load-only
        failures = metric(b, "dynamo_component_router_remote_indexer_query_failures_total")
        os.kill(shard1_proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            record = complete(b, prompts[0])["nvext"]["routing"]
            waited = time.monotonic() - started
        finally:
            os.kill(shard1_proc.pid, signal.SIGCONT)
        assert record["overlap_source"] == "remote_unavailable" and waited < 5, (record, waited)
        assert metric(b, "dynamo_component_router_remote_indexer_query_failures_total") == failures + 1
        wait_until(lambda: overlaps(b, prompts[0]) == overlaps(a, prompts[0]), 30, what="shard 1 answers again")

        # a shard dies under traffic: load-only decisions, no client error
        shard2_proc.kill()
        shard2_proc.wait(timeout=10)
        for prompt in prompts[:3]:
            record = complete(b, prompt)["nvext"]["routing"]
            assert record["overlap_source"] == "remote_unavailable"
            assert all(cand["overlap_blocks"] == 0 for cand in record["candidates"])
        assert metric(b, "dynamo_component_router_remote_indexer_query_failures_total") >= 3
        assert metric(b, "kvroute_remote_indexer_load_only_decisions_total") >= 3

        # restarted with its replica as peer: the index is recovered from it, B routes on overlaps again
        stack.enter_context(
            service(indexer_args(p2, f"2={ev2}", peers=shard2b), ready_url=f"{shard2}/health", timeout=90)
        )
        wait_until(lambda: overlaps(b, prompts[1]) == overlaps(a, prompts[1]), 30, what="shard 2 recovered")
        best = max(overlaps(a, prompts[1]).values())  # (the load-only decisions may have cached it on worker 1 too)
        record = complete(b, prompts[1])["nvext"]["routing"]
        assert record["overlap_source"] == "remote" and record["overlap_blocks"] == best > 0, record
        loads = b.get("/loads").json()
        assert all(r["active_decode_blocks"] == 0 and r["active_prefill_tokens"] == 0 for r in loads)


def test_frontends_assign_workers_to_empty_shards_and_reassign_after_a_restart() -> None:
    """``--remote-indexer-register``: the frontend (which discovers the workers and reads their event
    endpoints from the engines) registers worker w on shard w % 2; a shard restarted empty is told its
    worker again within seconds and learns its new blocks."""
    kv1, kv2 = free_port_block(1), free_port_block(1)
    p1, p2 = free_port(), free_port()
    shards = [f"http://127.0.0.1:{p}" for p in (p1, p2)]
    empty = ["-m", "indexer", "--host", "127.0.0.1", "--log-level", "warning", "--port"]
    with contextlib.ExitStack() as stack:
        m1, m2 = stack.enter_context(mocker(kv1)), stack.enter_context(mocker(kv2))
        stack.enter_context(service([*empty, str(p1)], ready_url=f"{shards[0]}/health", timeout=90))
        second = stack.enter_context(service([*empty, str(p2)], ready_url=f"{shards[1]}/health", timeout=90))
        fe = stack.enter_context(
            frontend(
                [f"id=1,url={m1}", f"id=2,url={m2}"],
                "--use-remote-indexer",
                ",".join(shards),
                "--remote-indexer-register",
            )
        )

        def registered(shard: str) -> set[int]:
            rows = httpx.get(f"{shard}/workers", timeout=5).json()
            return {int(w["instance_id"]) for w in rows}

        wait_until(lambda: registered(shards[0]) == {2} and registered(shards[1]) == {1}, 30, what="assignment")
        prompt = "An agent's long shared system prompt. " * 40
        first = complete(fe, prompt)["nvext"]["routing"]
        wait_until(lambda: max(overlaps(fe, prompt).values()) > 0, 30, what="blocks indexed on the shard")
        again = complete(fe, prompt)["nvext"]["routing"]
        assert again["overlap_source"] == "remote" and again["worker_id"] == first["worker_id"]
        assert again["overlap_blocks"] > 0

        second.kill()
        second.wait(timeout=10)
        stack.enter_context(service([*empty, str(p2)], ready_url=f"{shards[1]}/health", timeout=90))
        wait_until(lambda: registered(shards[1]) == {1}, 30, what="worker 1 re-assigned to the restarted shard")
        other = "Another prompt for worker one, pinned. " * 40
        complete(fe, other, **{"x-dynamo-worker-instance-id": "1"})
        wait_until(lambda: overlaps(fe, other).get(1, 0) > 0, 30, what="the restarted shard learns new blocks")
