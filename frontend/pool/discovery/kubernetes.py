"""``--discovery kubernetes``: workers are the ready endpoints of labelled EndpointSlices.

The official ``kubernetes`` client (extra ``k8s``) is blocking, so each watch runs in a daemon
thread: list the EndpointSlices matching ``--discovery-selector`` in ``--discovery-namespace``, then
watch from the list's resourceVersion. An expired resourceVersion (410 Gone, sent as an ERROR event)
or a dropped connection relists after a bounded backoff. Every change hands the complete set of
workers to the event loop (``call_soon_threadsafe``), which makes the pool match it.

A worker is one ready endpoint whose ``targetRef`` is a Pod. The pod's annotations say how to
reach it (``kvroute.io/http-port``, ``kvroute.io/kv-events-port``, ``kvroute.io/replay-port``,
``kvroute.io/dp-size``, ``kvroute.io/model``, ``kvroute.io/worker-role``); its id is derived from the
pod's UID, so a replaced pod (new cache) is a new worker. An endpoint that is not ready, or gone,
removes the worker.

Frontend replicas find each other the same way: the ready endpoints of the EndpointSlices labelled
``kvroute.io/role=frontend`` (the headless Service ``kvroute-frontend-sync``), port named
``replica-sync`` (else the slice's first port).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from frontend.pool.discovery.base import BACKOFF_MIN, DiscoveryBackend, DiscoveryTarget, call_safely, next_backoff
from frontend.pool.workers import WorkerSpec

log = logging.getLogger("frontend.pool.discovery.kubernetes")

DEFAULT_SELECTOR = "kvroute.io/role=worker"
FRONTEND_SELECTOR = "kvroute.io/role=frontend"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
ANN = "kvroute.io/"
WATCH_TIMEOUT_SECONDS = 240  # the API server ends each watch after this; we rewatch from the last version
DEFAULT_HTTP_PORT = 8000


def default_namespace() -> str:
    """The pod's own namespace (service-account file), else ``default``."""
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            ns = f.read().strip()
            if ns:
                return ns
    except OSError:
        pass
    return "default"


