"""A minimal etcd v3 client over the JSON gateway (``/v3/...``) with httpx.

Only what discovery needs: leases (grant, keep-alive, revoke), put / delete, prefix range and a
prefix watch. Keys and values travel base64-encoded; 64-bit integers as JSON strings. Several
endpoints may be given: a request that cannot connect moves on to the next one.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class EtcdError(Exception):
    """etcd answered with an error, or none of the endpoints could be reached."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: relist."""


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: str) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # the whole keyspace


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes
    revision: int


def parse_endpoints(text: str | Sequence[str]) -> list[str]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        item = item.strip().rstrip("/")
        if not item:
            continue
        if "://" not in item:
            item = "http://" + item
        if not item.startswith(("http://", "https://")):
            raise ValueError(f"etcd endpoint must be an http(s) URL, got {item!r}")
        out.append(item)
    if not out:
        raise ValueError("no etcd endpoint given (--etcd-endpoints http://host:2379[,...])")
    return out


class EtcdClient:
    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0) -> None:
        self.endpoints = list(endpoints)
        self._current = 0
        self.timeout = timeout
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            idx = (self._current + i) % len(self.endpoints)
            url = self.endpoints[idx] + path
            try:
                resp = await self._http.post(url, json=body, timeout=timeout or self.timeout)
            except httpx.TransportError as exc:
                last = exc
                continue
            self._current = idx
            data = _json(resp.text)
            if resp.status_code != 200 or "error" in data:
                raise EtcdError(
                    f"etcd {path}: {resp.status_code} {data.get('message') or data.get('error') or resp.text[:200]}"
                )
            return data.get("result", data)
        raise EtcdError(f"no etcd endpoint reachable ({', '.join(self.endpoints)}): {last!r}")

    # ---- leases ------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        data = await self._post("/v3/lease/grant", {"TTL": str(ttl)})
        if data.get("error"):
            raise EtcdError(f"lease grant: {data['error']}")
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its remaining TTL, 0 when it no longer exists."""
        data = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("TTL") or 0)

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)}, timeout=2.0)

    # ---- keys --------------------------------------------------------------------------------
    async def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self._post("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)})

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """(store revision, {key: value}) of every key under ``prefix``."""
        data = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))})
        revision = int(data.get("header", {}).get("revision", 0))
        kvs = {_unb64(kv.get("key")).decode(): _unb64(kv.get("value")) for kv in data.get("kvs") or []}
        return revision, kvs

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` on, until the stream breaks (then raise).

        Ends (returns) only if the server closes the stream cleanly; the caller relists either way.
        """
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_range_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        timeout = httpx.Timeout(self.timeout, read=None)  # a quiet prefix sends nothing for a long time
        async with self._http.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise EtcdError(f"etcd watch: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                msg = _json(line)
                if "error" in msg:
                    raise EtcdError(f"etcd watch: {msg['error']}")
                result = msg.get("result", {})
                if int(result.get("compact_revision") or 0) > 0:
                    raise WatchCompacted(f"revision {start_revision} compacted (now {result['compact_revision']})")
                if result.get("canceled"):
                    raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
                for ev in result.get("events") or []:
                    kv = ev.get("kv") or {}
                    yield WatchEvent(
                        "delete" if ev.get("type") == "DELETE" else "put",
                        _unb64(kv.get("key")).decode(),
                        _unb64(kv.get("value")),
                        int(kv.get("mod_revision") or 0),
                    )


def _json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        return {"error": text[:200]}
    return data if isinstance(data, dict) else {"error": text[:200]}
