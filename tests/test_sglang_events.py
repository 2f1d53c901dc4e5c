"""SGLang's KV events, checked against SGLang's own code from its PyPI wheel (as test_mocker_events.py
checks vLLM's format against vLLM's structs).

The wheel is fetched with ``pip download --no-deps`` (no GPU dependencies are installed) and only the
files we need are loaded from it: ``sglang/srt/disaggregation/kv_events.py`` (the event structs and
``ZmqEventPublisher``, SGLang's real PUB + replay ROUTER publisher thread) with its two in-package
imports stubbed (a runtime-context accessor and a network helper the publisher does not use on this
path), and SGLang's priority-scheduling code for the polarity check. SGLang's publisher then feeds
our standalone indexer (``python -m indexer``) over real ZMQ, including a gap recovered by replay.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import time
import types
import zipfile

import httpx
import pytest

from support import free_port, free_ports, service, wait_until

SGLANG_VERSION = "0.5.23"
MODEL = "sgl-model"
BS = 16
INSTANCE = 77


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    """SGLang's wheel (cached per machine); no dependency is installed."""
    d = os.path.join(tempfile.gettempdir(), f"kvroute-sglang-{SGLANG_VERSION}")
    os.makedirs(d, exist_ok=True)
    have = [f for f in os.listdir(d) if f.endswith(".whl")]
    if not have:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                f"sglang=={SGLANG_VERSION}",
                "-d",
                d,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, f"cannot download the sglang wheel: {out.stderr[-2000:]}"
        have = [f for f in os.listdir(d) if f.endswith(".whl")]
    return zipfile.ZipFile(os.path.join(d, have[0]))


