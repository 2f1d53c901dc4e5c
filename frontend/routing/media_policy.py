"""Which image URLs the router may fetch, checked on the URL, on every address its host resolves to, and on the
address a connection is actually made to.

A client names the URL, so without a policy the router fetches whatever the client points it at: its own
loopback services, the cloud metadata endpoint, the private network. The default refuses every address that
is not globally routable (IPv4 and IPv6, including IPv4 addresses carried inside IPv6 forms);
``--mm-allow-private-media-hosts`` opens loopback, private (RFC 1918, fc00::/7) and shared (100.64.0.0/10)
addresses for an internal media origin, never link-local, metadata, multicast, unspecified or reserved ones.
``--mm-allowed-media-domains`` restricts fetching further to listed hosts and their subdomains.

The check on connect happens inside the HTTP client's network backend (``VettedNetwork``): the host is
resolved there, every answer vetted, and the connection made to a vetted address itself, so there is no second
lookup between the check and the connection (no DNS-rebinding gap). TLS keeps the URL's host name for SNI and
certificate checks, and the Host header is the URL's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import Any

import httpcore
import httpx

from frontend.request.errors import OpenAIError

log = logging.getLogger("frontend.media_policy")

DEFAULT_MAX_IMAGES = 64
DEFAULT_MAX_FETCH_BYTES = 64 * 1024 * 1024
MAX_REDIRECTS = 5

IpAddress = IPv4Address | IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Instance metadata services (AWS IMDS v4 and v6, ECS task metadata, EKS pod identity, Alibaba Cloud): refused
# even where their range is opened by --mm-allow-private-media-hosts.
METADATA_ADDRESSES = frozenset(
    ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "169.254.170.23", "fd00:ec2::254", "fd00:ec2::23", "100.100.100.200")
)
_SHARED = IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_RFC1918 = (IPv4Network("10.0.0.0/8"), IPv4Network("172.16.0.0/12"), IPv4Network("192.168.0.0/16"))
_UNIQUE_LOCAL = IPv6Network("fc00::/7")
_NAT64 = IPv6Network("64:ff9b::/96")
_BROADCAST = IPv4Address("255.255.255.255")
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")

# what each kind of address is called in refusals and logs; None = globally routable
METADATA, UNSPECIFIED, LOOPBACK, LINK_LOCAL = "cloud metadata", "unspecified", "loopback", "link-local"
MULTICAST, BROADCAST, PRIVATE, SHARED, RESERVED = "multicast", "broadcast", "private", "shared (CGNAT)", "reserved"
OPENED_BY_ALLOW_PRIVATE = frozenset({LOOPBACK, PRIVATE, SHARED})


class MediaRefused(OpenAIError):
    """A URL the policy refuses: a 400 that says why in the policy's terms, never what a target answered."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def embedded_ipv4(ip: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address stands for: IPv4-mapped (::ffff:a.b.c.d), IPv4-translated
    (::ffff:0:a.b.c.d), IPv4-compatible (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d) and 6to4 (2002:AABB:CCDD::)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    n = int(ip)
    if n >> 32 == 0 and n > 1:  # :: and ::1 are IPv6's own unspecified and loopback addresses
        return IPv4Address(n)
    if n >> 32 == 0xFFFF0000 or ip in _NAT64:
        return IPv4Address(n & 0xFFFFFFFF)
    return ip.sixtofour


def address_kind(ip: IpAddress) -> str | None:
    """What kind of non-public address ``ip`` is (one of the kinds above), or None for a global one."""
    if isinstance(ip, IPv6Address) and ip.scope_id:
        ip = IPv6Address(ip.compressed.split("%", 1)[0])
    if ip in METADATA_ADDRESSES:
        return METADATA
    if isinstance(ip, IPv6Address):
        inner = embedded_ipv4(ip)
        if inner is not None:
            return address_kind(inner)
    if ip.is_unspecified:
        return UNSPECIFIED
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_link_local:
        return LINK_LOCAL
    if ip.is_multicast:
        return MULTICAST
    if ip == _BROADCAST:
        return BROADCAST
    if isinstance(ip, IPv4Address):
        if ip in _SHARED:
            return SHARED
        if any(ip in net for net in _RFC1918):
            return PRIVATE
    elif ip in _UNIQUE_LOCAL:
        return PRIVATE
    if not ip.is_global:
        return RESERVED  # documentation, benchmarking, 240/4, IETF protocol assignments, ...
    return None


