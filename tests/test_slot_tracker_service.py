"""The standalone slot tracker as a real process: the document's examples, every error class, aliases, expiry."""

from __future__ import annotations

import itertools

import httpx
import pytest

from support import free_port, service, wait_until

_counter = itertools.count()


@pytest.fixture(scope="module")
def base_url():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(port)], ready_url=f"{url}/health"):
        yield url


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=10.0) as c:
        yield c


def model() -> str:
    """A model name no other test uses (tests share one service process)."""
    return f"model-{next(_counter)}"


def raw(
    client: httpx.Client, method: str, path: str, body: bytes | str = b"", content_type: str | None = "application/json"
) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return client.request(method, path, content=body, headers=headers)


def is_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def test_health_is_empty_200(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.content == b""


def test_document_examples_verbatim(client):
    """The document's bodies, sent as written, get the document's statuses and shapes."""
    # the document's model name; this is the only test that uses it
    r = raw(
        client,
        "POST",
        "/register",
        '{\n "worker_id": 7,\n "model_name": "llama-3-8b",\n "tenant_id": "default",\n "block_size": 16,\n'
        ' "dp_start": 0,\n "dp_size": 2\n}',
    )
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    assert client.get("/workers", params={"model_name": "llama-3-8b"}).json() == [
        {
            "worker_id": 7,
            "model_name": "llama-3-8b",
            "tenant_id": "default",
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 2,
        }
    ]
    add = (
        '{\n "model_name": "llama-3-8b",\n "tenant_id": "default",\n "request_id": "req-123",\n "worker_id": 7,\n'
        ' "dp_rank": 0,\n "sequence_hashes": [101, -22, 303],\n "new_isl_tokens": 48\n}'
    )
    r = raw(client, "POST", "/add", add)
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    is_error(raw(client, "POST", "/add", add), 409)  # duplicate request id
    assert client.get("/loads", params={"model_name": "llama-3-8b"}).json() == [
        {
            "model_name": "llama-3-8b",
            "tenant_id": "default",
            "worker_id": 7,
            "dp_rank": 0,
            "active_prefill_tokens": 48,
            "active_decode_blocks": 3,
        },
        {
            "model_name": "llama-3-8b",
            "tenant_id": "default",
            "worker_id": 7,
            "dp_rank": 1,
            "active_prefill_tokens": 0,
            "active_decode_blocks": 0,
        },
    ]
    # a second active request so rank 0 shows the document's "active_requests": 2
    r = client.post(
        "/add",
        json={
            "model_name": "llama-3-8b",
            "request_id": "req-124",
            "worker_id": 7,
            "dp_rank": 0,
            "sequence_hashes": [101],
        },
    )
    assert r.status_code == 201
    pl = (
        '{\n "model_name": "llama-3-8b",\n "tenant_id": "default",\n "sequence_hashes": [101, -22, 303, 404],\n'
        ' "new_isl_tokens": 48\n}'
    )
    r = raw(client, "POST", "/potential_loads", pl)
    assert r.status_code == 200
    rows = sorted(r.json(), key=lambda x: (x["worker_id"], x["dp_rank"]))
    assert rows[0] == {
        "worker_id": 7,
        "dp_rank": 0,
        "potential_prefill_tokens": 96,
        "potential_decode_blocks": 4,
        "active_requests": 2,
    }
    assert rows[1] == {
        "worker_id": 7,
        "dp_rank": 1,
        "potential_prefill_tokens": 48,
        "potential_decode_blocks": 4,
        "active_requests": 0,
    }
    done = '{\n "model_name": "llama-3-8b",\n "tenant_id": "default",\n "request_id": "req-123"\n}'
    for _ in range(2):  # repeated completion is a no-op
        r = raw(client, "POST", "/prefill_complete", done)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    for _ in range(2):  # free is idempotent
        r = raw(client, "POST", "/free", done)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    is_error(raw(client, "POST", "/prefill_complete", done), 404)  # now unknown
    unreg = '{\n "worker_id": 7,\n "model_name": "llama-3-8b",\n "tenant_id": "default"\n}'
    r = raw(client, "POST", "/unregister", unreg)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    is_error(raw(client, "POST", "/unregister", unreg), 404)
    assert client.get("/workers", params={"model_name": "llama-3-8b"}).json() == []
    is_error(raw(client, "POST", "/free", done), 404)  # tracker gone with its last worker


def test_error_classes(client):
    m = model()
    ok = {"worker_id": 1, "model_name": m, "block_size": 16, "dp_start": 0, "dp_size": 1}
    # 415: no content type, or a non-JSON one
    is_error(raw(client, "POST", "/register", b"{}", content_type=None), 415)
    is_error(raw(client, "POST", "/register", b"{}", content_type="text/plain"), 415)
    # 400: malformed JSON and empty body
    is_error(raw(client, "POST", "/register", b'{"worker_id":'), 400)
    is_error(raw(client, "POST", "/add", b""), 400)
    # 422: missing field, wrong type, null where a string is required, array instead of object
    assert "model_name" in is_error(raw(client, "POST", "/register", b'{"worker_id":1}'), 422)
    is_error(client.post("/register", json={**ok, "worker_id": "1"}), 422)
    is_error(client.post("/register", json={**ok, "worker_id": -1}), 422)
    is_error(client.post("/register", json={**ok, "worker_id": 1 << 64}), 422)
    is_error(client.post("/register", json={**ok, "dp_start": 1 << 32}), 422)
    is_error(client.post("/register", json={**ok, "tenant_id": None}), 422)
    is_error(client.post("/register", json={**ok, "tenant_id": "a", "routing_group": "b"}), 422)
    is_error(raw(client, "POST", "/add", b"[]"), 422)
    # 400 from the core's rules
    assert is_error(client.post("/register", json={**ok, "block_size": 0}), 400) == "block_size must be greater than 0"
    assert is_error(client.post("/register", json={**ok, "dp_size": 0}), 400) == "dp_size must be greater than 0"
    is_error(client.post("/register", json={**ok, "dp_start": 4294967295, "dp_size": 2}), 400)
    # 201 then 409s
    assert client.post("/register", json=ok).status_code == 201
    is_error(client.post("/register", json=ok), 409)
    assert "existing=16, requested=32" in is_error(
        client.post("/register", json={**ok, "worker_id": 2, "block_size": 32}), 409
    )
    # hashes: i64 bounds inclusive, > i64 max is 422
    add = {
        "model_name": m,
        "request_id": "r",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [-(1 << 63), (1 << 63) - 1],
    }
    assert client.post("/add", json=add).status_code == 201
    is_error(client.post("/add", json={**add, "request_id": "r2", "sequence_hashes": [1 << 63]}), 422)
    is_error(client.post("/add", json={**add, "request_id": "r2", "sequence_hashes": [1.0]}), 422)
    is_error(client.post("/add", json={**add, "request_id": "r2", "new_isl_tokens": -1}), 422)
    is_error(client.post("/add", json={k: v for k, v in add.items() if k != "sequence_hashes"}), 422)
    # 404s: unknown tracker, unknown worker, unknown rank, unknown request on prefill_complete
    is_error(client.post("/add", json={**add, "model_name": "nope-" + m}), 404)
    is_error(client.post("/add", json={**add, "request_id": "r3", "worker_id": 9}), 404)
    is_error(client.post("/add", json={**add, "request_id": "r3", "dp_rank": 1}), 404)
    is_error(client.post("/prefill_complete", json={"model_name": m, "request_id": "zz"}), 404)
    is_error(client.post("/potential_loads", json={"model_name": "nope-" + m, "sequence_hashes": []}), 404)
    # 413: over 2 MiB refused, exactly 2 MiB accepted
    limit = 2 * 1024 * 1024
    body = b'{"model_name":"%s","sequence_hashes":[]}' % m.encode()
    assert raw(client, "POST", "/potential_loads", body + b" " * (limit - len(body))).status_code == 200
    is_error(raw(client, "POST", "/potential_loads", body + b" " * (limit - len(body) + 1)), 413)
    # the fast ASGI path of POST /potential_loads applies the same checks in the same order
    is_error(raw(client, "POST", "/potential_loads", b"{}", content_type=None), 415)
    is_error(
        raw(client, "POST", "/potential_loads", b'{"model_name":', content_type="application/json; charset=utf-8"), 400
    )
    is_error(
        raw(
            client,
            "POST",
            "/potential_loads",
            b'{"model_name":"%s","sequence_hashes":[1],"new_isl_tokens":18446744073709551616}' % m.encode(),
        ),
        422,
    )
    is_error(
        raw(
            client,
            "POST",
            "/potential_loads",
            b'{"model_name":"%s","sequence_hashes":[1],"tenant_id":"nope"}' % m.encode(),
        ),
        404,
    )
    assert (
        raw(
            client, "POST", "/potential_loads", b'{"model_name":"%s","sequence_hashes":[-1]} x' % m.encode()
        ).status_code
        == 200
    )
    # 404 unknown route (any method), 405 wrong method with allow header
    assert is_error(client.get("/nope"), 404) == "route not found"
    assert is_error(client.delete("/nope"), 404) == "route not found"
    r = client.get("/register")
    assert is_error(r, 405) == "method not allowed" and "POST" in r.headers["allow"]
    r = client.post("/loads")
    assert is_error(r, 405) and "GET" in r.headers["allow"]
    r = client.get("/potential_loads")
    assert is_error(r, 405) and "POST" in r.headers["allow"]
    # repeated query parameters are refused with a JSON 400
    is_error(client.get("/loads?model_name=a&model_name=b"), 400)


def test_trailing_data_after_the_json_value_is_ignored_like_axum(client):
    m = model()
    r = raw(
        client,
        "POST",
        "/register",
        b'{"worker_id":1,"model_name":"%s","block_size":16,"dp_start":0,"dp_size":1} trailing' % m.encode(),
    )
    assert r.status_code == 201


def test_routing_group_alias_and_tenant_scoping(client):
    m = model()
    assert (
        client.post(
            "/register",
            json={
                "worker_id": 1,
                "model_name": m,
                "routing_group": "g1",
                "block_size": 16,
                "dp_start": 0,
                "dp_size": 1,
            },
        ).status_code
        == 201
    )
    assert (
        client.post(
            "/register", json={"worker_id": 1, "model_name": m, "block_size": 32, "dp_start": 0, "dp_size": 1}
        ).status_code
        == 201
    )
    assert [w["tenant_id"] for w in client.get("/workers", params={"model_name": m}).json()] == ["default", "g1"]
    assert [w["block_size"] for w in client.get("/workers", params={"model_name": m, "tenant_id": "g1"}).json()] == [16]
    assert [
        w["block_size"] for w in client.get("/workers", params={"model_name": m, "routing_group": "g1"}).json()
    ] == [16]
    assert (
        client.post(
            "/add",
            json={
                "model_name": m,
                "tenant_id": "g1",
                "request_id": "x",
                "worker_id": 1,
                "dp_rank": 0,
                "sequence_hashes": [1, 2],
                "new_isl_tokens": 5,
            },
        ).status_code
        == 201
    )
    # the same request id is independent in the other tracker
    assert (
        client.post(
            "/add", json={"model_name": m, "request_id": "x", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}
        ).status_code
        == 201
    )
    loads = client.get("/loads", params={"model_name": m}).json()
    assert [(row["tenant_id"], row["active_prefill_tokens"], row["active_decode_blocks"]) for row in loads] == [
        ("default", 0, 1),
        ("g1", 5, 2),
    ]
    assert client.post("/free", json={"model_name": m, "routing_group": "g1", "request_id": "x"}).status_code == 200
    assert client.get("/loads", params={"model_name": m, "tenant_id": "g1"}).json()[0]["active_decode_blocks"] == 0


def test_listings_sorted(client):
    m = model()
    for wid in (9, 2, 5):
        assert (
            client.post(
                "/register", json={"worker_id": wid, "model_name": m, "block_size": 16, "dp_start": 1, "dp_size": 2}
            ).status_code
            == 201
        )
    assert [w["worker_id"] for w in client.get("/workers", params={"model_name": m}).json()] == [2, 5, 9]
    assert [(row["worker_id"], row["dp_rank"]) for row in client.get("/loads", params={"model_name": m}).json()] == [
        (2, 1),
        (2, 2),
        (5, 1),
        (5, 2),
        (9, 1),
        (9, 2),
    ]


def test_peer_routes_without_replica_sync(client):
    for prefix, key in (("", "url"), ("/replica_sync", "endpoint")):
        is_error(client.post(f"{prefix}/register_peer", json={key: "tcp://127.0.0.1:5"}), 409)
        is_error(client.post(f"{prefix}/deregister_peer", json={key: "tcp://127.0.0.1:5"}), 409)
        assert client.get(f"{prefix}/peers").json() == []


def test_stale_requests_expire_after_configured_age():
    """DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS shortens the 300 s expiry; the request disappears by itself."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(
        ["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(port)],
        ready_url=f"{url}/health",
        env={"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": "1"},
    ):
        with httpx.Client(base_url=url, timeout=10.0) as c:
            assert (
                c.post(
                    "/register", json={"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
                ).status_code
                == 201
            )
            assert (
                c.post(
                    "/add",
                    json={
                        "model_name": "m",
                        "request_id": "r",
                        "worker_id": 1,
                        "dp_rank": 0,
                        "sequence_hashes": [1, 2],
                        "new_isl_tokens": 9,
                    },
                ).status_code
                == 201
            )
            assert c.get("/loads").json()[0]["active_decode_blocks"] == 2
            wait_until(
                lambda: c.get("/loads").json()[0]["active_decode_blocks"] == 0, timeout=20, what="stale request expiry"
            )
            assert c.get("/loads").json()[0]["active_prefill_tokens"] == 0
            assert c.post("/prefill_complete", json={"model_name": "m", "request_id": "r"}).status_code == 404


def test_cli_flags():
    from slot_tracker.__main__ import parse_args

    ns = parse_args(["--replica-sync-port", "9100"])  # the 1.6.1 spelling
    assert ns.replica_sync_bind == "tcp://*:9100" and ns.port == 8091 and ns.host == "0.0.0.0"
    ns = parse_args(
        [
            "--replica-sync-bind",
            "tcp://*:9",
            "--replica-sync-advertise",
            "tcp://a:9",
            "--replica-sync-peers",
            "tcp://b:9,tcp://c:9",
        ]
    )
    assert (ns.replica_sync_bind, ns.replica_sync_advertise, ns.replica_sync_peers) == (
        "tcp://*:9",
        "tcp://a:9",
        "tcp://b:9,tcp://c:9",
    )
    with pytest.raises(SystemExit):
        parse_args(["--replica-sync-peers", "tcp://b:9"])  # peers need a local PUB endpoint


def _raw_http(base_url: str, payload: bytes, expect_close: bool = False, head_only: bool = False) -> bytes:
    """Send raw bytes over one TCP connection and read until the response is complete or closed."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(payload)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and head_only:
                return data
            if sep and not expect_close:
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                if len(body) >= length:
                    return data


def test_one_write_protocol_keeps_http_semantics(base_url):
    """HEAD (header-only), interim 100 Continue, malformed requests and keep-alive all still work."""
    head = _raw_http(base_url, b"HEAD /workers HTTP/1.1\r\nHost: x\r\n\r\n", head_only=True)
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
    body = b'{"model_name":"nope","sequence_hashes":[]}'
    r = _raw_http(
        base_url,
        b"POST /potential_loads HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        expect_close=True,
    )
    assert r.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404") and r.endswith(b'"}')
    bad = _raw_http(base_url, b"NOT AN HTTP REQUEST\r\n\r\n", expect_close=True)
    assert bad.startswith(b"HTTP/1.1 400")
    two = _raw_http(
        base_url,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /peers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        expect_close=True,
    )
    assert two.count(b"HTTP/1.1 200") == 2 and two.endswith(b"[]")
