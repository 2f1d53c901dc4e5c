"""Deployment security: API keys on /v1, the admin token on the operator and write routes (frontend and
both standalone services, including the services' in-parser fast path), keys never logged, TLS.

Real processes on loopback, real clients (httpx, the openai SDK), a self-signed certificate made here.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import socket
import ssl

import httpx
import openai
import pytest

from kvroute_common import security
from kvroute_common.security import ADMIN, API, OPEN, TokenSet, bearer_token
from support import free_ports, service

MODEL = "kvroute-demo"
API_KEYS = ("sk-test-first-7f3a9c", "sk-test-second-b81d22")
ADMIN_TOKEN = "adm-test-token-5e0c41"
OPENAI_401 = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# -- units: token handling -----------------------------------------------------------------------


def test_token_set_matches_only_its_tokens_and_never_shows_them() -> None:
    tokens = TokenSet(API_KEYS)
    assert tokens.matches(API_KEYS[0].encode()) and tokens.matches(API_KEYS[1].encode())
    assert not tokens.matches(b"sk-test-first-7f3a9")  # a prefix
    assert not tokens.matches(None) and not tokens.matches(b"")
    assert API_KEYS[0] not in repr(tokens) and "2" in repr(tokens)
    with pytest.raises(ValueError):
        TokenSet([""])
    with pytest.raises(ValueError):
        TokenSet([" padded "])


def test_bearer_header_parsing() -> None:
    assert bearer_token(b"Bearer abc") == b"abc"
    assert bearer_token(b"bearer   abc ") == b"abc"
    assert bearer_token(b"Basic abc") is None
    assert bearer_token(b"Bearer") is None
    assert bearer_token(None) is None


def _ns(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    security.add_security_args(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_flags_files_and_environment(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotation: both valid\n{API_KEYS[0]}\n\n{API_KEYS[1]}\n")
    classify = security.service_classifier(["/query"])
    policy = security.policy_from_args(_ns(api_key_file=str(keys)), classify, environ={})
    assert policy is not None and len(policy.api_keys) == 2 and not policy.admin_tokens
    # the environment is the default; a flag given on the command line replaces it
    policy = security.policy_from_args(_ns(), classify, environ={"DYN_API_KEY": "a,b", "DYN_ADMIN_TOKEN": "t"})
    assert len(policy.api_keys) == 2 and policy.admin_tokens.matches(b"t")
    policy = security.policy_from_args(_ns(api_key=["c"]), classify, environ={"DYN_API_KEY": "a,b"})
    assert len(policy.api_keys) == 1 and policy.api_keys.matches(b"c")
    assert security.policy_from_args(_ns(), classify, environ={}) is None  # nothing configured: no check at all
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(SystemExit, match="no token"):
        security.policy_from_args(_ns(admin_token_file=str(empty)), classify, environ={})
    with pytest.raises(SystemExit, match="cannot read"):
        security.policy_from_args(_ns(api_key_file=str(tmp_path / "missing")), classify, environ={})
    with pytest.raises(SystemExit, match="go together"):
        security.ssl_options(_ns(ssl_certfile=str(keys)))
    # levels: the service rule
    assert (
        classify("GET", "/health"),
        classify("GET", "/workers"),
        classify("POST", "/query"),
        classify("POST", "/register"),
    ) == (OPEN, API, API, ADMIN)
    # the admin token works where an API key does, not the other way round
    policy = security.policy_from_args(_ns(api_key=["k"], admin_token=["t"]), classify, environ={})
    assert (
        policy.allowed(API, b"t")
        and policy.allowed(API, b"k")
        and not policy.allowed(ADMIN, b"k")
        and policy.allowed(ADMIN, b"t")
    )


# -- the frontend ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured_frontend(tmp_path_factory):
    """A mocker and a frontend with two API keys (file) and an admin token (environment), debug logs."""
    tmp = tmp_path_factory.mktemp("secured")
    keys = tmp / "api-keys"
    keys.write_text("\n".join(API_KEYS) + "\n")
    log_path = str(tmp / "frontend.log")
    fport, wport = free_ports(2)
    url = f"http://127.0.0.1:{fport}"
    with service(
        ["-m", "mocker", "--port", str(wport), "--no-kv-events", "--speedup-ratio", "0"],
        ready_url=f"http://127.0.0.1:{wport}/health",
    ):
        args = [
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(fport),
            "--log-level",
            "debug",
            "--worker",
            f"id=1,url=http://127.0.0.1:{wport}",
            "--api-key-file",
            str(keys),
        ]
        with service(
            args,
            env={"DYN_ADMIN_TOKEN": ADMIN_TOKEN},
            log_path=log_path,
            ready=lambda: httpx.get(f"{url}/health", timeout=1.0).status_code == 200,
        ) as proc:
            yield url, log_path, proc


def test_v1_needs_an_api_key_with_openai_401_body(secured_frontend) -> None:
    url, _, _ = secured_frontend
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert {k: err[k] for k in OPENAI_401} == OPENAI_401 and "API key" in err["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in ({}, bearer("sk-wrong"), {"authorization": f"Basic {API_KEYS[0]}"}, bearer(ADMIN_TOKEN + "x")):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert API_KEYS[0] not in r.text
    for key in (*API_KEYS, ADMIN_TOKEN):  # both keys of the file, and the admin token
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_openai_sdk_sees_authentication_error_and_works_with_a_key(secured_frontend) -> None:
    url, _, _ = secured_frontend
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEYS[1], max_retries=0)
    stream = good.chat.completions.create(
        model=MODEL, max_tokens=6, stream=True, messages=[{"role": "user", "content": "hello"}]
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    assert [m.id for m in good.models.list()] == [MODEL]


def test_admin_routes_need_the_admin_token(secured_frontend) -> None:
    url, _, _ = secured_frontend
    writes = [
        ("GET", "/admin/workers", None),
        ("POST", "/admin/route", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/busy_threshold", {"model": MODEL, "active_decode_blocks_threshold": 0.9}),
        ("POST", "/register", {"worker_id": 9, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}),
        ("POST", "/add", {"model_name": "m", "request_id": "r", "worker_id": 9, "dp_rank": 0, "sequence_hashes": [1]}),
        ("GET", "/loads", None),
        ("DELETE", "/admin/workers/1", None),
    ]
    for method, path, body in writes:
        for headers in ({}, bearer(API_KEYS[0]), bearer("wrong")):
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            expected = (
                "invalid admin token" if headers else "admin token required: send `Authorization: Bearer <admin token>`"
            )
            assert r.json() == {"error": expected}
    # nothing above changed state: the worker is still there, no tracker registration happened
    r = httpx.get(f"{url}/admin/workers", headers=bearer(ADMIN_TOKEN))
    assert r.status_code == 200 and [w["id"] for w in r.json()["workers"]] == [1]
    tracked = httpx.get(f"{url}/workers", headers=bearer(ADMIN_TOKEN)).json()
    assert 9 not in {w["worker_id"] for w in tracked} and 1 in {w["worker_id"] for w in tracked}
    r = httpx.post(
        f"{url}/busy_threshold",
        json={"model": MODEL, "active_decode_blocks_threshold": 0.9},
        headers=bearer(ADMIN_TOKEN),
    )
    assert r.status_code == 200 and r.json()["active_decode_blocks_threshold"] == 0.9
    r = httpx.post(
        f"{url}/admin/route",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers=bearer(ADMIN_TOKEN),
    )
    assert r.status_code == 200
    # open: probes, the scrape and the threshold read
    for path in ("/health", "/live", "/metrics", "/busy_threshold"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    assert httpx.get(f"{url}/busy_threshold").json()["thresholds"][0]["active_decode_blocks_threshold"] == 0.9


def test_keys_are_never_logged(secured_frontend) -> None:
    url, log_path, _ = secured_frontend
    body = {"model": MODEL, "messages": [{"role": "user", "content": "log me"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(API_KEYS[0])).status_code == 200
    assert (
        httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer("sk-presented-wrong-key")).status_code == 401
    )
    assert httpx.get(f"{url}/admin/workers", headers=bearer(ADMIN_TOKEN)).status_code == 200
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    assert "Formula for worker_1" in text or "access control on" in text  # debug logging was on and written
    for secret in (*API_KEYS, ADMIN_TOKEN, "sk-presented-wrong-key"):
        assert secret not in text


# -- the standalone services -----------------------------------------------------------------------

REGISTER = {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
LOADS = {"model_name": "m", "sequence_hashes": [1, 2]}


@pytest.mark.parametrize("protocol", ["fast", "httptools"])
def test_slot_tracker_reads_need_a_key_writes_the_admin_token(protocol: str) -> None:
    """``fast``: /potential_loads is answered inside uvicorn's parser; ``httptools``: by the ASGI wrapper."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "slot_tracker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-protocol",
        protocol,
        "--api-key",
        API_KEYS[0],
        "--admin-token",
        ADMIN_TOKEN,
    ]
    with service(args, ready_url=f"{url}/health"), httpx.Client(base_url=url) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, bearer(API_KEYS[0]), bearer("wrong")):
            r = client.post("/register", json=REGISTER, headers=headers)
            assert r.status_code == 401 and "error" in r.json(), headers
        assert client.get("/workers", headers=bearer(ADMIN_TOKEN)).json() == []  # the refusals changed nothing
        assert client.post("/register", json=REGISTER, headers=bearer(ADMIN_TOKEN)).status_code == 201
        # the hot route, on one keep-alive connection: refusals do not break the connection
        for _ in range(3):
            r = client.post("/potential_loads", json=LOADS)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json() == {"error": "authentication required: send `Authorization: Bearer <API key>`"}
            r = client.post("/potential_loads", json=LOADS, headers=bearer("wrong"))
            assert r.status_code == 401 and r.json() == {"error": "invalid API key"}
            r = client.post("/potential_loads", json=LOADS, headers=bearer(API_KEYS[0]))
            assert r.status_code == 200 and r.json()[0]["worker_id"] == 1
        # 401 comes before the body checks (no content type: would be 415)
        assert client.post("/potential_loads", content=b"{}").status_code == 401
        assert client.post("/potential_loads", content=b"{}", headers=bearer(API_KEYS[0])).status_code == 415
        assert client.get("/loads").status_code == 401
        assert client.get("/loads", headers=bearer(ADMIN_TOKEN)).status_code == 200  # admin is accepted on reads


