"""The media fetch policy: which image URLs the router may fetch.

Address classification is checked on literal addresses and on resolver answers given by an injected resolver,
without connecting anywhere. Fetches go to real HTTP(S) servers on loopback only: refused by default with no
connection reaching them, served with ``--mm-allow-private-media-hosts``, redirects re-checked hop by hop,
the image count and fetched bytes capped before / while fetching. Through the frontend the refusals are 400s in
the OpenAI and Anthropic shapes that never carry what a target answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import http.server
import io
import ipaddress
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image

from frontend.request.errors import OpenAIError
from frontend.routing.images import ImageCache
from frontend.routing.media_policy import (
    BROADCAST,
    LINK_LOCAL,
    LOOPBACK,
    METADATA,
    MULTICAST,
    PRIVATE,
    RESERVED,
    SHARED,
    UNSPECIFIED,
    MediaPolicy,
    MediaRefused,
    VettedNetwork,
    address_kind,
)
from kvroute_common.multimodal import ImageOptions
from kvroute_common.ports import free_port
from support import REPO_ROOT, frontend_client, mocker_url

MODEL = "tiny-vlm"
BS = 32


# -- classification, no connection anywhere

KINDS = {
    "127.0.0.1": LOOPBACK,
    "127.254.3.4": LOOPBACK,
    "::1": LOOPBACK,
    "10.1.2.3": PRIVATE,
    "172.16.0.1": PRIVATE,
    "172.31.255.255": PRIVATE,
    "192.168.1.1": PRIVATE,
    "fc00::1": PRIVATE,
    "fd12:3456::1": PRIVATE,
    "100.64.0.1": SHARED,
    "100.127.255.254": SHARED,
    "169.254.169.254": METADATA,
    "169.254.170.2": METADATA,
    "fd00:ec2::254": METADATA,
    "100.100.100.200": METADATA,
    "169.254.1.1": LINK_LOCAL,
    "fe80::1": LINK_LOCAL,
    "fe80::1%eth0": LINK_LOCAL,
    "224.0.0.1": MULTICAST,
    "239.255.255.250": MULTICAST,
    "ff02::1": MULTICAST,
    "0.0.0.0": UNSPECIFIED,
    "::": UNSPECIFIED,
    "255.255.255.255": BROADCAST,
    "240.0.0.1": RESERVED,
    "0.1.2.3": RESERVED,
    "192.0.2.7": RESERVED,  # documentation
    "198.18.0.1": RESERVED,  # benchmarking
    "2001:db8::1": RESERVED,
    # IPv4 inside IPv6: mapped, compatible, translated, NAT64, 6to4
    "::ffff:127.0.0.1": LOOPBACK,
    "::ffff:169.254.169.254": METADATA,
    "::ffff:10.0.0.1": PRIVATE,
    "::127.0.0.1": LOOPBACK,
    "::ffff:0:a00:1": PRIVATE,
    "64:ff9b::a9fe:a9fe": METADATA,
    "64:ff9b::7f00:1": LOOPBACK,
    "2002:a9fe:a9fe::1": METADATA,
    "2002:c0a8:101::1": PRIVATE,
    # public
    "8.8.8.8": None,
    "1.1.1.1": None,
    "172.32.0.1": None,
    "100.128.0.1": None,
    "2606:4700:4700::1111": None,
    "::ffff:8.8.8.8": None,
    "64:ff9b::808:808": None,
}


@pytest.mark.parametrize(("address", "kind"), sorted(KINDS.items()))
def test_addresses_are_classified(address: str, kind: str | None) -> None:
    assert address_kind(ipaddress.ip_address(address)) == kind


def test_the_opt_in_opens_loopback_private_and_shared_only() -> None:
    default, opened = MediaPolicy(), MediaPolicy(allow_private=True)
    for address, kind in KINDS.items():
        ip = ipaddress.ip_address(address)
        assert default.address_refusal(ip) == kind
        assert opened.address_refusal(ip) == (None if kind in (LOOPBACK, PRIVATE, SHARED) else kind), address


def _resolver(answers: dict[str, list[str]], calls: list[str] | None = None) -> Any:
    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return answers[host]

    return resolve


ANSWERS = {
    "cdn.example": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"],
    "metadata.example": ["169.254.169.254"],
    "rebound.example": ["10.0.0.7"],
    "mixed.example": ["93.184.216.34", "192.168.0.10"],
    "mapped.example": ["::ffff:127.0.0.1"],
    "nat64.example": ["64:ff9b::a9fe:a9fe"],
    "intranet.example": ["10.20.30.40"],
}


def test_resolver_answers_are_vetted_without_connecting() -> None:
    async def check() -> None:
        policy, resolve = MediaPolicy(), _resolver(ANSWERS)
        assert await policy.vetted_addresses("cdn.example", 443, resolve) == ANSWERS["cdn.example"]
        for host in ("metadata.example", "rebound.example", "mixed.example", "mapped.example", "nat64.example"):
            with pytest.raises(MediaRefused, match="resolves to an address the media fetch policy refuses"):
                await policy.vetted_addresses(host, 80, resolve)
        with pytest.raises(MediaRefused, match="could not be resolved"):
            await policy.vetted_addresses("nowhere.example", 80, resolve)
        opened = MediaPolicy(allow_private=True)
        assert await opened.vetted_addresses("intranet.example", 80, resolve) == ["10.20.30.40"]
        with pytest.raises(MediaRefused):  # metadata stays refused with the opt-in
            await opened.vetted_addresses("metadata.example", 80, resolve)
        # the network backend refuses before it connects: nothing is attempted
        network = VettedNetwork(policy, resolve)
        for host in ("metadata.example", "rebound.example", "10.0.0.1", "::1"):
            with pytest.raises(MediaRefused):
                await network.connect_tcp(host, 80)
        assert network.connections == 0

    asyncio.run(check())


def test_urls_are_checked_before_anything_is_resolved() -> None:
    policy = MediaPolicy()
    assert policy.check_url("https://cdn.example/a.png").host == "cdn.example"
    refused = {
        "ftp://cdn.example/a.png": "http or https",
        "file:///etc/passwd": "http or https",
        "http:///a.png": "no host",
        "http://169.254.169.254/latest/meta-data/": "cloud metadata",
        "http://[::ffff:127.0.0.1]:8080/x.png": "loopback",
        "http://[fd00:ec2::254]/": "cloud metadata",
        "http://0.0.0.0:8080/": "unspecified",
        "http://user@10.0.0.1/x.png": "private",
    }
    for url, why in refused.items():
        with pytest.raises(MediaRefused, match=why):
            policy.check_url(url)


def test_the_domain_allow_list_matches_hosts_and_subdomains() -> None:
    policy = MediaPolicy.from_flags(["example.com", ".cdn.net", "*.img.org", "10.0.0.5", "münchen.de"], True)
    listed = ["example.com", "img.example.com", "a.b.example.com", "EXAMPLE.COM.", "x.cdn.net", "a.img.org"]
    listed += ["10.0.0.5", "xn--mnchen-3ya.de"]
    for host in listed:
        assert policy.host_listed(host.lower()), host
    for host in ("badexample.com", "example.com.evil.net", "cdn.net", "img.org", "10.0.0.6", "evil.com"):
        assert not policy.host_listed(host), host
    with pytest.raises(MediaRefused, match="does not list"):
        policy.check_url("http://evil.com/x.png")
    assert not MediaPolicy().allowed_domains and MediaPolicy().host_listed("anything.example")
    for bad in (["exa mple.com"], ["."]):
        with pytest.raises(ValueError):
            MediaPolicy.from_flags(bad, False)


# -- fetching from real servers on loopback


class _Counting(http.server.ThreadingHTTPServer):
    """Counts the TCP connections it accepts (a refused fetch must make none)."""

    connections = 0

    def get_request(self) -> Any:
        conn = super().get_request()
        self.connections += 1
        return conn


@contextlib.contextmanager
def media_server(
    routes: dict[str, tuple[int, dict[str, str], bytes]],
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
) -> Iterator[tuple[int, _Counting, list[tuple[str, str | None]]]]:
    """Serves ``routes`` (path -> status, headers, body) on loopback; its port, the server and the requests."""
    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            seen.append((self.path, self.headers.get("Host")))
            status, headers, body = routes.get(self.path, (404, {}, b"internal secret: db-7 is up"))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = _Counting((host, 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], server, seen
    finally:
        server.shutdown()
        server.server_close()


def _fetch(cache: ImageCache, urls: list[str], parts: int = 0, max_bytes: int = 1 << 20) -> dict[str, bytes]:
    async def go() -> dict[str, bytes]:
        try:
            return await cache.fetch_all(urls, ImageOptions(max_bytes=max_bytes, fetch_timeout=10), parts)
        finally:
            await cache.aclose()

    return asyncio.run(go())


def test_loopback_is_refused_by_default_and_served_with_the_opt_in() -> None:
    with media_server({"/x.png": (200, {}, b"png!")}) as (port, server, seen):
        urls = [f"http://127.0.0.1:{port}/x.png", f"http://localhost:{port}/x.png", f"http://[::1]:{port}/x.png"]
        urls += [f"http://127.1:{port}/x.png", f"http://2130706433:{port}/x.png", f"http://0.0.0.0:{port}/x.png"]
        for url in urls:
            with pytest.raises(MediaRefused):
                _fetch(ImageCache(), [url])
        assert server.connections == 0 and seen == []
        opened = ImageCache(MediaPolicy(allow_private=True))
        assert _fetch(opened, [urls[0]]) == {urls[0]: b"png!"}
        with pytest.raises(MediaRefused, match="unspecified"):  # 0.0.0.0 would reach loopback: never opened
            _fetch(ImageCache(MediaPolicy(allow_private=True)), [urls[-1]])
        assert server.connections == 1


def test_the_address_connected_is_the_one_vetted_and_tls_keeps_the_name() -> None:
    """A name the test resolver maps to loopback: one lookup, the connection made to its answer, the Host header
    and (over TLS) the SNI and certificate check on the name."""
    ca, server_ctx = _tls_pair("media.test")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: sni.append(name)  # type: ignore[assignment,misc]
    png = (200, {}, b"png!")
    with media_server({"/x.png": png}) as (port, _, seen), media_server({"/x.png": png}, tls=server_ctx) as tls_site:
        tls_port, _, tls_seen = tls_site
        calls: list[str] = []
        policy = MediaPolicy.from_flags(["media.test"], True)
        resolve = _resolver({"media.test": ["127.0.0.1"]}, calls)
        cache = ImageCache(policy, resolver=resolve, ssl_context=ca)
        got = _fetch(cache, [f"http://media.test:{port}/x.png", f"https://media.test:{tls_port}/x.png"])
        assert set(got.values()) == {b"png!"}
        assert calls == ["media.test", "media.test"]  # one lookup per connection, none by anyone else
        assert seen == [("/x.png", f"media.test:{port}")] and tls_seen == [("/x.png", f"media.test:{tls_port}")]
        assert sni == ["media.test"]
        # the same name refused when its answer is not allowed: the lookup happens, the connection does not
        closed = ImageCache(MediaPolicy(), resolver=resolve, ssl_context=ca)
        with pytest.raises(MediaRefused, match="loopback"):
            _fetch(closed, [f"http://media.test:{port}/y.png"])
        assert len(seen) == 1


def _tls_pair(name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A client context trusting a fresh self-signed certificate for ``name`` only, and the server's context."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    client = ssl.create_default_context(cadata=pem.decode())
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    import tempfile

    with tempfile.NamedTemporaryFile("wb") as cf, tempfile.NamedTemporaryFile("wb") as kf:
        cf.write(pem)
        cf.flush()
        kf.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        kf.flush()
        server.load_cert_chain(cf.name, kf.name)
    return client, server


def test_every_redirect_hop_is_checked() -> None:
    with media_server({"/x.png": (200, {}, b"png!")}) as (inner_port, inner, _):
        targets = {
            "/to-other-host": f"http://127.0.0.1:{inner_port}/x.png",  # not in the allow list
            "/to-unspecified": f"http://0.0.0.0:{inner_port}/x.png",  # reaches loopback: never allowed
            "/to-metadata": "http://169.254.169.254/latest/meta-data/",
            "/to-file": "file:///etc/passwd",
        }
        routes = {path: (302, {"location": to}, b"") for path, to in targets.items()}
        routes["/local"] = (301, {"location": "/x.png"}, b"")
        routes["/x.png"] = (200, {}, b"png!")
        routes["/loop"] = (302, {"location": "/loop"}, b"")
        with media_server(routes) as (port, outer, seen):
            policy = MediaPolicy.from_flags(["localhost"], True)
            site = f"http://localhost:{port}"
            for path in targets:
                with pytest.raises(MediaRefused, match="a redirect of the image URL"):
                    _fetch(ImageCache(policy), [site + path])
            assert inner.connections == 0
            assert _fetch(ImageCache(policy), [f"{site}/local"]) == {f"{site}/local": b"png!"}
            with pytest.raises(MediaRefused, match="redirects more than 5 times"):
                _fetch(ImageCache(policy), [f"{site}/loop"])
            assert sum(1 for path, _ in seen if path == "/loop") == 6


def test_the_image_count_and_fetched_bytes_are_capped() -> None:
    routes = {f"/{i}.png": (200, {}, bytes(600)) for i in range(4)}
    with media_server(routes) as (port, server, _):
        urls = [f"http://127.0.0.1:{port}/{i}.png" for i in range(4)]
        policy = MediaPolicy(allow_private=True, max_images=3, max_fetch_bytes=1000)
        with pytest.raises(OpenAIError, match="at most 3 are accepted"):
            _fetch(ImageCache(policy), urls)
        with pytest.raises(OpenAIError, match="at most 3"):  # data URLs count too
            _fetch(ImageCache(policy), urls[:1], parts=4)
        assert server.connections == 0
        with pytest.raises(OpenAIError, match="more than 1000 bytes to fetch"):
            _fetch(ImageCache(policy), urls[:2])
        cache = ImageCache(policy)
        assert len(_fetch(cache, urls[:1])) == 1
        assert len(_fetch(cache, urls[:2], max_bytes=700)) == 2  # the cached one is not fetched again
        with pytest.raises(OpenAIError, match="larger than 500 bytes"):
            _fetch(ImageCache(policy), urls[3:], max_bytes=500)


def test_a_failed_fetch_says_nothing_of_the_answer() -> None:
    with media_server({"/secret": (403, {"x-internal": "db-7"}, b"internal secret: db-7 is up")}) as (port, _, _):
        for path in ("/secret", "/missing"):
            url = f"http://127.0.0.1:{port}{path}"
            with pytest.raises(OpenAIError) as err:
                _fetch(ImageCache(MediaPolicy(allow_private=True)), [url])
            assert err.value.message == f"the image at {url} could not be fetched"
        closed = free_port()  # nothing listens: a refused connection reads like any other failure
        url = f"http://127.0.0.1:{closed}/x.png"
        with pytest.raises(OpenAIError) as err:
            _fetch(ImageCache(MediaPolicy(allow_private=True)), [url])
        assert err.value.message == f"the image at {url} could not be fetched"


# -- through the frontend


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-vlm"))
    tiny = f"{REPO_ROOT}/kvroute_common/real_engines/tiny_vlm.py"
    subprocess.run([sys.executable, tiny, "--out", out, "--no-weights"], check=True, capture_output=True)
    return out


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (60, 40), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def _chat(*urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is on these screenshots?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def test_the_frontend_refuses_internal_urls_without_connecting(vlm_dir: str) -> None:
    flags = ("--model-path", vlm_dir)
    shot = _png()
    with (
        media_server({"/x.png": (200, {}, shot)}) as (port, server, _),
        mocker_url(MODEL, *flags, block_size=BS) as engine,
        frontend_client([engine], *flags) as fe,
    ):
        oai = openai.OpenAI(base_url=str(fe.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0)
        claude = anthropic.Anthropic(base_url=str(fe.base_url).rstrip("/"), api_key="none", max_retries=0)
        for host in ("127.0.0.1", "localhost", "[::1]", "0.0.0.0", "[::ffff:127.0.0.1]"):
            url = f"http://{host}:{port}/x.png"
            with pytest.raises(openai.BadRequestError) as err:
                oai.chat.completions.create(model=MODEL, messages=_chat(url), max_tokens=2)  # type: ignore[arg-type]
            assert "media fetch policy refuses" in err.value.message
            source = {"type": "url", "url": url}
            with pytest.raises(anthropic.BadRequestError) as aerr:
                claude.messages.create(
                    model=MODEL,
                    max_tokens=2,
                    messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],  # type: ignore[list-item,typeddict-item]
                )
            assert aerr.value.body["type"] == "error"  # type: ignore[index]
            assert "media fetch policy refuses" in aerr.value.body["error"]["message"]  # type: ignore[index]
        assert server.connections == 0  # neither the router nor (the request never got there) the engine


def test_the_frontend_with_the_opt_in_serves_its_media_origin_under_the_caps(vlm_dir: str) -> None:
    flags = ("--model-path", vlm_dir)
    shot = _png()
    caps = ("--mm-max-images-per-request", "2", "--mm-max-fetch-bytes-per-request", str(len(shot) + 10))
    opt_in = ("--mm-allow-private-media-hosts", "--mm-allowed-media-domains", "localhost", *caps)
    with (
        media_server({"/a.png": (200, {}, shot), "/b.png": (200, {}, shot)}) as (other_port, other, _),
        media_server(
            {
                "/x.png": (200, {}, shot),
                "/y.png": (200, {}, shot),
                "/w.png": (200, {}, shot),
                "/hop": (302, {"location": f"http://127.0.0.1:{other_port}/a.png"}, b""),
            }
        ) as (port, server, seen),
        mocker_url(MODEL, *flags, block_size=BS) as engine,
        frontend_client([engine], *flags, *opt_in) as fe,
    ):
        site = f"http://localhost:{port}"
        body = {"model": MODEL, "max_tokens": 2, "nvext": {"extra_fields": ["routing"]}}
        r = fe.post("/v1/chat/completions", json={**body, "messages": _chat(f"{site}/x.png")})
        assert r.status_code == 200, r.text
        assert ("/x.png", f"localhost:{port}") in seen  # the router's fetch (the engine fetches it too)

        # more images than the cap: refused before anything is fetched
        r = fe.post("/v1/chat/completions", json={**body, "messages": _chat(*(f"{site}/{n}" for n in "pqr"))})
        assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"]
        # a redirect to a host the allow list does not name: refused, the other server never reached
        r = fe.post("/v1/chat/completions", json={**body, "messages": _chat(f"{site}/hop")})
        assert r.status_code == 400 and "redirect" in r.json()["error"]["message"]
        # an address outside the list
        r = fe.post("/v1/chat/completions", json={**body, "messages": _chat(f"http://127.0.0.1:{other_port}/b.png")})
        assert r.status_code == 400 and "does not list" in r.json()["error"]["message"]
        assert other.connections == 0
        # two new images are more bytes than the request may fetch
        r = fe.post("/v1/chat/completions", json={**body, "messages": _chat(f"{site}/y.png", f"{site}/w.png")})
        assert r.status_code == 400 and "bytes to fetch" in r.json()["error"]["message"]
        assert "secret" not in r.text
