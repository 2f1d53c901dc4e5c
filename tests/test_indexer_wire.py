"""indexer/wire.py: vLLM 0.33's exact bytes, map- and array-form decoding, whole-batch rejection."""

from __future__ import annotations

import msgspec
import pytest

from indexer.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode_batch,
    encode_batch,
    encode_batch_legacy,
    parse_seq,
    seq_frame,
)

BIG = (1 << 64) - 5  # engine hashes >= 2**63 are common (low 64 bits of a digest)


def _stored(**kw) -> BlockStored:
    args = dict(
        block_hashes=[1, BIG],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    args.update(kw)
    return BlockStored(**args)


def test_encoding_is_vllm_033_layout() -> None:
    payload = encode_batch([_stored(), BlockRemoved([5], "CPU"), AllBlocksCleared()], 2, ts=1.5)
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[2] == 2 and len(raw) == 3  # array_like batch [ts, events, dp_rank]
    stored, removed, cleared = raw[1]
    # tagged map-form events; defaulted trailing fields omitted (omit_defaults), required ones kept
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [1, BIG]
    assert removed == {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    full = msgspec.msgpack.decode(
        encode_batch([_stored(group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL")], 0)
    )
    assert list(full[1][0])[-3:] == ["group_idx", "kv_cache_spec_kind", "locality"]


def test_map_form_round_trip() -> None:
    batch = decode_batch(
        encode_batch(
            [
                _stored(medium="CPU", lora_name="a", parent_block_hash=BIG - 1),
                BlockRemoved([BIG], None),
                AllBlocksCleared(),
            ],
            3,
            ts=2.0,
        )
    )
    assert batch.ts == 2.0 and batch.dp_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, Stored) and stored.block_hashes == [1, BIG] and stored.parent_block_hash == BIG - 1
    assert (
        stored.token_ids == list(range(32))
        and stored.block_size == 16
        and stored.medium == "CPU"
        and stored.lora_name == "a"
    )
    assert isinstance(removed, Removed) and removed.block_hashes == [BIG]
    assert isinstance(cleared, Cleared)


def test_array_form_and_mixed_batches_decode() -> None:
    legacy = decode_batch(encode_batch_legacy([_stored(), BlockRemoved([7], "DISK"), AllBlocksCleared()], 1, ts=0.5))
    assert [type(e) for e in legacy.events] == [Stored, Removed, Cleared] and legacy.dp_rank == 1
    assert legacy.events[1].medium == "DISK"
    mixed = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [9], None, list(range(16)), 16],  # 5 elements: no lora_id slot
                {"type": "BlockRemoved", "block_hashes": [9], "unknown_key": {"x": 1}},
                [
                    "BlockStored",
                    [10],
                    9,
                    list(range(16)),
                    16,
                    None,
                    "GPU",
                    None,
                    None,
                    0,
                    "full_attention",
                    None,
                    "LOCAL",
                    "x",
                ],
                ["AllBlocksCleared", "extra"],
                ["Ignored"],
            ],
            None,
        ]
    )
    batch = decode_batch(mixed)
    assert [type(e) for e in batch.events] == [Stored, Removed, Stored, Cleared]
    assert batch.dp_rank is None
    assert batch.events[2].parent_block_hash == 9 and batch.events[2].kv_cache_spec_kind == "full_attention"
    assert batch.events[2].locality == "LOCAL" and batch.events[2].group_idx == 0


def test_negative_hashes_are_reinterpreted_as_u64() -> None:
    batch = decode_batch(msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [-1]}], 0]))
    assert batch.events[0].block_hashes == [(1 << 64) - 1]


def test_eagle_token_pairs_are_flattened() -> None:
    pairs = [[i, i + 1] for i in range(16)]
    batch = decode_batch(
        msgspec.msgpack.encode(
            [0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": pairs, "block_size": 16}], 0]
        )
    )
    ev = batch.events[0]
    assert ev.eagle and ev.token_ids == list(range(17))


def test_map_form_extras_salt_and_mm_infos() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": list(range(16)),
        "block_size": 16,
        "cache_salt": "tenant-a",
        "block_mm_infos": [{"mm_objects": [{"mm_hash": 42, "offsets": [[0, 3]]}]}],
    }
    stored = decode_batch(msgspec.msgpack.encode([0.0, [ev], 0])).events[0]
    assert stored.cache_salt == "tenant-a" and stored.mm_hashes == [[42]]


@pytest.mark.parametrize(
    "events",
    [
        [{"type": "BlockStored", "block_hashes": [b"\x01" * 32], "token_ids": [1], "block_size": 16}],  # bytes hash
        [{"type": "Mystery"}],
        [{"type": "BlockStored", "block_hashes": [1], "block_size": 16}],  # token_ids missing
        [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 16}],
        [["BlockStored", [1], None]],  # too short
        [["Nope"]],
        [42],
    ],
)
def test_any_bad_event_rejects_the_whole_batch(events: list) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    with pytest.raises(WireError):
        decode_batch(msgspec.msgpack.encode([0.0, [good, *events], 0]))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"ts": 0.0, "events": []}),
        msgspec.msgpack.encode([0.0, [], 0, 1]),
        msgspec.msgpack.encode("x"),
    ],
)
def test_malformed_batches_are_rejected(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_two_element_batches_are_accepted_as_unranked() -> None:
    """Historical SGLang sends [ts, events] (the reference drops these; we take them, rank unset)."""
    batch = decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [3]]]]))
    assert batch.dp_rank is None and batch.events[0].block_hashes == [3]


def test_sequence_frames() -> None:
    assert seq_frame(1) == b"\x00" * 7 + b"\x01"
    assert parse_seq(seq_frame(2**40 + 3)) == 2**40 + 3
    assert REPLAY_END_SEQ == b"\xff" * 8
    with pytest.raises(ValueError):
        parse_seq(b"\x00" * 4)
