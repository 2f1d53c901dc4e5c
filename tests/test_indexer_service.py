"""``python -m indexer`` as a real process: the HTTP API, its statuses and JSON errors, ZMQ end to end,
P2P recovery from a peer's /dump, and the DYN_ROUTER_MIN_INITIAL_WORKERS start-up gate."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest
import zmq

from indexer.service import QueryHashes
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute_common.hashing import list_to_i64, local_block_hashes
from support import KvEventPub, free_port, free_ports, service, wait_until

BS = 4
FAST_RECOVERY = {"KVROUTE_INDEXER_RECOVERY_DELAY": "0.2"}


def toks(*blocks: int) -> list[int]:
    return [t for b in blocks for t in [b] * BS]


def indexer_args(port: int, *extra: str) -> list[str]:
    return ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), *extra]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(indexer_args(port), ready_url=f"{url}/health"):
        yield url


def post(url: str, body: object, **kw) -> httpx.Response:
    return httpx.post(url, json=body, timeout=10.0, **kw)


def reg_body(instance_id: int, port: int, model: str = "svc", **kw) -> dict:
    return {
        "instance_id": instance_id,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "model_name": model,
        "block_size": BS,
        **kw,
    }


def test_health_metrics_and_unknown_routes(base: str) -> None:
    r = httpx.get(f"{base}/health")
    assert r.status_code == 200 and r.content == b""
    metrics = httpx.get(f"{base}/metrics").text
    for name in (
        "dynamo_kvindexer_models",
        "dynamo_kvindexer_workers",
        "dynamo_kvindexer_listeners",
        "dynamo_kvindexer_requests_total",
    ):
        assert name in metrics
    r = httpx.get(f"{base}/nope")
    assert r.status_code == 404 and r.json() == {"error": "route not found"}
    r = httpx.get(f"{base}/register")
    assert r.status_code == 405 and r.json() == {"error": "method not allowed"} and "POST" in r.headers["allow"]


def test_register_conflicts_and_validation(base: str) -> None:
    p = free_port()
    assert post(f"{base}/register", reg_body(101, p, "reg")).json() == {"status": "ok"}
    r = post(f"{base}/register", reg_body(101, p, "reg"))
    assert r.status_code == 409 and r.json() == {"error": "instance 101 dp_rank 0 already registered"}
    r = post(f"{base}/register", reg_body(101, p, "other"))
    assert r.status_code == 409 and "instance 101 is already registered for model=reg" in r.json()["error"]
    r = post(f"{base}/register", {**reg_body(102, p, "reg"), "block_size": 32})
    assert (
        r.status_code == 409
        and r.json()["error"] == "block_size mismatch for model=reg tenant_id=default: existing=4, requested=32"
    )
    r = post(f"{base}/register", {**reg_body(103, p, "reg"), "endpoint": "garbage"})
    assert r.status_code == 400 and r.json() == {"error": "invalid ZMQ endpoint `garbage`: missing scheme"}
    r = post(f"{base}/register", {**reg_body(103, p, "reg"), "replay_endpoint": "bad"})
    assert r.status_code == 400 and r.json() == {
        "error": "invalid replay endpoint `bad`: invalid ZMQ endpoint `bad`: missing scheme"
    }
    r = post(f"{base}/register", {**reg_body(104, p, "zero"), "block_size": 0})
    assert r.status_code == 400 and "block_size" in r.json()["error"]
    r = post(f"{base}/register", {"instance_id": 1, "model_name": "x", "block_size": 4})
    assert r.status_code == 422 and "endpoint" in r.json()["error"]
    r = httpx.post(f"{base}/register", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{base}/register", content=json.dumps(reg_body(105, p)), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json() == {"error": "Expected request with `Content-Type: application/json`"}
    big = b'{"pad":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{base}/register", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()


def test_workers_unregister_and_tenant_aliases(base: str) -> None:
    p1, p2 = free_ports(2)
    assert post(f"{base}/register", reg_body(201, p1, "wk", routing_group="g1")).status_code == 201
    assert (
        post(
            f"{base}/register",
            reg_body(201, p2, "wk", tenant_id="g1", dp_rank=1, replay_endpoint=f"tcp://127.0.0.1:{p2}"),
        ).status_code
        == 201
    )
    items = httpx.get(f"{base}/workers", params={"model_name": "wk", "tenant_id": "g1"}).json()
    assert len(items) == 1
    w = items[0]
    assert w["instance_id"] == 201 and w["source"] == "zmq" and w["tenant_id"] == "g1" and w["block_size"] == BS
    assert w["endpoints"] == {"0": f"tcp://127.0.0.1:{p1}", "1": f"tcp://127.0.0.1:{p2}"}
    assert set(w["listeners"]) == {"0", "1"} and w["listeners"]["0"]["status"] in ("pending", "active")
    assert httpx.get(f"{base}/workers", params={"routing_group": "nope"}).json() == []
    q = post(f"{base}/query", {"token_ids": toks(1), "model_name": "wk", "routing_group": "g1"})
    assert q.status_code == 200 and q.json() == {"scores": {}, "frequencies": [], "instances": {}}
    r = post(f"{base}/unregister", {"instance_id": 999, "model_name": "wk"})
    assert r.status_code == 404 and r.json() == {"error": "instance 999 not found"}
    r = post(f"{base}/unregister", {"instance_id": 201, "model_name": "zz"})
    assert r.status_code == 404 and r.json() == {"error": "instance 201 is registered for model=wk tenant_id=g1"}
    r = post(f"{base}/unregister", {"instance_id": 201, "model_name": "wk", "tenant_id": "g1", "dp_rank": 7})
    assert r.status_code == 404 and r.json() == {"error": "instance 201 dp_rank 7 not found"}
    assert post(
        f"{base}/unregister", {"instance_id": 201, "model_name": "wk", "tenant_id": "g1", "dp_rank": 1}
    ).json() == {"status": "ok"}
    assert list(httpx.get(f"{base}/workers", params={"model_name": "wk"}).json()[0]["listeners"]) == ["0"]
    assert post(f"{base}/unregister", {"instance_id": 201, "model_name": "wk"}).status_code == 200
    r = post(f"{base}/query", {"token_ids": toks(1), "model_name": "wk", "tenant_id": "g1"})
    assert r.status_code == 404 and r.json() == {"error": "no indexer for model=wk tenant_id=g1"}


def test_query_validation(base: str) -> None:
    assert post(f"{base}/register", reg_body(301, free_port(), "qv")).status_code == 201
    r = post(f"{base}/query_by_hash", {"block_hashes": [1], "model_name": "qv", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"].startswith("cache_salt is not accepted by /query_by_hash")
    r = post(f"{base}/query_by_hash", {"block_hashes": [2**63], "model_name": "qv"})
    assert r.status_code == 422
    assert post(f"{base}/query_by_hash", {"block_hashes": [-(2**63), 2**63 - 1], "model_name": "qv"}).status_code == 200
    assert post(f"{base}/query", {"token_ids": [-1], "model_name": "qv"}).status_code == 422
    r = post(f"{base}/query", {"token_ids": [1], "model_name": "nope"})
    assert r.status_code == 404 and r.json() == {"error": "no indexer for model=nope tenant_id=default"}
    # 8 MiB on the query routes: a 3 MiB body is fine there (it would be 413 elsewhere).
    body = json.dumps({"token_ids": [7] * (1024 * 1024), "model_name": "qv"}).encode()
    assert 2 * 1024 * 1024 < len(body) <= 8 * 1024 * 1024
    assert (
        httpx.post(f"{base}/query", content=body, headers={"content-type": "application/json"}, timeout=30).status_code
        == 200
    )
    huge = b'{"pad":"' + b"x" * (8 * 1024 * 1024) + b'"}'
    assert (
        httpx.post(f"{base}/query", content=huge, headers={"content-type": "application/json"}, timeout=30).status_code
        == 413
    )


def test_peers_api(base: str) -> None:
    assert post(f"{base}/register_peer", {"url": "http://127.0.0.1:1"}).status_code == 201
    assert post(f"{base}/register_peer", {"url": "http://127.0.0.1:1"}).status_code == 201
    assert httpx.get(f"{base}/peers").json() == ["http://127.0.0.1:1"]
    r = post(f"{base}/deregister_peer", {"url": "http://127.0.0.1:2"})
    assert r.status_code == 404 and r.json() == {"error": "peer not found"}
    assert post(f"{base}/deregister_peer", {"url": "http://127.0.0.1:1"}).json() == {"status": "ok"}
    assert httpx.get(f"{base}/peers").json() == []


def _scores(url: str, tokens: list[int], model: str = "default") -> dict:
    return post(f"{url}/query", {"token_ids": tokens, "model_name": model}).json()


def _live(pub: KvEventPub, urls: list[str], instance: str) -> None:
    """Publish a marker at the current seq until every indexer has it (ZMQ slow joiners)."""

    def seen() -> bool:
        pub.send([BlockStored([999], None, toks(999), BS, None, None, None)])
        return all(instance in _scores(u, toks(999))["scores"] for u in urls)

    wait_until(seen, timeout=20, interval=0.1, what="subscriptions live")


def test_end_to_end_and_peer_recovery() -> None:
    ctx = zmq.Context()
    zp1, zp2, a_port, b_port, dead = free_ports(5)
    pubs = [KvEventPub(ctx, zp1), KvEventPub(ctx, zp2)]
    workers = f"1={pubs[0].endpoint},2:1={pubs[1].endpoint}"
    a = f"http://127.0.0.1:{a_port}"
    b = f"http://127.0.0.1:{b_port}"
    try:
        with service(indexer_args(a_port, "--block-size", str(BS), "--workers", workers), ready_url=f"{a}/health"):
            _live(pubs[0], [a], "1")
            _live(pubs[1], [a], "2")
            pubs[0].send([BlockStored([1, 2, 3], None, toks(1, 2, 3), BS, None, None, None)])
            pubs[0].send([BlockStored([4], 3, toks(4), BS, None, "CPU", None)])
            pubs[1].send([BlockStored([1, 2], None, toks(1, 2), BS, None, None, None)], dp_rank=1)
            pubs[1].send([BlockStored([5], 2, toks(5), BS, None, None, None), BlockRemoved([5], None)], dp_rank=1)
            expected = {
                "scores": {"1": {"0": 12}, "2": {"1": 8}},
                "frequencies": [],
                "instances": {
                    "1": {"longest_matched": 16, "gpu": 12, "dp": {"0": 12}, "cpu": 16, "disk": 16},
                    "2": {"longest_matched": 8, "gpu": 8, "dp": {"1": 8}, "cpu": 8, "disk": 8},
                },
            }
            wait_until(lambda: _scores(a, toks(1, 2, 3, 4)) == expected, timeout=20, what="events applied on A")
            local = local_block_hashes(toks(1, 2, 3, 4), BS)
            assert (
                post(f"{a}/query_by_hash", {"block_hashes": list_to_i64(local), "model_name": "default"}).json()
                == expected
            )
            dump = httpx.get(f"{a}/dump").json()
            assert set(dump) == {"default:default"} and dump["default:default"]["block_size"] == BS

            # B recovers from the first reachable peer (the dead one is skipped), then both follow live events.
            with service(
                indexer_args(
                    b_port, "--block-size", str(BS), "--workers", workers, "--peers", f"http://127.0.0.1:{dead},{a}"
                ),
                ready_url=f"{b}/health",
                env=FAST_RECOVERY,
            ):
                assert _scores(b, toks(1, 2, 3, 4)) == expected  # before any new event: from A's dump
                assert httpx.get(f"{b}/peers").json() == [f"http://127.0.0.1:{dead}", a]
                _live(pubs[0], [a, b], "1")
                pubs[0].send([AllBlocksCleared()])
                gone = {
                    "scores": {"2": {"1": 8}},
                    "frequencies": [],
                    "instances": {"2": {"longest_matched": 8, "gpu": 8, "dp": {"1": 8}, "cpu": 8, "disk": 8}},
                }
                wait_until(
                    lambda: _scores(a, toks(1, 2, 3, 4)) == gone and _scores(b, toks(1, 2, 3, 4)) == gone,
                    timeout=20,
                    what="clear on both",
                )
    finally:
        for p in pubs:
            p.sock.close(linger=0)
        ctx.term()


def test_min_initial_workers_gate_counts_recovered_workers() -> None:
    ctx = zmq.Context()
    zp, a_port, b_port = free_ports(3)
    pub = KvEventPub(ctx, zp)
    a = f"http://127.0.0.1:{a_port}"
    b = f"http://127.0.0.1:{b_port}"
    try:
        with service(
            indexer_args(a_port, "--block-size", str(BS), "--workers", f"5={pub.endpoint}"), ready_url=f"{a}/health"
        ):
            _live(pub, [a], "5")
            # B registers one worker itself and needs two: the second one comes from A's dump (worker 5).
            with service(
                indexer_args(
                    b_port, "--block-size", str(BS), "--workers", f"6=tcp://127.0.0.1:{free_port()}", "--peers", a
                ),
                ready_url=f"{b}/health",
                env={**FAST_RECOVERY, "DYN_ROUTER_MIN_INITIAL_WORKERS": "2"},
            ):
                assert "5" in _scores(b, toks(999))["scores"]
    finally:
        pub.sock.close(linger=0)
        ctx.term()


def _raw(base: str, data: bytes, expect_responses: int = 1) -> bytes:
    """Send raw bytes on one connection; read until ``expect_responses`` full JSON bodies arrived."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while buf.count(b"HTTP/1.1 ") < expect_responses or not buf.endswith((b"}", b"]")):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf


def test_raw_http_keepalive_pipelining_chunked_and_continue(base: str) -> None:
    """The query routes (answered by FastJsonRoutes before Starlette) keep HTTP/1.1 semantics on uvicorn."""
    assert post(f"{base}/register", reg_body(401, free_port(), "raw")).status_code == 201
    q = json.dumps({"token_ids": toks(1, 2), "model_name": "raw"}).encode()
    req = b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(q),
        q,
    )
    peers = b"GET /peers HTTP/1.1\r\nhost: x\r\n\r\n"
    # pipelined: a hot route, an ASGI route, a hot route again -> three answers in order
    out = _raw(base, req + peers + req, expect_responses=3)
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b'"scores"') < out.index(b"[") < out.rindex(b'"scores"')
    # chunked request body
    chunked = (
        b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(q), q)
    )
    assert b'{"scores":{}' in _raw(base, chunked)
    # Expect: 100-continue gets its interim answer before the final one
    cont = _raw(base, req.replace(b"host: x\r\n", b"host: x\r\nexpect: 100-continue\r\n"))
    assert cont.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    # wrong content type on a hot route, then malformed HTTP (a JSON error too)
    text = req.replace(b"application/json", b"text/plain")
    assert b"HTTP/1.1 415" in _raw(base, text)
    assert _raw(base, b"NOT HTTP\r\n\r\n").startswith(b"HTTP/1.1 400") and b'{"error":' in _raw(
        base, b"NOT HTTP\r\n\r\n"
    )
    # HTTP/1.0 without keep-alive: answer then close
    assert b"connection: close" in _raw(base, req.replace(b"HTTP/1.1\r\n", b"HTTP/1.0\r\n", 1))