def parse_address(text: str) -> IpAddress | None:
    try:
        return ip_address(text)
    except ValueError:
        return None


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _ascii_host(name: str) -> str:
    """A host name as the URL parser spells it (lower case, IDNA), without a trailing dot."""
    name = name.strip().lower().rstrip(".")
    literal = parse_address(name.strip("[]"))
    if literal is not None:
        return literal.compressed
    try:
        ascii_name = httpx.URL(f"http://{name}/").raw_host.decode("ascii").rstrip(".")
    except (httpx.InvalidURL, UnicodeError):
        ascii_name = ""
    if any(c in name for c in "/?#@:") or not _HOST_NAME.fullmatch(ascii_name):
        raise ValueError(f"--mm-allowed-media-domains: {name!r} is not a host name")
    return ascii_name


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """The media fetch policy (flags). ``allowed_domains`` empty = any host whose addresses pass;
    ``example.com`` allows it and every subdomain, ``.example.com`` (or ``*.example.com``) only subdomains,
    an IP address only itself."""

    allowed_domains: tuple[str, ...] = ()
    allow_private: bool = False
    max_images: int = DEFAULT_MAX_IMAGES
    max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES
    max_redirects: int = MAX_REDIRECTS

    @classmethod
    def from_flags(
        cls,
        domains: Iterable[str],
        allow_private: bool,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES,
    ) -> MediaPolicy:
        """From the flags' values; raises ValueError on an entry that is not a host name or on a bad bound."""
        entries = []
        for raw in domains:
            raw = raw.strip()
            if not raw:
                continue
            subdomains_only = raw.startswith(("*.", "."))
            name = _ascii_host(raw.lstrip("*").lstrip("."))
            entries.append("." + name if subdomains_only else name)
        if max_images < 1:
            raise ValueError("--mm-max-images-per-request must be >= 1")
        if max_fetch_bytes < 1:
            raise ValueError("--mm-max-fetch-bytes-per-request must be >= 1")
        return cls(tuple(entries), allow_private, max_images, max_fetch_bytes)

    def host_listed(self, host: str) -> bool:
        """Whether ``host`` (as the URL parser spells it) is one the allow list names (True without a list)."""
        if not self.allowed_domains:
            return True
        host = host.rstrip(".")
        for entry in self.allowed_domains:
            if entry.startswith("."):
                if host.endswith(entry):
                    return True
            elif host == entry or host.endswith("." + entry):
                return True
        return False

    def address_refusal(self, ip: IpAddress) -> str | None:
        """Why a connection to ``ip`` is refused (its kind), or None if it is allowed."""
        kind = address_kind(ip)
        if kind is None or (self.allow_private and kind in OPENED_BY_ALLOW_PRIVATE):
            return None
        return kind

    def check_url(self, url: str | httpx.URL, what: str = "the image URL") -> httpx.URL:
        """The parsed URL if the policy lets the router try it: http(s), a host the allow list names, and not an
        IP address the policy refuses. A host name's addresses are checked when it is connected to."""
        try:
            parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        except (httpx.InvalidURL, TypeError):
            raise MediaRefused(f"{what} is not a valid URL") from None
        if parsed.scheme not in ("http", "https"):
            raise MediaRefused(f"{what} must be http or https")
        host = parsed.raw_host.decode("ascii", "replace")
        if not host:
            raise MediaRefused(f"{what} has no host")
        if not self.host_listed(host):
            log.info("media fetch refused: %s is not in --mm-allowed-media-domains", host)
            raise MediaRefused(f"{what} names a host that --mm-allowed-media-domains does not list")
        ip = parse_address(host)
        if ip is not None:
            kind = self.address_refusal(ip)
            if kind is not None:
                log.info("media fetch refused: %s is a %s address", host, kind)
                raise MediaRefused(f"{what} names an address the media fetch policy refuses ({kind})")
        return parsed

    async def vetted_addresses(self, host: str, port: int, resolver: Resolver = system_resolver) -> list[str]:
        """The addresses to connect to for ``host``: every one it resolves to must pass, or none is used
        (an answer mixing public and internal addresses is refused)."""
        ip = parse_address(host)
        if ip is not None:
            answers = [host]
        else:
            try:
                answers = await resolver(host, port)
            except OSError:
                raise MediaRefused("the image URL's host could not be resolved") from None
        if not answers:
            raise MediaRefused("the image URL's host could not be resolved")
        for answer in answers:
            addr = parse_address(answer)
            kind = "unparsable" if addr is None else self.address_refusal(addr)
            if kind is not None:
                log.info("media fetch refused: %s resolves to %s, a %s address", host, answer, kind)
                raise MediaRefused(
                    f"the image URL's host resolves to an address the media fetch policy refuses ({kind})"
                )
        return answers


class VettedNetwork(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the policy on every connection: the host is resolved here, each address
    vetted, and the socket connected to a vetted address (TLS is started afterwards with the URL's host name)."""

    def __init__(self, policy: MediaPolicy, resolver: Resolver = system_resolver) -> None:
        self.policy = policy
        self.resolver = resolver
        self._inner = httpcore.AnyIOBackend()
        self.connections = 0  # connections made (tests assert none reached a refused target)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self.policy.vetted_addresses(host, port, self.resolver)
        error: Exception | None = None
        for address in addresses:
            try:
                stream = await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            self.connections += 1
            return stream
        assert error is not None
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise MediaRefused("the media fetch policy connects to TCP hosts only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
