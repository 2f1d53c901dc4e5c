"""The mocker's KV events on the wire: decoded by vLLM-identical structs, replayed from the ring,
and consumed by real indexers (ours and the reference ``python -m dynamo.indexer``)."""

from __future__ import annotations

import contextlib
import itertools
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from indexer import wire
from kvroute_common.tokenizer import completion_prompt_token_ids, load_tokenizer
from support import free_port, free_port_block, reference_installed, service, wait_until

MODEL = "kvroute-demo"
BS = 16
INSTANCE = 4242
_salt = itertools.count(1)


# -- vLLM 0.33's event structs as vllm/distributed/kv_events.py of the 0.33 wheel declares them
# (vLLM's field list; module level: msgspec's tag=True uses the qualified class name)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


vllm_decoder = msgspec.msgpack.Decoder(KVEventBatch)


@contextlib.contextmanager
def run_mocker(dp: int = 2, num_gpu_blocks: int = 4096, extra: tuple[str, ...] = ()):
    port = free_port()
    pub = free_port_block(dp)
    rep = free_port_block(dp)
    args = [
        "-m",
        "mocker",
        "--port",
        str(port),
        "--data-parallel-size",
        str(dp),
        "--num-gpu-blocks",
        str(num_gpu_blocks),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{rep}",
        "--speedup-ratio",
        "10",
        *extra,
    ]
    with service(args, ready_url=f"http://127.0.0.1:{port}/health", timeout=60):
        yield {"url": f"http://127.0.0.1:{port}", "pub": pub, "replay": rep, "dp": dp}


@contextlib.contextmanager
def run_indexer(kind: str):
    port = free_port()
    args = (
        ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port)]
        if kind == "ours"
        else ["-m", "dynamo.indexer", "--port", str(port), "--threads", "1"]
    )
    with service(args, ready_url=f"http://127.0.0.1:{port}/health", timeout=60):
        yield f"http://127.0.0.1:{port}"


def prompt_text(n_words: int) -> str:
    salt = next(_salt)
    return " ".join(f"w{salt}x{i}" for i in range(n_words))


