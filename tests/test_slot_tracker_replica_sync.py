"""Replica sync: real slot-tracker processes exchanging lifecycle events over real ZMQ PUB/SUB sockets."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from slot_tracker.core import LifecycleEvent, SlotRegistry
from slot_tracker.replica_sync import TOPIC, ReplicaSync, decode_event, encode_event, validate_endpoint
from support import free_ports, reference_installed, service, wait_until

# Captured from the 1.6.1 reference (`python -m dynamo.slot_tracker --replica-sync-port`) after
# /add {model m, worker 7, rank 1, hashes [1, -2, 3], new_isl_tokens 48}: our encoder must produce these bytes.
REFERENCE_ADD = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510a56576656e7485"
    "aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f696407a764705f72616e6b01a46461746181aa416464526571"
    "7565737484ae746f6b656e5f73657175656e63659301cffffffffffffffffe03b4747261636b5f70726566696c6c5f746f6b656e73c3b6"
    "65787065637465645f6f75747075745f746f6b656e73c0b170726566696c6c5f6c6f61645f68696e7482d920696e697469616c5f656666"
    "6563746976655f70726566696c6c5f746f6b656e7330b965787065637465645f70726566696c6c5f6475726174696f6ec0a9726f757465"
    "725f6964cffb318490f5db6366a96c6f72615f6e616d65c0"
)
REFERENCE_FREE = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510a56576656e7485"
    "aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f696407a764705f72616e6b01a464617461a446726565a9726f"
    "757465725f6964cffb318490f5db6366a96c6f72615f6e616d65c0"
)
REFERENCE_ROUTER_ID = 0xFB318490F5DB6366


def test_wire_format_is_the_references_byte_for_byte():
    ev = LifecycleEvent("add", "m", "default", 16, "r1", 7, 1, [1, (-2) & ((1 << 64) - 1), 3], 48)
    assert encode_event(ev, REFERENCE_ROUTER_ID) == REFERENCE_ADD
    free = LifecycleEvent("free", "m", "default", 16, "r1", 7, 1, (), 0)
    assert encode_event(free, REFERENCE_ROUTER_ID) == REFERENCE_FREE
    env = decode_event(REFERENCE_ADD)
    assert (env.model_name, env.routing_group, env.block_size, env.event.request_id, env.event.router_id) == (
        "m",
        "default",
        16,
        "r1",
        REFERENCE_ROUTER_ID,
    )
    assert env.event.data.AddRequest.token_sequence == [1, (1 << 64) - 2, 3]


def test_apply_rules_own_events_unknown_topology_and_never_creating_workers():
    reg = SlotRegistry()
    reg.register(7, "m", "default", 16, 0, 2)
    sync = ReplicaSync(reg, "tcp://127.0.0.1:1")
    env = decode_event(REFERENCE_ADD)
    sync.router_id = REFERENCE_ROUTER_ID
    assert sync.apply(env) is False  # our own id: ignored
    sync.router_id = 12345
    assert sync.apply(env) is True
    t = reg.get("m")
    assert (t.active_prefill_tokens(7, 1), t.active_decode_blocks(7, 1)) == (48, 3)
    assert sync.apply(env) is False  # duplicate add dropped, booking unchanged
    assert sync.apply(decode_event(REFERENCE_FREE)) is True and len(t) == 0
    other = SlotRegistry()
    other.register(7, "m", "default", 32, 0, 1)  # different block size, and no rank 1
    s2 = ReplicaSync(other, "tcp://127.0.0.1:1")
    assert s2.apply(env) is False
    assert other.workers() == [
        {"worker_id": 7, "model_name": "m", "tenant_id": "default", "block_size": 32, "dp_start": 0, "dp_size": 1}
    ]
    assert s2.apply(decode_event(REFERENCE_ADD.replace(b"\xa1m", b"\xa1n"))) is False  # unknown model


def test_dropped_peer_events_are_logged_once_per_unknown_topology(caplog):
    """A replica never given the workers (a standalone tracker following a frontend without
    /register) shows no load at all: the drop is logged once per topology, with the reason."""
    reg = SlotRegistry()
    sync = ReplicaSync(reg, "tcp://127.0.0.1:1")
    caplog.set_level("WARNING", logger="slot_tracker.replica_sync")
    env = decode_event(REFERENCE_ADD)
    assert sync.apply(env) is False and sync.apply(env) is False and sync.apply(decode_event(REFERENCE_FREE)) is False
    msgs = [r.getMessage() for r in caplog.records]
    assert (
        len(msgs) == 1 and "model 'm'" in msgs[0] and "worker 7 rank 1" in msgs[0] and "not registered here" in msgs[0]
    )
    reg.register(7, "m", "default", 32, 0, 2)  # registered now, with another block size: a second, different warning
    assert sync.apply(env) is False
    assert len(caplog.records) == 2 and "block size registered here is 32" in caplog.records[1].getMessage()
    assert sync.stats["dropped"] == 4


def test_bounded_queue_drops_instead_of_blocking():
    async def run() -> dict:
        reg = SlotRegistry()
        sync = ReplicaSync(reg, "tcp://127.0.0.1:1", queue_capacity=2)
        for i in range(5):
            sync._on_local_event(LifecycleEvent("free", "m", "default", 16, f"r{i}", 1, 0, (), 0))
        return sync.stats

    assert asyncio.run(run())["dropped_full"] == 3


def test_endpoint_validation():
    assert validate_endpoint("tcp://10.0.0.1:8092") is None
    assert validate_endpoint("ipc:///tmp/x") is None
    assert "missing scheme" in validate_endpoint("garbage")
    assert "unsupported scheme" in validate_endpoint("udp://a:1")
    assert "missing TCP port" in validate_endpoint("tcp://127.0.0.1")
    assert validate_endpoint("tcp://*:8092") is not None


class Replica:
    def __init__(self, url: str, pub: str) -> None:
        self.url = url
        self.pub = pub
        self.http = httpx.Client(base_url=url, timeout=10.0)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.post(path, json=body)

    def load(self, model: str, worker: int, rank: int) -> tuple[int, int]:
        for row in self.http.get("/loads", params={"model_name": model}).json():
            if (row["worker_id"], row["dp_rank"]) == (worker, rank):
                return row["active_prefill_tokens"], row["active_decode_blocks"]
        raise KeyError((model, worker, rank))

    def requests(self, model: str, worker: int, rank: int) -> int:
        rows = self.post("/potential_loads", {"model_name": model, "sequence_hashes": []}).json()
        return next(r["active_requests"] for r in rows if (r["worker_id"], r["dp_rank"]) == (worker, rank))


def start_replica(stack, http_port: int, pub_port: int, peers: list[int]) -> Replica:
    url = f"http://127.0.0.1:{http_port}"
    pub = f"tcp://127.0.0.1:{pub_port}"
    args = [
        "-m",
        "slot_tracker",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--replica-sync-bind",
        pub,
        "--replica-sync-advertise",
        pub,
    ]
    if peers:
        args += ["--replica-sync-peers", ",".join(f"tcp://127.0.0.1:{p}" for p in peers)]
    stack.enter_context(service(args, ready_url=f"{url}/health"))
    return Replica(url, pub)


_probe = itertools.count()


def wait_linked(src: Replica, dst: Replica, model: str) -> None:
    """Wait until src's events reach dst (the SUB handshake is asynchronous): probe, then clean up."""
    ids: list[str] = []

    def probe() -> bool:
        if dst.requests(model, 1, 0) > 0:
            return True
        rid = f"probe-{next(_probe)}"
        ids.append(rid)
        assert (
            src.post(
                "/add", {"model_name": model, "request_id": rid, "worker_id": 1, "dp_rank": 0, "sequence_hashes": []}
            ).status_code
            == 201
        )
        return False

    wait_until(probe, timeout=30, interval=0.1, what=f"{src.url} -> {dst.url} subscription")
    for rid in ids:
        assert src.post("/free", {"model_name": model, "request_id": rid}).status_code == 200
    wait_until(
        lambda: dst.requests(model, 1, 0) == 0 and src.requests(model, 1, 0) == 0,
        timeout=30,
        what="probes freed on both",
    )


