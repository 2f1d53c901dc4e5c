"""Remote images of a chat request, fetched once, bounded in size and time, before it is tokenized.

The router needs an image's bytes to key it as the engine does (kvroute_common.multimodal); a data URL
carries them, an http(s) URL is fetched here on the event loop (I/O, no CPU worth a thread). Agents send
the same screenshot turn after turn, so fetched images stay in a small cache by URL (bounded in bytes).
A URL that cannot be fetched, or whose image is too large, is the client's error: 400.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

import httpx

from frontend.request.errors import OpenAIError
from kvroute_common.multimodal import ImageOptions

CACHE_BYTES = 64 * 1024 * 1024


class ImageCache:
    """Fetched image bytes by URL, least recently used first out, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._client: httpx.AsyncClient | None = None
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

    async def fetch_all(self, urls: Iterable[str], options: ImageOptions) -> dict[str, bytes]:
        """Every URL's bytes (cached or fetched concurrently); raises a 400 OpenAIError naming the first
        that fails."""
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
            fetched = await asyncio.gather(*(self._fetch(url, options) for url in missing))
            for url, data in zip(missing, fetched, strict=True):
                self._put(url, data)
                out[url] = data
        return out

    async def _fetch(self, url: str, options: ImageOptions) -> bytes:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=True)
        self.fetches += 1
        limit = options.max_bytes
        try:
            async with asyncio.timeout(options.fetch_timeout):
                async with self._client.stream("GET", url, timeout=options.fetch_timeout) as resp:
                    if resp.status_code != 200:
                        raise OpenAIError(400, f"the image at {url} could not be fetched: HTTP {resp.status_code}")
                    declared = resp.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > limit:
                        raise OpenAIError(400, f"the image at {url} is larger than {limit} bytes")
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in resp.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise OpenAIError(400, f"the image at {url} is larger than {limit} bytes")
                        chunks.append(chunk)
        except TimeoutError:
            raise OpenAIError(400, f"the image at {url} could not be fetched in {options.fetch_timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise OpenAIError(400, f"the image at {url} could not be fetched: {exc}") from None
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