def test_fast_query_routes_are_counted_in_metrics(base: str) -> None:
    assert post(f"{base}/register", reg_body(501, free_port(), "met")).status_code == 201

    def count(endpoint: str) -> float:
        for line in httpx.get(f"{base}/metrics").text.splitlines():
            if line.startswith(f'dynamo_kvindexer_requests_total{{endpoint="{endpoint}",method="POST"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("/query_by_hash"), count("/query")
    assert post(f"{base}/query_by_hash", {"block_hashes": [1], "model_name": "met"}).status_code == 200
    assert post(f"{base}/query", {"token_ids": toks(1), "model_name": "met"}).status_code == 200
    assert post(f"{base}/query", {"token_ids": toks(1), "model_name": "none"}).status_code == 404
    assert (count("/query_by_hash"), count("/query")) == (before[0] + 1, before[1] + 2)
    assert 'dynamo_kvindexer_errors_total{endpoint="/query",status_class="4xx"}' in httpx.get(f"{base}/metrics").text


def test_query_hashes_are_local_block_hashes_on_demand() -> None:
    """/query hashes its tokens block by block as the match walk asks (indexer.service.QueryHashes):
    the same hashes as local_block_hashes, and the same error for a bad token, raised up front."""
    rng = random.Random(3)
    for bs in (1, 4, 16):
        for n_tokens in (0, 3, 16, 50, 64):
            tokens = [rng.randrange(0, 1 << 32) for _ in range(n_tokens)]
            for lora, salt in ((None, None), ("adapter", None), (None, "salt"), ("adapter", "salt")):
                want = local_block_hashes(tokens, bs, lora, salt)
                q = QueryHashes(tokens, bs, lora, salt)
                assert (q.total, q.hashes) == (len(want), [])
                q.fill(2)
                assert q.hashes == want[:2]
                q.fill(1)
                assert q.hashes == want[:2]
                q.fill(len(want) + 5)
                assert q.hashes == want
    for bad in ([1, -1], [1 << 32] * 16, [0] * 15 + [1 << 40]):
        with pytest.raises(ValueError) as ours:
            QueryHashes(bad, 16, None, None)
        with pytest.raises(ValueError) as theirs:
            local_block_hashes(bad, 16)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="block_size"):
        QueryHashes([1], 0, None, None)
