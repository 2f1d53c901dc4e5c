"""Kubernetes discovery end to end: a real frontend process (``--discovery kubernetes``, kubeconfig
pointing at a fake API server in this test) in front of real mockers. The fake's EndpointSlices
say which pods are ready; the frontend gains and loses workers as they change, relists after a 410
Gone and after a dropped watch connection, and finds its replica peers through the frontend slice.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import httpx
import pytest
from test_frontend_e2e import (
    Frontend,
    Mocker,
    start_frontend,
    start_mockers,
    stream_until_first_chunk,
    unique_prompt,
    wait_ready,
)

from fake_k8s_api import FakeKubeApi
from support import free_ports, wait_until

if not os.environ.get("CI"):  # CI installs the test extra: a missing client must fail there, not skip
    pytest.importorskip("kubernetes")

NS = "kvtest"
WAIT = 60.0


@pytest.fixture
def api(tmp_path) -> Iterator[tuple[FakeKubeApi, str]]:
    fake = FakeKubeApi()
    fake.start()
    try:
        yield fake, fake.kubeconfig(str(tmp_path / "kubeconfig"), NS)
    finally:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(fake.url + "/fake/drop", timeout=5)
        fake.stop()


class Cluster:
    """Test-side view of the fake: pods backed by mockers, and the slices listing them."""

    def __init__(self, fake: FakeKubeApi) -> None:
        self.fake = fake
        self.http = httpx.Client(base_url=fake.url, timeout=10.0)
        self.uids: dict[str, str] = {}

    def pod(self, name: str, m: Mocker, model: str | None = None) -> None:
        uid = self.uids[name] = str(uuid.uuid4())
        ann = {
            "kvroute.io/http-port": str(m.port),
            "kvroute.io/kv-events-port": str(m.events),
            "kvroute.io/replay-port": str(m.replay),
            "kvroute.io/dp-size": "1",
        }
        if model:
            ann["kvroute.io/model"] = model
        r = self.http.put(f"/fake/pods/{name}", json={"metadata": {"namespace": NS, "uid": uid, "annotations": ann}})
        assert r.status_code == 200

    def slice(
        self,
        name: str,
        ready: dict[str, bool],
        labels: dict[str, str] | None = None,
        silent: bool = False,
        address: str = "127.0.0.1",
        ports: list[dict] | None = None,
        addresses: dict[str, str] | None = None,
    ) -> None:
        endpoints = [
            {
                "addresses": [(addresses or {}).get(pod, address)],
                "conditions": {"ready": ok},
                "targetRef": {"kind": "Pod", "namespace": NS, "name": pod, "uid": self.uids.get(pod, "")},
            }
            for pod, ok in ready.items()
        ]
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "addressType": "IPv4",
            "metadata": {
                "namespace": NS,
                "labels": labels or {"kvroute.io/role": "worker", "kubernetes.io/service-name": "workers"},
            },
            "endpoints": endpoints,
            "ports": ports or [{"name": "http", "port": 80, "protocol": "TCP"}],
        }
        r = self.http.put(f"/fake/endpointslices/{name}", params={"silent": "1"} if silent else None, json=body)
        assert r.status_code == 200

    def stats(self) -> dict:
        return self.http.get("/fake/stats").json()


def worker_urls(fe: Frontend, healthy: bool = True) -> set[str]:
    return {w["url"] for w in fe.http.get("/admin/workers").json()["workers"] if w["healthy"] or not healthy}


def test_workers_follow_endpointslices_through_relists(api, monkeypatch) -> None:
    fake, kubeconfig = api
    k = Cluster(fake)
    with contextlib.ExitStack() as stack:
        ms = start_mockers(3, stack)
        for i, m in enumerate(ms):
            k.pod(f"worker-{i}", m, model="kvroute-demo" if i == 1 else None)
        k.slice("workers-a", {"worker-0": True})
        # a slice of another Service (other labels) is not ours
        k.slice("other", {"worker-2": True}, labels={"kvroute.io/role": "something-else"})
        fe = start_frontend(
            ["--router-mode", "kv", "--discovery", "kubernetes", "--discovery-namespace", NS],
            stack,
            env={"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""},
        )
        wait_ready(ms, [fe])
        wait_until(lambda: worker_urls(fe) == {ms[0].url}, WAIT, what="worker-0 from the initial list")
        (w0,) = fe.http.get("/admin/workers").json()["workers"]
        assert w0["source"] == "kubernetes" and w0["kv_events_endpoint"] == f"tcp://127.0.0.1:{ms[0].events}"
        assert w0["replay_endpoint"] == f"tcp://127.0.0.1:{ms[0].replay}" and w0["dp_size"] == 1
        assert w0["id"] == int(k.uids["worker-0"].replace("-", "")[:15], 16)  # from the pod UID
        assert fe.chat(unique_prompt())[0] == w0["id"]

        # watch: a second pod becomes ready, then the first one stops being ready
        k.slice("workers-a", {"worker-0": True, "worker-1": True})
        wait_until(lambda: worker_urls(fe) == {ms[0].url, ms[1].url}, WAIT, what="worker-1 from a MODIFIED event")
        k.slice("workers-a", {"worker-0": False, "worker-1": True})
        wait_until(lambda: worker_urls(fe, healthy=False) == {ms[1].url}, WAIT, what="not-ready worker-0 to leave")
        w1 = fe.http.get("/admin/workers").json()["workers"][0]
        assert w1["model"] == "kvroute-demo"  # from the kvroute.io/model annotation
        assert {fe.chat(unique_prompt())[0] for _ in range(4)} == {w1["id"]}
        lists = k.stats()["lists"]

        # 410 Gone: a change the watch never announces, then every watch expires; only a relist sees it
        k.slice("workers-a", {"worker-1": True, "worker-2": True}, silent=True)
        assert fake.url and httpx.post(fake.url + "/fake/expire").json()["watchers"] >= 1
        wait_until(lambda: worker_urls(fe) == {ms[1].url, ms[2].url}, WAIT, what="worker-2 after the relist on 410")
        assert k.stats()["lists"] > lists
        lists = k.stats()["lists"]
        assert fe.http.get("/admin/workers").json()["discovery"][1]["watch"]["expired"] >= 1

        # a dropped watch connection: again a silent change, seen through the relist
        k.slice("workers-a", {"worker-2": True}, silent=True)
        wait_until(lambda: k.stats()["open_watches"] >= 1, WAIT, what="the frontend to watch again")
        assert httpx.post(fake.url + "/fake/drop").json()["dropped"] >= 1
        wait_until(
            lambda: worker_urls(fe, healthy=False) == {ms[2].url}, WAIT, what="worker-1 gone after the relist on a drop"
        )
        assert k.stats()["lists"] > lists
        status = fe.http.get("/admin/workers").json()["discovery"][1]
        assert status["backend"] == "kubernetes" and status["namespace"] == NS and status["watch"]["relists"] >= 3

        # and the watch still works after both: the slice goes away, so do the workers
        wait_until(lambda: k.stats()["open_watches"] >= 1, WAIT, what="the frontend to watch again")
        assert k.http.delete("/fake/endpointslices/workers-a", params={"namespace": NS}).status_code == 200
        wait_until(lambda: worker_urls(fe, healthy=False) == set(), WAIT, what="no workers once the slice is deleted")
        wait_until(lambda: fe.http.get("/health").status_code == 503, WAIT, what="not ready without workers")


def test_bad_annotations_skip_the_pod_not_the_rest(api) -> None:
    fake, kubeconfig = api
    k = Cluster(fake)
    with contextlib.ExitStack() as stack:
        (m,) = start_mockers(1, stack)
        k.pod("good", m)
        r = k.http.put(
            "/fake/pods/bad",
            json={
                "metadata": {
                    "namespace": NS,
                    "uid": str(uuid.uuid4()),
                    "annotations": {"kvroute.io/http-port": "eighty"},
                }
            },
        )
        assert r.status_code == 200
        k.slice("workers", {"good": True, "bad": True, "missing-pod": True})
        fe = start_frontend(
            ["--discovery", "kubernetes", "--discovery-namespace", NS],
            stack,
            env={"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""},
        )
        wait_ready([m], [fe])
        wait_until(lambda: worker_urls(fe) == {m.url}, WAIT, what="the good pod only")
        assert len(fe.http.get("/admin/workers").json()["workers"]) == 1


def test_frontend_replicas_find_each_other_through_the_sync_service(api) -> None:
    fake, kubeconfig = api
    k = Cluster(fake)
    (port,) = free_ports(1)  # both replicas bind the same port on two loopback addresses, as two pods would
    with contextlib.ExitStack() as stack:
        ms = start_mockers(2, stack)
        for i, m in enumerate(ms):
            k.pod(f"worker-{i}", m)
        k.slice("workers", {"worker-0": True, "worker-1": True})
        k.slice(
            "kvroute-frontend-sync-x",
            {"fe-a": True, "fe-b": True},
            labels={"kvroute.io/role": "frontend"},
            addresses={"fe-a": "127.0.0.1", "fe-b": "127.0.0.2"},
            ports=[{"name": "replica-sync", "port": port}],
        )
        fes = []
        for name, host in (("fe-a", "127.0.0.1"), ("fe-b", "127.0.0.2")):
            fes.append(
                start_frontend(
                    [
                        "--router-mode",
                        "kv",
                        "--router-replica-sync",
                        "--replica-sync-bind",
                        f"tcp://{host}:{port}",
                        "--discovery",
                        "kubernetes",
                        "--discovery-namespace",
                        NS,
                    ],
                    stack,
                    env={"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": "", "POD_NAME": name},
                )
            )
        a, b = fes
        wait_ready(ms, fes)
        for fe in fes:
            wait_until(lambda fe=fe: len(worker_urls(fe)) == 2, WAIT, what="both workers on each replica")
        wait_until(lambda: a.http.get("/peers").json() == [f"tcp://127.0.0.2:{port}"], WAIT, what="A to find B")
        wait_until(lambda: b.http.get("/peers").json() == [f"tcp://127.0.0.1:{port}"], WAIT, what="B to find A")

        def views_converge() -> bool:
            s = stream_until_first_chunk(a, unique_prompt())
            try:
                return wait_until(lambda: not a.idle() and b.loads() == a.loads(), 5.0, what="B's view to match A's")
            except TimeoutError:
                return False
            finally:
                s.close()

        wait_until(views_converge, WAIT, what="B to see A's in-flight request")
        # B's pod stops being ready: A disconnects from it
        k.slice(
            "kvroute-frontend-sync-x",
            {"fe-a": True, "fe-b": False},
            labels={"kvroute.io/role": "frontend"},
            addresses={"fe-a": "127.0.0.1", "fe-b": "127.0.0.2"},
            ports=[{"name": "replica-sync", "port": port}],
        )
        wait_until(lambda: a.http.get("/peers").json() == [], WAIT, what="A to drop B")
