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
def frontend(*workers: str, extra: tuple[str, ...] = ()) -> Iterator[httpx.Client]:
    port = free_port()
    args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv", *extra]
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


def test_a_bare_url_worker_gets_a_stable_id_and_everything_else_from_the_engine(tmp_path) -> None:
    """``--worker URL``, a URL string in the workers file and a URL posted to /admin/workers: each gets the
    id derived from its URL (the same after a restart) and its event endpoints from the engine."""
    with mocker() as url, mocker() as url2, mocker() as url3:
        seen: list[int] = []
        for life in range(2):  # two frontend lifetimes: the id is the same
            text = f"bare url, life {life} " * 60  # a prompt the engine has not cached yet: new events
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
            workers_file = tmp_path / "workers.yaml"
            workers_file.write_text(f"workers:\n  - {url2}\n")
            with frontend(url, extra=("--workers-file", str(workers_file))) as fe:
                rows = {w["url"]: w for w in fe.get("/admin/workers").json()["workers"]}
                assert set(rows) == {url, url2}
                assert rows[url]["kv_events_endpoint"].startswith("tcp://127.0.0.1:") and rows[url]["warnings"] == []
                seen.append(rows[url]["id"])
                assert rows[url]["id"] != rows[url2]["id"]
                added = fe.post("/admin/workers", json=url3)
                assert added.status_code == 201, added.text
                assert fe.post("/admin/workers", json={"url": url3}).json()["id"] == added.json()["id"]
                assert fe.post("/admin/workers", json=[url3]).status_code == 422
                wait_until(
                    lambda: all(
                        w["healthy"] and w.get("kv_events") for w in fe.get("/admin/workers").json()["workers"]
                    ),
                    30,
                    what="every worker healthy with its event stream",
                )
                r = fe.post("/v1/chat/completions", json=body, headers={"x-dynamo-worker-instance-id": str(seen[-1])})
                assert r.status_code == 200, r.text
                wait_until(
                    lambda body=body: any(  # this lifetime's body
                        c["worker_id"] == seen[-1] and c["overlap_blocks"] > 0
                        for c in fe.post("/admin/route", json=body).json()["candidates"]
                    ),
                    30,
                    what="the bare-URL worker's events applied",
                )
        assert seen[0] == seen[1]