@pytest.fixture(scope="module")
def sgl(wheel) -> types.ModuleType:
    """``sglang.srt.disaggregation.kv_events`` loaded alone from the wheel."""
    source = wheel.read("sglang/srt/disaggregation/kv_events.py").decode()
    stubs = {
        "sglang.srt.runtime_context": types.SimpleNamespace(get_parallel=lambda: None),
        "sglang.srt.utils.network": types.SimpleNamespace(NetworkAddress=object),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    mod = types.ModuleType("sglang_kv_events_from_wheel")
    try:
        for name, stub in stubs.items():
            sys.modules[name] = stub  # type: ignore[assignment]
        sys.modules[mod.__name__] = mod  # msgspec tagged structs resolve their module
        exec(compile(source, "sglang/srt/disaggregation/kv_events.py", "exec"), mod.__dict__)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return mod


def blocks(start: int, n: int) -> list[list[int]]:
    return [[start + i * BS + j for j in range(BS)] for i in range(n)]


def stored(sgl, blks: list[list[int]], first_hash: int, parent: int | None):
    return sgl.BlockStored(
        block_hashes=[first_hash + i for i in range(len(blks))],
        parent_block_hash=parent,
        token_ids=[t for b in blks for t in b],
        block_size=BS,
        lora_id=None,
        medium="GPU",
    )


def query(indexer: str, tokens: list[int]) -> int:
    """Matched blocks of ``tokens`` on our instance (the indexer scores matched tokens)."""
    r = httpx.post(indexer + "/query", json={"model_name": MODEL, "token_ids": tokens}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["scores"].get(str(INSTANCE), {}).get("0", 0) // BS


def test_sglang_wire_format_is_what_our_decoder_reads(sgl):
    import msgspec

    from indexer import wire

    a = blocks(1000, 2)
    batch = sgl.KVEventBatch(
        ts=time.time(),
        events=[stored(sgl, a, 500, None), sgl.BlockRemoved(block_hashes=[501], medium="GPU"), sgl.AllBlocksCleared()],
        attn_dp_rank=3,
    )
    payload = msgspec.msgpack.encode(batch)
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 3  # [ts, events, attn_dp_rank], events are tagged maps
    assert raw[1][0]["type"] == "BlockStored"
    decoded = wire.decode_batch(payload)
    assert decoded.dp_rank == 3 and len(decoded.events) == 3
    st, rm, cl = decoded.events
    assert st.block_hashes == [500, 501] and st.token_ids == a[0] + a[1] and st.block_size == BS and st.medium == "GPU"
    assert rm.block_hashes == [501]
    assert type(cl).__name__ == "Cleared"


def test_sglang_publisher_feeds_our_indexer_with_replay(sgl):
    pub_port, replay_port = free_ports(2)
    publisher = sgl.ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        bind=True,
        buffer_steps=1000,
    )
    try:
        a = blocks(10_000, 3)
        publisher.publish(
            sgl.KVEventBatch(ts=time.time(), events=[stored(sgl, a, 1, None)])
        )  # seq 0: nobody listens yet
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with service(
            ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port)], ready_url=url + "/health", timeout=60
        ):
            r = httpx.post(
                url + "/register",
                json={
                    "instance_id": INSTANCE,
                    "endpoint": f"tcp://127.0.0.1:{pub_port}",
                    "model_name": MODEL,
                    "block_size": BS,
                    "dp_rank": 0,
                    "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                },
            )
            assert r.status_code == 201, r.text
            tokens_a = [t for b in a for t in b]
            # the SUB socket connects asynchronously: publish fresh batches until one arrives; its seq > 0
            # is a gap, recovered from SGLang's replay ROUTER (batch 0 = prompt a)
            seen: list[list[int]] = []
            deadline = time.monotonic() + 30
            while not seen or not query(url, seen[-1]):
                assert time.monotonic() < deadline, "the indexer never received SGLang's events"
                b = blocks(20_000 + 1000 * len(seen), 2)
                publisher.publish(sgl.KVEventBatch(ts=time.time(), events=[stored(sgl, b, 100 + 10 * len(seen), None)]))
                seen.append([t for blk in b for t in blk])
                try:
                    wait_until(lambda: query(url, seen[-1]) == 2, timeout=0.5, what="batch")
                except TimeoutError:
                    pass
            wait_until(lambda: query(url, tokens_a) == 3, timeout=20, what="replayed batch 0")
            # removal of a's last block (SGLang's hash 3), then a full clear
            publisher.publish(
                sgl.KVEventBatch(ts=time.time(), events=[sgl.BlockRemoved(block_hashes=[3], medium="GPU")])
            )
            wait_until(lambda: query(url, tokens_a) == 2, timeout=20, what="BlockRemoved applied")
            publisher.publish(sgl.KVEventBatch(ts=time.time(), events=[sgl.AllBlocksCleared()]))
            wait_until(
                lambda: query(url, tokens_a) == 0 and query(url, seen[-1]) == 0,
                timeout=20,
                what="AllBlocksCleared applied",
            )
    finally:
        publisher.shutdown()


def _function_from_wheel(wheel: zipfile.ZipFile, path: str, cls: str, name: str):
    tree = ast.parse(wheel.read(path).decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    ns: dict = {"List": list}
                    exec(compile(ast.Module(body=[item], type_ignores=[]), path, "exec"), ns)
                    return ns[name], ast.get_source_segment(wheel.read(path).decode(), node)
    raise AssertionError(f"{cls}.{name} not found in {path}")


def test_sglang_priority_polarity_matches_what_the_frontend_sends(wheel):
    """SGLang (default, --enable-priority-scheduling): HIGHER priority values are scheduled first, the same
    polarity as Dynamo's ``priority``; so the frontend forwards the value unchanged to SGLang (and negated to
    vLLM, which runs lower values first). With --schedule-low-priority-values-first SGLang flips to vLLM's."""
    from frontend.request.hints import RequestHints, engine_priority

    fields = wheel.read("sglang/srt/arg_groups/fields/schedule.py").decode()
    tree = ast.parse(fields)
    default = next(
        n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "schedule_low_priority_values_first"
    )
    assert default is False
    sort, cls_src = _function_from_wheel(
        wheel, "sglang/srt/managers/schedule_policy.py", "SchedulePolicy", "_sort_by_priority_and_fcfs"
    )
    assert "self.priority_sign = 1 if schedule_low_priority_values_first else -1" in cls_src
    priority_sign = 1 if default else -1

    class Req:
        def __init__(self, name: str, dynamo_priority: int, t: float) -> None:
            self.name = name
            self.priority = engine_priority(RequestHints(priority=dynamo_priority), backend="sglang")
            self.time_stats = types.SimpleNamespace(wait_queue_entry_time=t)

    queue = [Req("low", -3, 0.0), Req("high", 7, 1.0), Req("mid", 2, 2.0), Req("mid-later", 2, 3.0)]
    sort(queue, priority_sign)
    assert [r.name for r in queue] == ["high", "mid", "mid-later", "low"]  # more important first, FCFS within
    assert engine_priority(RequestHints(priority=7), backend="vllm") == -7
