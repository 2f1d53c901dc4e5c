"""A small fake of the Kubernetes API server for discovery tests: a real HTTP server (Starlette +
uvicorn, in a thread of the test process) on 127.0.0.1.

It serves what ``--discovery kubernetes`` uses: list and streaming watch of discovery.k8s.io/v1
EndpointSlices (label selectors ``k=v[,k=v]``, resourceVersion, history replay, ERROR 410 for an
expired version) and GET of core/v1 pods. Tests drive it through ``/fake/*`` routes: set or delete
slices and pods (optionally *silently*, with no watch event, so only a relist can see the change),
expire every watch (410 Gone) or drop every watch connection mid-stream.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from support import free_port, wait_until

_DROP = object()
_EXPIRE = object()


class WatchDropped(Exception):
    """Raised inside a watch stream: uvicorn aborts the connection mid-body (no final chunk)."""


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    def __init__(self) -> None:
        self.rv = 100
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, slice) of every announced change
        self.compacted = 0  # watches from a version below this get 410 Gone
        self.watchers: set[asyncio.Queue] = set()
        self.stats = {"lists": 0, "watches": 0, "pod_gets": 0}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # ---- the API ------------------------------------------------------------------------------
    async def endpointslices(self, request: Request) -> Response:
        ns = request.path_params["ns"]
        q = request.query_params
        selector = q.get("labelSelector")
        if q.get("watch") in ("true", "1", "True"):
            return self._watch(
                ns, selector, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds") or 0) or None
            )
        self.stats["lists"] += 1
        items = [copy.deepcopy(s) for (sns, _), s in sorted(self.slices.items()) if sns == ns and _matches(s, selector)]
        return JSONResponse(
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        )

    def _watch(self, ns: str, selector: str | None, since: int, timeout: float | None) -> Response:
        self.stats["watches"] += 1
        queue: asyncio.Queue = asyncio.Queue()
        expired = since < self.compacted
        backlog = [] if expired else [(t, s) for rv, t, s in self.history if rv > since]
        self.watchers.add(queue)

        def line(kind: str, obj: dict[str, Any]) -> bytes:
            return (json.dumps({"type": kind, "object": obj}) + "\n").encode()

        gone = line("ERROR", _status(410, "Expired", f"too old resource version: {since} ({self.compacted})"))

        async def stream():
            try:
                if expired:
                    yield gone
                    return
                for kind, obj in backlog:
                    if (obj["metadata"].get("namespace") == ns) and _matches(obj, selector):
                        yield line(kind, obj)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout if timeout else None
                while True:
                    remaining = None if deadline is None else deadline - loop.time()
                    if remaining is not None and remaining <= 0:
                        return  # the server ends the watch; the client rewatches from its last version
                    try:
                        item = await asyncio.wait_for(queue.get(), remaining)
                    except TimeoutError:
                        return
                    if item is _DROP:
                        raise WatchDropped("connection dropped by the fake API server")
                    if item is _EXPIRE:
                        yield gone
                        return
                    kind, obj = item
                    if obj["metadata"].get("namespace") == ns and _matches(obj, selector):
                        yield line(kind, obj)
            finally:
                self.watchers.discard(queue)

        return StreamingResponse(stream(), media_type="application/json")

    async def pod(self, request: Request) -> Response:
        self.stats["pod_gets"] += 1
        key = (request.path_params["ns"], request.path_params["name"])
        pod = self.pods.get(key)
        if pod is None:
            return JSONResponse(_status(404, "NotFound", f'pods "{key[1]}" not found'), status_code=404)
        return JSONResponse(pod)

    # ---- test controls ------------------------------------------------------------------------
    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        return obj

    def _announce(self, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.rv, kind, obj))
        for q in list(self.watchers):
            q.put_nowait((kind, obj))

    async def put_slice(self, request: Request) -> Response:
        body = await request.json()
        ns = body.setdefault("metadata", {}).setdefault("namespace", "default")
        key = (ns, request.path_params["name"])
        body["metadata"]["name"] = key[1]
        kind = "MODIFIED" if key in self.slices else "ADDED"
        obj = self.slices[key] = self._bump(body)
        if request.query_params.get("silent") != "1":
            self._announce(kind, obj)
        return JSONResponse(obj)

    async def delete_slice(self, request: Request) -> Response:
        key = (request.query_params.get("namespace", "default"), request.path_params["name"])
        obj = self.slices.pop(key, None)
        if obj is None:
            return JSONResponse(_status(404, "NotFound", "no such slice"), status_code=404)
        obj = self._bump(obj)
        if request.query_params.get("silent") != "1":
            self._announce("DELETED", obj)
        return JSONResponse(obj)

    async def put_pod(self, request: Request) -> Response:
        body = await request.json()
        ns = body.setdefault("metadata", {}).setdefault("namespace", "default")
        body["metadata"]["name"] = request.path_params["name"]
        self.pods[(ns, request.path_params["name"])] = self._bump(body)
        return JSONResponse(body)

    async def expire(self, request: Request) -> Response:
        """Compact history: every open watch gets ERROR 410 and ends; older versions are refused."""
        self.compacted = self.rv  # a list at the current version can still be watched from
        self.history.clear()
        for q in list(self.watchers):
            q.put_nowait(_EXPIRE)
        return JSONResponse({"compacted": self.compacted, "watchers": len(self.watchers)})

    async def drop(self, request: Request) -> Response:
        n = len(self.watchers)
        for q in list(self.watchers):
            q.put_nowait(_DROP)
        return JSONResponse({"dropped": n})

    async def get_stats(self, request: Request) -> Response:
        return JSONResponse({**self.stats, "open_watches": len(self.watchers), "rv": self.rv})

    # ---- server -------------------------------------------------------------------------------
    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self.endpointslices, methods=["GET"]),
                Route("/api/v1/namespaces/{ns}/pods/{name}", self.pod, methods=["GET"]),
                Route("/fake/endpointslices/{name}", self.put_slice, methods=["PUT"]),
                Route("/fake/endpointslices/{name}", self.delete_slice, methods=["DELETE"]),
                Route("/fake/pods/{name}", self.put_pod, methods=["PUT"]),
                Route("/fake/expire", self.expire, methods=["POST"]),
                Route("/fake/drop", self.drop, methods=["POST"]),
                Route("/fake/stats", self.get_stats, methods=["GET"]),
            ]
        )

    def start(self) -> None:
        config = uvicorn.Config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            log_level="critical",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fake-k8s-api", daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, 30.0, what="the fake Kubernetes API server")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)

    def kubeconfig(self, path: str, namespace: str = "default") -> str:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": "test-token"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                    ],
                },
                f,
            )
        return path