def complete(m: dict, prompt: str, rank: int, max_tokens: int = 1) -> dict:
    r = httpx.post(
        m["url"] + "/v1/completions",
        timeout=60,
        headers={"X-data-parallel-rank": str(rank)},
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()


def register(indexer: str, m: dict, rank: int) -> None:
    r = httpx.post(
        indexer + "/register",
        json={
            "instance_id": INSTANCE,
            "endpoint": f"tcp://127.0.0.1:{m['pub'] + rank}",
            "model_name": MODEL,
            "block_size": BS,
            "dp_rank": rank,
            "replay_endpoint": f"tcp://127.0.0.1:{m['replay'] + rank}",
        },
    )
    assert r.status_code == 201, r.text


def mocker_blocks(m: dict, rank: int) -> set[tuple[int, int]]:
    snap = httpx.get(m["url"] + "/mocker/kv_blocks", params={"dp_rank": rank}).json()
    return {(b["block_hash"], b["tokens_hash"]) for b in snap["blocks"]}


def indexer_blocks(indexer: str, rank: int) -> set[tuple[int, int]]:
    dump = httpx.get(indexer + "/dump", timeout=30).json()
    out = set()
    for part in dump.values():
        for ev in part["events"]:
            if ev["worker_id"] != INSTANCE or ev["event"]["dp_rank"] != rank or ev["storage_tier"] != "device":
                continue
            for b in ev["event"]["data"]["stored"]["blocks"]:
                out.add((b["block_hash"], b["tokens_hash"]))
    return out


def query(indexer: str, tokens: list[int]) -> dict[str, int]:
    r = httpx.post(indexer + "/query", json={"model_name": MODEL, "token_ids": tokens})
    assert r.status_code == 200, r.text
    return r.json()["scores"].get(str(INSTANCE), {})


def index_matches(indexer: str, m: dict, rank: int) -> bool:
    want = mocker_blocks(m, rank)
    return bool(want) and indexer_blocks(indexer, rank) == want


def connect_listener(indexer: str, m: dict, rank: int) -> None:
    """Send small requests until the indexer has seen one (ZMQ SUB connects asynchronously)."""
    for _ in range(50):
        complete(m, prompt_text(20), rank)
        try:
            wait_until(lambda: indexer_blocks(indexer, rank), timeout=1.0, what="first events")
            return
        except TimeoutError:
            continue
    raise AssertionError("the indexer never received events")


INDEXERS = [
    "ours",
    pytest.param(
        "reference", marks=pytest.mark.skipif(not reference_installed(), reason="ai-dynamo-runtime not installed")
    ),
]


@pytest.mark.parametrize("kind", INDEXERS)
def test_indexer_mirrors_mocker_cache_including_evictions(kind):
    tok = load_tokenizer(None)
    with run_mocker(dp=2, num_gpu_blocks=64) as m, run_indexer(kind) as idx:
        for rank in (0, 1):
            register(idx, m, rank)
        for rank in (0, 1):
            connect_listener(idx, m, rank)
        text = prompt_text(120)
        tokens = completion_prompt_token_ids(tok, text)
        assert len(tokens) > 5 * BS
        complete(m, text, rank=1)
        wait_until(lambda: index_matches(idx, m, 1), timeout=20, what="index == mocker cache on rank 1")
        assert query(idx, tokens) == {"1": len(tokens) // BS * BS}  # exactly the prompt's full blocks, rank 1 only

        # 64 blocks per rank: more distinct prompts evict the first one (LRU), the index follows
        for _ in range(6):
            complete(m, prompt_text(100), rank=1, max_tokens=3)
        wait_until(lambda: index_matches(idx, m, 1), timeout=20, what="index == mocker cache after evictions")
        assert len(mocker_blocks(m, 1)) <= 64
        assert query(idx, tokens).get("1", 0) < len(tokens) // BS * BS
        wait_until(lambda: index_matches(idx, m, 0), timeout=20, what="rank 0 unchanged and exact")

        # reset: AllBlocksCleared (published with the rank's next step, as vLLM does) empties the
        # worker in the index; only the blocks of the request after the reset remain
        assert httpx.post(m["url"] + "/reset_prefix_cache").status_code == 200
        after = {rank: prompt_text(20) for rank in (0, 1)}
        for rank, text in after.items():
            complete(m, text, rank)
        for rank, text in after.items():
            wait_until(partial(index_matches, idx, m, rank), timeout=20, what="index == mocker cache after reset")
            n_full = len(completion_prompt_token_ids(tok, text)) // BS
            assert len(mocker_blocks(m, rank)) == n_full > 0
        assert query(idx, tokens) == {}


@pytest.mark.parametrize("kind", INDEXERS)
def test_late_indexer_replays_from_ring(kind):
    with run_mocker(dp=1) as m:
        early = [prompt_text(60) for _ in range(3)]
        for text in early:
            complete(m, text, rank=0)  # published with nobody listening
        with run_indexer(kind) as idx:
            register(idx, m, 0)
            # the next live batch has seq > 0: the indexer sees the gap and replays 0.. from the ring
            wait_until(
                lambda: (complete(m, prompt_text(20), 0), index_matches(idx, m, 0))[1],
                timeout=30,
                interval=0.3,
                what="late indexer to catch up through replay",
            )
            tok = load_tokenizer(None)
            first = completion_prompt_token_ids(tok, early[0])
            assert query(idx, first) == {"0": len(first) // BS * BS}


def test_wire_frames_vllm_decoder_and_replay():
    ctx = zmq.Context()
    try:
        with run_mocker(dp=2) as m:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{m['pub'] + 1}")
            text = prompt_text(80)
            got: list[list[bytes]] = []

            def receive() -> bool:
                complete(m, text, rank=1)
                while sub.poll(200):
                    got.append(sub.recv_multipart())
                return bool(got)

            wait_until(receive, timeout=30, interval=0.1, what="live KV events on rank 1's port")
            frames = got[0]
            assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
            live_seq = int.from_bytes(frames[1], "big")

            batch = vllm_decoder.decode(frames[2])  # vLLM's own structs accept the bytes
            assert batch.data_parallel_rank == 1
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
            assert stored and all(e.medium == "GPU" and e.block_size == BS and e.lora_id is None for e in stored)
            assert all(len(e.token_ids) == BS * len(e.block_hashes) for e in stored)
            ours = wire.decode_batch(frames[2])
            assert ours.dp_rank == 1 and len(ours.events) == len(batch.events)
            assert msgspec.msgpack.encode(batch) == frames[2]  # byte-identical re-encoding

            # replay: everything from seq 0 on rank 1, vLLM 0.33's reply frames, then the end marker
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{m['replay'] + 1}")
            dealer.send_multipart([b"", wire.seq_frame(0)])
            replies = []
            for _ in range(10_000):
                assert dealer.poll(10_000), "no replay answer"
                reply = dealer.recv_multipart()
                replies.append(reply)
                if reply[-1] == b"":
                    break
            assert replies[-1] == [b"", b"", wire.REPLAY_END_SEQ, b""]
            seqs = [int.from_bytes(r[2], "big") for r in replies[:-1]]
            assert seqs == list(range(len(seqs))) and live_seq in seqs
            assert all(len(r) == 4 and r[0] == b"" and r[1] == b"" for r in replies[:-1])
            assert replies[seqs.index(live_seq)][3] == frames[2]
            for r in replies[:-1]:
                assert vllm_decoder.decode(r[3]).data_parallel_rank == 1
            sub.close()
            dealer.close()
    finally:
        ctx.destroy(linger=0)


def test_no_kv_events_flag():
    with run_mocker(dp=1, extra=("--no-kv-events",)) as m:
        complete(m, prompt_text(40), 0)
        snap = httpx.get(m["url"] + "/mocker/kv_blocks").json()
        assert snap["blocks"] and snap["events_published"] == 0