def load_api_client() -> Any:
    """An ApiClient from the in-cluster service account, else from the kubeconfig (``KUBECONFIG``)."""
    try:
        from kubernetes import client, config
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise SystemExit("--discovery kubernetes needs the kubernetes client: pip install 'kvroute[k8s]'") from exc
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _int_annotation(ann: dict[str, str], name: str) -> int | None:
    raw = ann.get(ANN + name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"annotation {ANN}{name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"annotation {ANN}{name} must be > 0, got {raw!r}")
    return value


def _slice_port(slice_obj: dict[str, Any], name: str | None) -> int | None:
    ports = [p for p in slice_obj.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    for p in ports:
        if name is not None and p.get("name") == name:
            return int(p["port"])
    return int(ports[0]["port"]) if ports else None


def pod_worker_id(uid: str) -> int:
    """A stable non-negative 60-bit id from the pod UID (a new pod, a new id)."""
    digits = "".join(c for c in uid.lower() if c in "0123456789abcdef")
    if len(digits) < 8:
        raise ValueError(f"pod uid {uid!r} is not a UID")
    return int(digits[:15], 16)


def worker_spec(address: str, pod: dict[str, Any], slice_obj: dict[str, Any]) -> WorkerSpec:
    """The worker of one ready endpoint: address from the slice, the rest from the pod's annotations."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    host = _host(address)
    http_port = _int_annotation(ann, "http-port") or _slice_port(slice_obj, "http") or DEFAULT_HTTP_PORT
    raw: dict[str, Any] = {"id": pod_worker_id(meta.get("uid") or ""), "url": f"http://{host}:{http_port}"}
    events = _int_annotation(ann, "kv-events-port")
    if events:
        raw["kv_events_endpoint"] = f"tcp://{host}:{events}"
    replay = _int_annotation(ann, "replay-port")
    if replay:
        raw["replay_endpoint"] = f"tcp://{host}:{replay}"
    dp = _int_annotation(ann, "dp-size")
    if dp:
        raw["dp_size"] = dp
    if ann.get(ANN + "model"):
        raw["model"] = ann[ANN + "model"]
    role = ann.get(ANN + "worker-role")
    if role:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"annotation {ANN}worker-role must be prefill, decode or both, got {role!r}")
        raw["role"] = role
    return WorkerSpec.from_mapping(raw)


def ready_endpoints(slices: dict[str, dict[str, Any]]):
    """(slice, endpoint, address) of every ready endpoint (nil ``ready`` counts as ready, as the API says)."""
    for slice_obj in slices.values():
        if slice_obj.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        for ep in slice_obj.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False:
                continue
            addresses = ep.get("addresses") or []
            if addresses:
                yield slice_obj, ep, addresses[0]


class EndpointSliceWatch:
    """List + watch the EndpointSlices matching a selector in a daemon thread.

    ``on_slices(slices)`` runs in the thread after every change with the current
    ``{name: slice}`` (raw JSON dicts); it may make blocking API calls.
    """

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        selector: str,
        on_slices: Callable[[dict[str, dict[str, Any]]], None],
        watch_timeout: int = WATCH_TIMEOUT_SECONDS,
    ) -> None:
        from kubernetes import client

        self.api = client.DiscoveryV1Api(api_client)
        self.namespace, self.selector, self.on_slices = namespace, selector, on_slices
        self.watch_timeout = watch_timeout
        self.slices: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None
        self.relists = 0
        self.expired = 0  # watches ended by 410 Gone
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"k8s-watch {selector}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()

    def _list(self) -> None:
        # with _preload_content=False the client returns the raw urllib3 response, not the model its stubs name
        resp: Any = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=(5, 30)
        )
        doc = json.loads(resp.data)
        self.slices = {s["metadata"]["name"]: s for s in doc.get("items") or []}
        self.resource_version = (doc.get("metadata") or {}).get("resourceVersion")
        self.relists += 1

    def _watch_once(self) -> None:
        from kubernetes import watch

        self._watch = w = watch.Watch()
        stream = w.stream(
            self.api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=self.selector,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _request_timeout=(5, self.watch_timeout + 30),
        )
        for event in stream:  # an ERROR event (410 Gone) is raised by the client as ApiException
            if self._stop.is_set():
                return
            kind = event.get("type")
            obj = event.get("raw_object") or {}  # the JSON as sent: the same shape the list gives
            meta = obj.get("metadata") or {}
            if meta.get("resourceVersion"):
                self.resource_version = meta["resourceVersion"]
            if kind == "BOOKMARK":
                continue
            name = meta.get("name")
            if not name:
                continue
            if kind in ("ADDED", "MODIFIED"):
                self.slices[name] = obj
            elif kind == "DELETED":
                self.slices.pop(name, None)
            else:
                continue
            self.on_slices(self.slices)

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        delay = BACKOFF_MIN
        while not self._stop.is_set():
            try:
                self._list()
                self.on_slices(self.slices)
                self.last_error = None
                delay = BACKOFF_MIN
                while not self._stop.is_set():
                    self._watch_once()  # returns when the server ends the watch: rewatch from the last version
            except ApiException as exc:
                self.last_error = f"{exc.status} {exc.reason}"
                if exc.status == 410:
                    self.expired += 1
                    log.info("watch of %s expired (410 Gone): relisting", self.selector)
                    delay = BACKOFF_MIN
                else:
                    log.warning("watch of %s failed: %s (relisting in %.1fs)", self.selector, self.last_error, delay)
            except Exception as exc:  # dropped connection, timeouts, bad JSON: relist
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("watch of %s broke: %s (relisting in %.1fs)", self.selector, self.last_error, delay)
            if self._stop.wait(delay):
                return
            delay = next_backoff(delay)


class KubernetesDiscovery(DiscoveryBackend):
    name = "kubernetes"
    source = "kubernetes"

    def __init__(
        self,
        namespace: str | None = None,
        selector: str = DEFAULT_SELECTOR,
        peer_endpoint: str | None = None,
        peer_selector: str = FRONTEND_SELECTOR,
    ) -> None:
        self.namespace = namespace or default_namespace()
        self.selector = selector
        self.peer_endpoint = peer_endpoint
        self.peer_selector = peer_selector
        self.own_pod = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME")
        self.workers: EndpointSliceWatch | None = None
        self.peers: EndpointSliceWatch | None = None
        self._pods: dict[str, dict[str, Any]] = {}  # pod name -> pod JSON (annotations), refreshed when its uid changes
        self._api_client: Any = None

    def prepare(self) -> None:
        try:
            self._api_client = load_api_client()
        except Exception as exc:  # no service account, no kubeconfig
            raise ValueError(f"--discovery kubernetes: cannot load cluster credentials: {exc}") from None

    async def start(self, target: DiscoveryTarget) -> None:
        from kubernetes import client

        api_client = self._api_client if self._api_client is not None else await asyncio.to_thread(load_api_client)
        self._core = client.CoreV1Api(api_client)
        loop = asyncio.get_running_loop()

        def on_workers(slices: dict[str, dict[str, Any]]) -> None:
            specs = self._worker_specs(slices)
            loop.call_soon_threadsafe(call_safely, lambda: target.set_workers(self.source, specs), "kubernetes workers")

        self.workers = EndpointSliceWatch(api_client, self.namespace, self.selector, on_workers)
        self.workers.start()
        if self.peer_endpoint and target.replica_sync is not None:

            def on_peers(slices: dict[str, dict[str, Any]]) -> None:
                peers = self._peer_endpoints(slices)
                loop.call_soon_threadsafe(call_safely, lambda: target.set_peers(self.source, peers), "kubernetes peers")

            self.peers = EndpointSliceWatch(api_client, self.namespace, self.peer_selector, on_peers)
            self.peers.start()

    async def stop(self) -> None:
        for w in (self.workers, self.peers):
            if w is not None:
                w.stop()

    # ---- runs in the watch thread ----------------------------------------------------------------
    def _pod(self, name: str, namespace: str, uid: str | None) -> dict[str, Any] | None:
        cached = self._pods.get(name)
        if cached is not None and (uid is None or (cached.get("metadata") or {}).get("uid") == uid):
            return cached
        from kubernetes.client.exceptions import ApiException

        try:
            resp: Any = self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=(5, 30)
            )
        except ApiException as exc:
            if exc.status == 404:  # gone between the slice update and now: the next update drops it
                return None
            raise
        pod = json.loads(resp.data)
        self._pods[name] = pod
        return pod

    def _worker_specs(self, slices: dict[str, dict[str, Any]]) -> list[WorkerSpec]:
        specs: dict[int, WorkerSpec] = {}
        seen: set[str] = set()
        for slice_obj, ep, address in ready_endpoints(slices):
            ref = ep.get("targetRef") or {}
            if ref.get("kind") != "Pod" or not ref.get("name"):
                continue
            seen.add(ref["name"])
            pod = self._pod(ref["name"], ref.get("namespace") or self.namespace, ref.get("uid"))
            if pod is None:
                continue
            try:
                spec = worker_spec(address, pod, slice_obj)
            except ValueError as exc:
                log.warning("pod %s is not a usable worker: %s", ref["name"], exc)
                continue
            specs[spec.id] = spec
        for name in [n for n in self._pods if n not in seen]:  # forget pods no longer listed
            del self._pods[name]
        return list(specs.values())

    def _peer_endpoints(self, slices: dict[str, dict[str, Any]]) -> list[str]:
        out = []
        for slice_obj, ep, address in ready_endpoints(slices):
            ref = ep.get("targetRef") or {}
            if self.own_pod and ref.get("name") == self.own_pod:
                continue
            port = _slice_port(slice_obj, "replica-sync")
            if port is None:
                continue
            endpoint = f"tcp://{_host(address)}:{port}"
            if endpoint != self.peer_endpoint:
                out.append(endpoint)
        return out

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "namespace": self.namespace, "selector": self.selector}
        if self.workers is not None:
            out["watch"] = {
                "slices": len(self.workers.slices),
                "resource_version": self.workers.resource_version,
                "relists": self.workers.relists,
                "expired": self.workers.expired,
                "last_error": self.workers.last_error,
            }
        if self.peers is not None:
            out["peer_selector"] = self.peer_selector
        return out
