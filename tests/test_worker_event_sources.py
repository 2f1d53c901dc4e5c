"""Workers given by their URL alone: the frontend reads each engine's KV-event publishers from its
``GET /kv_event_sources`` (vLLM's endpoint, which the mocker serves the same way), per DP rank, with a
``*`` bind address reached at the worker's host. An engine that publishes no events is still served,
and ``/admin/workers`` says why its overlaps stay empty. Real mocker and frontend processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from support import free_port, free_port_block, service, wait_until

MODEL = "sources-model"


@contextlib.contextmanager
def mocker(*extra: str) -> Iterator[str]:
    port = free_port()
    kv, replay = free_port_block(2), free_port_block(2)
    args = ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
    args += ["--kv-events-endpoint", f"tcp://*:{kv}", "--replay-endpoint", f"tcp://*:{replay}", *extra]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=f"{url}/v1/models", timeout=90):
        yield url


@contextlib.contextmanager
def frontend(*workers: str) -> Iterator[httpx.Client]:
    port = free_port()
    args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv"]
    for w in workers:
        args += ["--worker", w]
    url = f"http://127.0.0.1:{port}"
    with service(args, ready_url=f"{url}/health", timeout=90), httpx.Client(base_url=url, timeout=30) as c:
        wait_until(lambda: all(w["healthy"] for w in c.get("/admin/workers").json()["workers"]), 30, what="healthy")
        yield c


def test_a_worker_given_by_url_gets_its_event_endpoints_and_ranks_from_the_engine() -> None:
    with mocker("--data-parallel-size", "2") as url, frontend(f"id=1,url={url}") as fe:
        sources = httpx.get(f"{url}/kv_event_sources").json()
        assert set(sources) == {"0", "1"} and sources["0"]["endpoint"].startswith("tcp://*:")
        row = fe.get("/admin/workers").json()["workers"][0]
        port = int(sources["0"]["endpoint"].rsplit(":", 1)[1])
        assert row["kv_events_endpoint"] == f"tcp://127.0.0.1:{port}"
        assert row["replay_endpoint"] == sources["0"]["replay_endpoint"].replace("*", "127.0.0.1")
        assert row["dp_size"] == 2 and row["warnings"] == []
        wait_until(
            lambda: set(fe.get("/admin/workers").json()["workers"][0]["kv_events"]["listeners"]) == {"0", "1"},
            30,
            what="both ranks' listeners",
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 2}
        for rank in (0, 1):
            r = fe.post("/v1/chat/completions", json=body, headers={"x-dynamo-dp-rank": str(rank)})
            assert r.status_code == 200, r.text
            wait_until(
                lambda rank=rank: any(
                    c["dp_rank"] == rank and c["overlap_blocks"] > 0
                    for c in fe.post("/admin/route", json=body).json()["candidates"]
                ),
                30,
                what=f"rank {rank}'s events applied",
            )


def test_what_the_spec_states_wins_over_the_engine() -> None:
    with mocker() as url, frontend(f"id=1,url={url},kv_events_endpoint=tcp://127.0.0.1:1,dp_size=1") as fe:
        row = fe.get("/admin/workers").json()["workers"][0]
        assert row["kv_events_endpoint"] == "tcp://127.0.0.1:1" and "replay_endpoint" not in row


def test_an_engine_without_kv_events_is_served_and_says_why_its_overlaps_are_empty() -> None:
    with mocker("--no-kv-events") as url, frontend(f"id=1,url={url}") as fe:
        row = fe.get("/admin/workers").json()["workers"][0]
        assert "kv_events_endpoint" not in row
        assert any("publishes no KV events" in w for w in row["warnings"]), row["warnings"]
        r = fe.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
