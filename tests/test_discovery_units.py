"""Discovery without servers: flag handling, pod annotations -> worker specs, etcd key parsing,
and the discovery target's peer bookkeeping on a real ReplicaSync."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend.cli import build_parser
from frontend.pool.discovery import build_backends, replica_advertise
from frontend.pool.discovery.base import DiscoveryTarget
from frontend.pool.discovery.etcd import normalize_prefix, parse_peer_entries, parse_worker_entries
from frontend.pool.discovery.etcd_client import parse_endpoints, prefix_range_end
from frontend.pool.discovery.kubernetes import pod_worker_id, ready_endpoints, worker_spec
from frontend.pool.workers import WorkerPool
from support import free_port


def backends(*argv: str) -> list[str]:
    ns = build_parser().parse_args(list(argv))
    return [b.name for b in build_backends(ns, [], None)]


def test_backend_selection_and_errors(monkeypatch) -> None:
    monkeypatch.delenv("KVROUTE_WORKERS_FILE", raising=False)
    assert backends() == ["static"]
    assert backends("--workers-file", "w.yaml") == ["static", "file"]
    assert backends("--discovery", "etcd", "--etcd-endpoints", "127.0.0.1:2379") == ["static", "etcd"]
    assert backends("--discovery", "kubernetes", "--discovery-namespace", "x") == ["static", "kubernetes"]
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "etcd")
    monkeypatch.setenv("DYN_ETCD_ENDPOINTS", "http://a:2379,http://b:2379")
    assert backends() == ["static", "etcd"]
    for argv, message in (
        (["--discovery", "file"], "needs --workers-file"),
        (["--discovery", "etcd", "--workers-file", "w"], "only works with --discovery file"),
        (["--discovery", "etcd", "--discovery-lease-ttl", "1"], ">= 2 seconds"),
    ):
        with pytest.raises(ValueError, match=message):
            build_backends(build_parser().parse_args(argv), [], None)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (_, k8s) = build_backends(build_parser().parse_args(["--discovery", "kubernetes"]), [], None)
    with pytest.raises(ValueError, match="cannot load cluster credentials"):
        k8s.prepare()
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "zookeeper")
    with pytest.raises(ValueError, match="must be one of"):
        build_backends(build_parser().parse_args([]), [], None)


def test_etcd_helpers() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://h:2379/") == ["http://127.0.0.1:2379", "http://h:2379"]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")
    assert prefix_range_end("/kvroute/") == b"/kvroute0"
    assert prefix_range_end("a\xff") == b"a\xc3\xc0"  # on the utf-8 bytes: the last one incremented
    assert normalize_prefix("/x") == "/x/"
    items = {
        "/kvroute/workers/1": json.dumps({"id": 1, "url": "http://h:1"}).encode(),
        "/kvroute/workers/2": b"not json",
        "/kvroute/workers/3": json.dumps({"id": 3, "url": "ftp://h"}).encode(),
        "/kvroute/workers/4": json.dumps({"id": 1, "url": "http://h:2"}).encode(),
    }
    specs = parse_worker_entries(items, "/kvroute/workers/")
    assert [(s.id, s.url) for s in specs] == [(1, "http://h:1")]  # bad and duplicate entries skipped
    assert parse_peer_entries({"a": b'{"endpoint": "tcp://h:1"}', "b": b"{}"}) == ["tcp://h:1"]


def test_pod_annotations_make_the_worker() -> None:
    uid = "0b9f1c2e-3d4a-4b5c-8d6e-7f8091a2b3c4"
    pod = {
        "metadata": {
            "name": "w",
            "uid": uid,
            "annotations": {
                "kvroute.io/http-port": "8001",
                "kvroute.io/kv-events-port": "5557",
                "kvroute.io/replay-port": "5567",
                "kvroute.io/dp-size": "2",
                "kvroute.io/model": "m",
                "kvroute.io/worker-role": "both",
            },
        }
    }
    spec = worker_spec("10.0.0.7", pod, {"ports": []})
    assert spec.id == pod_worker_id(uid) == int("0b9f1c2e3d4a4b5", 16)
    assert spec.url == "http://10.0.0.7:8001" and spec.dp_size == 2 and spec.model == "m"
    assert spec.kv_events_endpoint == "tcp://10.0.0.7:5557" and spec.replay_endpoint == "tcp://10.0.0.7:5567"
    # no http-port annotation: the slice's port named http; IPv6 addresses are bracketed
    bare = {"metadata": {"uid": uid}}
    assert (
        worker_spec("fd00::1", bare, {"ports": [{"name": "metrics", "port": 9}, {"name": "http", "port": 8080}]}).url
        == "http://[fd00::1]:8080"
    )
    for ann, message in (
        ({"kvroute.io/dp-size": "0"}, "must be > 0"),
        ({"kvroute.io/worker-role": "x"}, "prefill, decode or both"),
    ):
        with pytest.raises(ValueError, match=message):
            worker_spec("10.0.0.7", {"metadata": {"uid": uid, "annotations": ann}}, {})
    with pytest.raises(ValueError, match="not a UID"):
        worker_spec("10.0.0.7", {"metadata": {}}, {})
    slices = {
        "s": {
            "endpoints": [
                {"addresses": ["1.1.1.1"], "conditions": {"ready": True}},
                {"addresses": ["1.1.1.2"], "conditions": {"ready": False}},
                {"addresses": ["1.1.1.3"], "conditions": {}},  # unknown readiness counts as ready
                {"addresses": [], "conditions": {"ready": True}},
            ]
        },
        "fqdn": {"addressType": "FQDN", "endpoints": [{"addresses": ["x.example"]}]},
    }
    assert [a for _, _, a in ready_endpoints(slices)] == ["1.1.1.1", "1.1.1.3"]


def test_replica_advertise() -> None:
    assert replica_advertise("tcp://10.1.2.3:8092", None) == "tcp://10.1.2.3:8092"
    assert replica_advertise("tcp://*:8092", "tcp://me:8092") == "tcp://me:8092"
    assert replica_advertise("tcp://*:8092", None).endswith(":8092") and "*" not in replica_advertise(
        "tcp://*:8092", None
    )


def test_target_connects_and_drops_discovered_peers_only() -> None:
    from slot_tracker.core import SlotRegistry
    from slot_tracker.replica_sync import ReplicaSync

    async def run() -> None:
        own = f"tcp://127.0.0.1:{free_port()}"
        sync = ReplicaSync(SlotRegistry(), own, None, ["tcp://127.0.0.1:1"])  # one hand-listed peer
        await sync.start()
        try:
            pool = WorkerPool(lambda w: None, lambda w: None)
            target = DiscoveryTarget(pool, {}, sync)
            target.set_peers("etcd", [own, "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"])  # our own endpoint is skipped
            assert sync.peers() == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
            target.set_peers("etcd", ["tcp://127.0.0.1:3", "bogus"])  # a bad endpoint is skipped, not fatal
            assert sync.peers() == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:3"]
            target.set_peers("etcd", ["tcp://127.0.0.1:1"])  # already hand-listed: not ours to drop later
            target.set_peers("etcd", [])
            assert sync.peers() == ["tcp://127.0.0.1:1"]
            await pool.stop()
        finally:
            await sync.stop()

    asyncio.run(run())
