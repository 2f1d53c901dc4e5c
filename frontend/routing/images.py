"""Remote images of a chat request, fetched once under the media fetch policy, bounded in number, size and time,
before it is tokenized.

The router needs an image's bytes to key it as the engine does (kvroute_common.multimodal); a data URL
carries them, an http(s) URL is fetched here on the event loop (I/O, no CPU worth a thread). Agents send
the same screenshot turn after turn, so fetched images stay in a small cache by URL (bounded in bytes).

Every URL, and every redirect's target, is checked by the policy (``frontend.routing.media_policy``) before it
is requested, and every connection is made to an address the policy vetted. Redirects are followed here, a
bounded number of hops. A request naming more images than the cap is refused before anything is fetched; the
bytes one request may fetch are capped across its images. Whatever goes wrong, the client gets a 400 that names
its URL and the router's limit or policy, never what the target answered (its status, headers or body: those
would let a client probe what the router can reach); the log has the detail.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import OrderedDict
from collections.abc import Sequence

import httpcore
import httpx

from frontend.request.errors import OpenAIError
from frontend.routing.media_policy import MediaPolicy, MediaRefused, Resolver, VettedNetwork, system_resolver
from kvroute_common.multimodal import ImageOptions

log = logging.getLogger("frontend.images")

CACHE_BYTES = 64 * 1024 * 1024
REDIRECTS = frozenset({301, 302, 303, 307, 308})
POOL_CONNECTIONS = 32
_FETCH_ERRORS = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.TimeoutException,
    httpcore.UnsupportedProtocol,
    httpx.InvalidURL,
    OSError,
)


class _Budget:
    """Bytes one request may still fetch, shared by its concurrent fetches."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.left = self.limit = limit

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise OpenAIError(
                400,
                f"the request's images are more than {self.limit} bytes to fetch (--mm-max-fetch-bytes-per-request)",
            )


class ImageCache:
    """Fetched image bytes by URL, least recently used first out, at most ``max_bytes`` in all; fetches go
    through ``policy`` (``resolver`` and ``ssl_context`` are the system's unless given)."""

    def __init__(
        self,
        policy: MediaPolicy | None = None,
        max_bytes: int = CACHE_BYTES,
        resolver: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.policy = policy or MediaPolicy()
        self.max_bytes = max_bytes
        self.network = VettedNetwork(self.policy, resolver)
        self._ssl_context = ssl_context
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._pool: httpcore.AsyncConnectionPool | None = None
        self.fetches = 0

    def _put(self, url: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        old = self._items.pop(url, None)
        if old is not None:
            self._size -= len(old)
        self._items[url] = data
        self._size += len(data)
        while self._size > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._size -= len(dropped)

    def check_count(self, image_parts: int) -> None:
        """Refuses a request with more image parts than the policy's cap (before anything is fetched)."""
        if image_parts > self.policy.max_images:
            raise OpenAIError(
                400,
                f"the request has {image_parts} images; at most {self.policy.max_images} are accepted "
                "(--mm-max-images-per-request)",
            )

    async def fetch_all(self, urls: Sequence[str], options: ImageOptions, image_parts: int = 0) -> dict[str, bytes]:
        """Every URL's bytes (cached, or fetched concurrently under one byte budget). The image count and every
        URL are checked before anything is fetched; the first failure is a 400 OpenAIError and stops the rest."""
        self.check_count(max(image_parts, len(urls)))
        for url in urls:
            self.policy.check_url(url)
        out: dict[str, bytes] = {}
        missing = []
        for url in urls:
            data = self._items.get(url)
            if data is None:
                missing.append(url)
            else:
                self._items.move_to_end(url)
                out[url] = data
        if missing:
            budget = _Budget(self.policy.max_fetch_bytes)
            tasks = [asyncio.ensure_future(self._fetch(url, options, budget)) for url in missing]
            try:
                fetched = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            for url, data in zip(missing, fetched, strict=True):
                self._put(url, data)
                out[url] = data
        return out

    def _client(self) -> httpcore.AsyncConnectionPool:
        if self._pool is None:
            self._pool = httpcore.AsyncConnectionPool(
                ssl_context=self._ssl_context or httpx.create_ssl_context(),
                max_connections=POOL_CONNECTIONS,
                keepalive_expiry=30.0,
                network_backend=self.network,
            )
        return self._pool

    async def _fetch(self, url: str, options: ImageOptions, budget: _Budget) -> bytes:
        self.fetches += 1
        try:
            async with asyncio.timeout(options.fetch_timeout):
                return await self._follow(url, options, budget)
        except TimeoutError:
            log.info("image fetch of %s timed out after %g s", url, options.fetch_timeout)
            raise OpenAIError(400, f"the image at {url} could not be fetched in {options.fetch_timeout:g} s") from None
        except _FETCH_ERRORS as exc:
            log.info("image fetch of %s failed: %r", url, exc)
            raise OpenAIError(400, f"the image at {url} could not be fetched") from None

    async def _follow(self, url: str, options: ImageOptions, budget: _Budget) -> bytes:
        target = self.policy.check_url(url)
        limit = options.max_bytes
        t = options.fetch_timeout
        timeouts = {"connect": t, "read": t, "write": t, "pool": t}
        for _hop in range(self.policy.max_redirects + 1):
            request = httpcore.Request(
                "GET",
                httpcore.URL(scheme=target.raw_scheme, host=target.raw_host, port=target.port, target=target.raw_path),
                headers=[(b"Host", target.netloc), (b"Accept", b"image/*"), (b"User-Agent", b"kvroute")],
                extensions={"timeout": timeouts},
            )
            response = await self._client().handle_async_request(request)
            try:
                status = response.status
                if status in REDIRECTS:
                    location = _header(response.headers, b"location")
                    if location is None:
                        log.info("image fetch of %s: redirect %s without a location", url, status)
                        raise OpenAIError(400, f"the image at {url} could not be fetched")
                    target = self.policy.check_url(target.join(location), "a redirect of the image URL")
                    continue
                if status != 200:
                    log.info("image fetch of %s: HTTP %s from %s", url, status, target)
                    raise OpenAIError(400, f"the image at {url} could not be fetched")
                declared = _header(response.headers, b"content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise OpenAIError(400, f"the image at {url} is larger than {limit} bytes")
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_stream():
                    size += len(chunk)
                    if size > limit:
                        raise OpenAIError(400, f"the image at {url} is larger than {limit} bytes")
                    budget.take(len(chunk))
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                await response.aclose()
        log.info("image fetch of %s: more than %d redirects", url, self.policy.max_redirects)
        raise MediaRefused(f"the image URL {url} redirects more than {self.policy.max_redirects} times")

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None