def test_slot_tracker_without_tokens_stays_open() -> None:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    with (
        service(["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(port)], ready_url=f"{url}/health"),
        httpx.Client(base_url=url) as client,
    ):
        assert client.post("/register", json=REGISTER).status_code == 201
        assert client.post("/potential_loads", json=LOADS).status_code == 200


def test_indexer_query_and_writes_and_peer_recovery_with_token(tmp_path) -> None:
    a_port, b_port = free_ports(2)
    a, b = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
    common = ["--api-key", API_KEYS[0], "--admin-token", ADMIN_TOKEN, "--log-level", "info"]
    with service(["-m", "indexer", "--host", "127.0.0.1", "--port", str(a_port), *common], ready_url=f"{a}/health"):
        query = {"token_ids": list(range(32)), "model_name": "m"}
        reg = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 16}
        assert httpx.post(f"{a}/register", json=reg, headers=bearer(API_KEYS[0])).status_code == 401
        assert httpx.post(f"{a}/register", json=reg, headers=bearer(ADMIN_TOKEN)).status_code == 201
        assert httpx.post(f"{a}/query", json=query).status_code == 401
        assert httpx.post(f"{a}/query_by_hash", json={"block_hashes": [1], "model_name": "m"}).status_code == 401
        r = httpx.post(f"{a}/query", json=query, headers=bearer(API_KEYS[0]))
        assert r.status_code == 200 and r.json()["scores"] == {}
        assert httpx.get(f"{a}/dump").status_code == 401
        assert httpx.get(f"{a}/metrics").status_code == 200
        # a second indexer of the same deployment recovers from the first: it sends its admin token
        log_path = str(tmp_path / "b.log")
        with service(
            ["-m", "indexer", "--host", "127.0.0.1", "--port", str(b_port), "--peers", a, *common],
            ready_url=f"{b}/health",
            log_path=log_path,
        ):
            with open(log_path, encoding="utf-8") as f:
                text = f.read()
            assert f"from {a}" in text and "answered 401" not in text, text
            assert ADMIN_TOKEN not in text and API_KEYS[0] not in text


# -- TLS ------------------------------------------------------------------------------------------------


def _self_signed(tmp_path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def test_tls_on_the_frontend_and_the_slot_tracker_fast_path(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    verify = ssl.create_default_context(cafile=cert)
    fport, tport = free_ports(2)
    tls = ["--ssl-certfile", cert, "--ssl-keyfile", key]
    tracker = f"https://127.0.0.1:{tport}"
    frontend = f"https://127.0.0.1:{fport}"
    with (
        service(
            ["-m", "slot_tracker", "--host", "127.0.0.1", "--port", str(tport), *tls, "--admin-token", ADMIN_TOKEN],
            ready=lambda: httpx.get(f"{tracker}/health", verify=verify, timeout=1.0).status_code == 200,
        ),
        service(
            ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(fport), *tls, "--api-key", API_KEYS[0]],
            ready=lambda: httpx.get(f"{frontend}/live", verify=verify, timeout=1.0).status_code == 200,
        ),
    ):
        with httpx.Client(base_url=tracker, verify=verify) as client:
            assert client.post("/register", json=REGISTER, headers=bearer(ADMIN_TOKEN)).status_code == 201
            for _ in range(3):  # hot route over TLS, keep-alive
                r = client.post("/potential_loads", json=LOADS)
                assert r.status_code == 200 and r.json()[0]["worker_id"] == 1
        r = httpx.get(f"{frontend}/v1/models", verify=verify, headers=bearer(API_KEYS[0]))
        assert r.status_code == 200 and r.json()["object"] == "list"
        assert httpx.get(f"{frontend}/v1/models", verify=verify).status_code == 401
        # not plain HTTP, and not trusted without the certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{fport}/live", timeout=5.0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{frontend}/live", timeout=5.0)
        # the handshake really negotiates TLS
        ctx = ssl.create_default_context(cafile=cert)
        with (
            socket.create_connection(("127.0.0.1", tport), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock,
        ):
            assert tls_sock.version() in ("TLSv1.2", "TLSv1.3")


def test_a_bad_tls_setting_is_a_clear_start_up_error(tmp_path) -> None:
    import subprocess
    import sys

    (port,) = free_ports(1)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "frontend",
            "--http-port",
            str(port),
            "--ssl-certfile",
            str(tmp_path / "nope.pem"),
            "--ssl-keyfile",
            str(tmp_path / "nope.key"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "not a readable file" in r.stderr