def test_two_replicas_share_lifecycle_events():
    import contextlib

    http_a, http_b, pub_a, pub_b = free_ports(4)
    with contextlib.ExitStack() as stack:
        a = start_replica(stack, http_a, pub_a, [pub_b, pub_a])  # its own endpoint in the list is skipped
        b = start_replica(stack, http_b, pub_b, [pub_a])
        assert a.http.get("/peers").json() == [b.pub]
        for r in (a, b):
            assert (
                r.post(
                    "/register", {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}
                ).status_code
                == 201
            )
        wait_linked(a, b, "m")
        wait_linked(b, a, "m")

        # add on A appears on B; prefill_complete on B reaches A; free on B removes it on A
        assert (
            a.post(
                "/add",
                {
                    "model_name": "m",
                    "request_id": "r1",
                    "worker_id": 1,
                    "dp_rank": 1,
                    "sequence_hashes": [5, -6, 7],
                    "new_isl_tokens": 40,
                },
            ).status_code
            == 201
        )
        wait_until(lambda: b.load("m", 1, 1) == (40, 3), timeout=30, what="add replicated to B")
        assert b.post("/prefill_complete", {"model_name": "m", "request_id": "r1"}).status_code == 200
        wait_until(lambda: a.load("m", 1, 1) == (0, 3), timeout=30, what="prefill_complete replicated to A")
        assert b.post("/free", {"model_name": "m", "request_id": "r1"}).status_code == 200
        wait_until(lambda: a.load("m", 1, 1) == (0, 0), timeout=30, what="free replicated to A")
        assert b.load("m", 1, 1) == (0, 0)

        # events for topology B does not have are dropped, and never create workers
        assert (
            a.post(
                "/register", {"worker_id": 2, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
            ).status_code
            == 201
        )
        assert (
            a.post(
                "/register", {"worker_id": 1, "model_name": "m2", "block_size": 16, "dp_start": 0, "dp_size": 1}
            ).status_code
            == 201
        )
        assert (
            b.post(
                "/register", {"worker_id": 1, "model_name": "m2", "block_size": 32, "dp_start": 0, "dp_size": 1}
            ).status_code
            == 201
        )
        assert (
            a.post(
                "/add", {"model_name": "m", "request_id": "w2", "worker_id": 2, "dp_rank": 0, "sequence_hashes": [1]}
            ).status_code
            == 201
        )
        assert (
            a.post(
                "/add", {"model_name": "m2", "request_id": "bs", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}
            ).status_code
            == 201
        )
        # a marker sent after them on the same connection: once it arrives, the earlier ones were handled
        assert (
            a.post(
                "/add",
                {"model_name": "m", "request_id": "marker", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [9]},
            ).status_code
            == 201
        )
        wait_until(lambda: b.load("m", 1, 0) == (0, 1), timeout=30, what="marker replicated")
        assert [w["worker_id"] for w in b.http.get("/workers", params={"model_name": "m"}).json()] == [1]
        assert b.load("m2", 1, 0) == (0, 0)
        assert b.post("/free", {"model_name": "m2", "request_id": "bs"}).status_code == 200  # unknown there: idempotent


def test_dynamic_peers_via_the_api():
    import contextlib

    http_a, http_c, pub_a, pub_c = free_ports(4)
    with contextlib.ExitStack() as stack:
        a = start_replica(stack, http_a, pub_a, [])
        c = start_replica(stack, http_c, pub_c, [])
        for r in (a, c):
            assert (
                r.post(
                    "/register", {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
                ).status_code
                == 201
            )
        assert c.http.get("/peers").json() == []
        assert c.post("/register_peer", {"url": a.pub}).status_code == 201
        assert c.post("/register_peer", {"url": a.pub}).status_code == 200  # already present
        assert (
            c.post("/replica_sync/register_peer", {"endpoint": "tcp://127.0.0.1:1"}).status_code == 201
        )  # 1.6.1 spelling
        assert c.http.get("/peers").json() == sorted([a.pub, "tcp://127.0.0.1:1"])
        assert c.http.get("/replica_sync/peers").json() == c.http.get("/peers").json()
        assert c.post("/register_peer", {"url": c.pub}).status_code == 400  # own advertised endpoint
        assert c.post("/register_peer", {"url": "garbage"}).status_code == 400
        assert c.post("/register_peer", {}).status_code == 422
        assert c.post("/deregister_peer", {"url": "tcp://127.0.0.1:1"}).status_code == 200
        assert c.post("/deregister_peer", {"url": "tcp://127.0.0.1:1"}).status_code == 404
        wait_linked(a, c, "m")  # A's events now reach C
        assert c.post("/deregister_peer", {"url": a.pub}).status_code == 200
        assert c.http.get("/peers").json() == []


@pytest.mark.skipif(not reference_installed(), reason="reference (ai-dynamo-runtime) not installed")
def test_interoperates_with_the_reference_replica():
    """Our replica and a 1.6.1 reference replica exchange events in both directions."""
    import contextlib

    http_a, http_r, pub_a, pub_r = free_ports(4)
    with contextlib.ExitStack() as stack:
        a = start_replica(stack, http_a, pub_a, [pub_r])
        ref_url = f"http://127.0.0.1:{http_r}"
        stack.enter_context(
            service(
                ["-m", "dynamo.slot_tracker", "--port", str(http_r), "--replica-sync-port", str(pub_r)],
                ready_url=f"{ref_url}/health",
            )
        )
        ref = Replica(ref_url, f"tcp://127.0.0.1:{pub_r}")
        assert ref.post("/replica_sync/register_peer", {"endpoint": a.pub}).status_code == 201
        for r in (a, ref):
            assert (
                r.post(
                    "/register", {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
                ).status_code
                == 201
            )
        wait_linked(a, ref, "m")
        wait_linked(ref, a, "m")
        assert (
            ref.post(
                "/add",
                {
                    "model_name": "m",
                    "request_id": "x",
                    "worker_id": 1,
                    "dp_rank": 0,
                    "sequence_hashes": [1, -2],
                    "new_isl_tokens": 7,
                },
            ).status_code
            == 201
        )
        wait_until(lambda: a.load("m", 1, 0) == (7, 2), timeout=30, what="reference add reaches ours")
        assert a.post("/free", {"model_name": "m", "request_id": "x"}).status_code == 200
        wait_until(lambda: ref.load("m", 1, 0) == (0, 0), timeout=30, what="our free reaches the reference")


def test_a_batched_message_applies_every_event_in_it():
    """batch=True (the --workers N siblings) sends [TOPIC, event, event, ...]; each event is applied."""
    reg = SlotRegistry()
    reg.register(7, "m", "default", 16, 0, 2)
    sync = ReplicaSync(reg, "tcp://127.0.0.1:1", batch=True)
    sync._receive([TOPIC, REFERENCE_ADD, b"\xc1 not msgpack", REFERENCE_FREE])
    assert (sync.stats["received"], sync.stats["applied"], sync.stats["dropped"]) == (3, 2, 1)
    assert len(reg.get("m")) == 0  # added then freed
    sync._receive([TOPIC, REFERENCE_ADD])
    assert reg.get("m").active_decode_blocks(7, 1) == 3
    sync._receive([b"other", REFERENCE_FREE])
    assert reg.get("m").active_decode_blocks(7, 1) == 3 and sync.stats["dropped"] == 2


def test_siblings_send_a_burst_as_one_msgpack_array_frame():
    """batch=True publishes [TOPIC, array of events] (one frame, one decode on the receiver), in chunks of
    MAX_BATCH; what one sibling publishes the other applies, event for event."""
    from slot_tracker.replica_sync import MAX_BATCH

    class Capture:
        def __init__(self) -> None:
            self.messages: list[list[bytes]] = []

        def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
            self.messages.append(frames)

    src_reg, dst_reg = SlotRegistry(), SlotRegistry()
    for reg in (src_reg, dst_reg):
        reg.register(7, "m", "default", 16, 0, 2)
    src = ReplicaSync(src_reg, "tcp://127.0.0.1:1", batch=True)
    dst = ReplicaSync(dst_reg, "tcp://127.0.0.1:2", batch=True)
    n = MAX_BATCH + 10
    events = [LifecycleEvent("add", "m", "default", 16, f"r{i}", 7, i % 2, (1, 2, i), 16) for i in range(n)]
    events += [LifecycleEvent("free", "m", "default", 16, f"r{i}", 7, i % 2, (), 0) for i in range(0, n, 2)]
    pub = Capture()
    src._publish_batch(pub, events)  # type: ignore[arg-type]
    assert len(pub.messages) == -(-len(events) // MAX_BATCH) and all(
        len(m) == 2 and m[0] == TOPIC for m in pub.messages
    )
    assert src.stats["published"] == len(events)
    for frames in pub.messages:
        dst._receive(frames)
    assert dst.stats["applied"] == len(events) and dst.stats["received"] == len(events)
    assert len(dst_reg.get("m")) == n // 2  # the odd-numbered requests are still in flight
    # a corrupt batch frame is dropped whole, and the next one still applies
    dst._receive([TOPIC, b"\x92\xc1\xc1"])
    assert dst.stats["dropped"] == 1
