"""The engines' ZMQ KV-event wire format (vLLM 0.33 and older vLLM / SGLang), encode and decode.

Encoding reproduces vLLM 0.33's bytes exactly: the batch is an ``array_like`` struct
``[ts, events, data_parallel_rank]`` and every event is a tagged *map* (key ``type``) with its
field names as keys, defaulted trailing fields omitted (``omit_defaults``). The mocker publishes
with :func:`encode_batch`, so the events it sends are the ones a real vLLM would send.

Decoding is deliberately more liberal than one producer: older vLLM and SGLang send *array-form*
events (``["BlockStored", hashes, parent, tokens, ...]``), newer ones map-form, and a batch may
mix both. Unknown map keys are ignored. Any event that does not decode makes the whole batch fail
(:class:`WireError`), because applying half a batch would leave the index and the sequence
watermark disagreeing about what was applied.

Live messages are three frames ``[topic, seq (8 bytes big-endian), payload]``. A replay answers
``[b"", topic, seq, payload]`` per buffered batch then ``[b"", b"", REPLAY_END_SEQ, b""]``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvroute_common.constants import U64_MAX

U32_MAX = (1 << 32) - 1

REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame vLLM sends (with an empty payload) after the last replayed batch."""


def seq_frame(n: int) -> bytes:
    """The 8-byte big-endian sequence frame of batch ``n``."""
    return n.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """Sequence number of an 8-byte frame; ValueError for any other length."""
    if len(frame) != 8:
        raise ValueError(f"Invalid sequence number length: {len(frame)}")
    return int.from_bytes(frame, "big")


# --------------------------------------------------------------------------------------------
# vLLM 0.33 structs (what an engine publishes). Field order and names follow
# vllm/distributed/kv_events.py of vLLM 0.33.0; do not reorder.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged, map-form events (tag key ``type`` = class name)."""


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


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: Sequence[KVCacheEvent], dp_rank: int | None, ts: float | None = None) -> bytes:
    """Exactly the payload vLLM 0.33 publishes for ``events`` (dp rank filled in, as its publisher does)."""
    return _encoder.encode(EventBatch(time.time() if ts is None else ts, list(events), dp_rank))


# Positional layout of the legacy (array_like + tag) events of older vLLM / SGLang.
_LEGACY_REQUIRED = {"BlockStored": 6, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _legacy_event(event: KVCacheEvent) -> list[Any]:
    tag = type(event).__name__
    values = list(msgspec.structs.astuple(event))
    required = _LEGACY_REQUIRED[tag]
    while len(values) > required and values[-1] is None:  # omit_defaults drops trailing defaults
        values.pop()
    return [tag, *values]


def encode_batch_legacy(events: Sequence[KVCacheEvent], dp_rank: int | None, ts: float | None = None) -> bytes:
    """The same batch with array-form events, as older vLLM and SGLang send them."""
    return _encoder.encode([time.time() if ts is None else ts, [_legacy_event(e) for e in events], dp_rank])


# --------------------------------------------------------------------------------------------
# Decoded (normalised) events: what the listener turns into index operations.


class Stored(msgspec.Struct, gc=False):
    """A BlockStored with hashes as u64 and Eagle pairs flattened (``eagle`` set)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None
    mm_hashes: list[list[int] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None
    eagle: bool = False


class Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """A BlockRemoved with hashes as u64. Map-form events decode straight into it (unknown keys ignored):
    an engine evicting a long prompt sends one per block, hundreds a batch."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class Cleared(msgspec.Struct, gc=False):
    pass


class DecodedBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    dp_rank: int | None


class WireError(ValueError):
    """The payload is not a valid event batch; the whole batch must be dropped."""


# Map-form decoding structs: unknown keys are ignored (msgspec's default).
Hash = int  # msgspec ints cover i64 and u64; reinterpreted as u64 below
Token = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]


class _MMObject(msgspec.Struct, gc=False):
    mm_hash: int
    offsets: list[Any] | None = None


class _MMInfo(msgspec.Struct, gc=False):
    mm_objects: list[_MMObject] = []


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[Hash]
    token_ids: msgspec.Raw
    block_size: int
    parent_block_hash: Hash | None = None
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None
    block_mm_infos: list[_MMInfo | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class _StoredMapTyped(_StoredMap, tag="BlockStored", tag_field="type", gc=False):
    """_StoredMap with plain token ids: lets a whole map-form batch decode in one pass."""

    # overrides the Raw field in place (same position, same tag); msgspec decodes by the subclass's type
    token_ids: list[Token]  # type: ignore[assignment]


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _IgnoredMap(msgspec.Struct, tag="Ignored", tag_field="type", gc=False):
    pass


_batch3 = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw], int | None])
_batch_typed = msgspec.msgpack.Decoder(
    tuple[float, list[_StoredMapTyped | Removed | _ClearedMap | _IgnoredMap], int | None]
)
_batch2 = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw]])
_map_event = msgspec.msgpack.Decoder(_StoredMap | Removed | _ClearedMap | _IgnoredMap)
_any = msgspec.msgpack.Decoder()
_tokens = msgspec.msgpack.Decoder(list[Token])
_token_pairs = msgspec.msgpack.Decoder(list[tuple[Token, Token]])
_hash_list = list[Hash]


def _is_map(raw: msgspec.Raw) -> bool:
    if not len(raw):
        return False
    first = memoryview(raw)[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _decode_tokens(raw: bytes | msgspec.Raw) -> tuple[list[int], bool]:
    try:
        return _tokens.decode(raw), False
    except msgspec.ValidationError:
        pairs = _token_pairs.decode(raw)  # raises if neither form
        if not pairs:
            return [], False
        tokens = [p[0] for p in pairs]
        tokens.append(pairs[-1][1])
        return tokens, True


def _u64s(values: list[int]) -> list[int]:
    return [v & U64_MAX for v in values]


def _normalised(ev: Any, tokens: list[int], eagle: bool) -> Stored | Removed | Cleared | None:
    t = type(ev)
    if t is _StoredMapTyped or t is _StoredMap:
        mm = None
        if ev.block_mm_infos:
            mm = [[o.mm_hash & U64_MAX for o in info.mm_objects] if info else None for info in ev.block_mm_infos]
        parent = ev.parent_block_hash
        hashes = ev.block_hashes
        if hashes and min(hashes) < 0:
            hashes = _u64s(hashes)
        return Stored(
            hashes,
            None if parent is None else parent & U64_MAX,
            tokens,
            ev.block_size,
            ev.medium,
            ev.lora_name,
            ev.cache_salt,
            ev.extra_keys,
            mm,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.locality,
            eagle,
        )
    if t is Removed:
        hashes = ev.block_hashes
        if hashes and min(hashes) < 0:
            ev.block_hashes = _u64s(hashes)
        return ev
    if t is _ClearedMap:
        return Cleared()
    return None  # "Ignored"


def _from_map(raw: msgspec.Raw) -> Stored | Removed | Cleared | None:
    ev = _map_event.decode(raw)
    if type(ev) is _StoredMap:
        tokens, eagle = _decode_tokens(ev.token_ids)
        return _normalised(ev, tokens, eagle)
    return _normalised(ev, [], False)


def _opt(values: list[Any], i: int, kind: type | tuple[type, ...], what: str) -> Any:
    if i >= len(values) or values[i] is None:
        return None
    v = values[i]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise WireError(f"array event field {what} has the wrong type")
    return v


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise WireError("block_hashes must be an array")
    try:
        return _u64s(msgspec.convert(v, _hash_list))
    except msgspec.ValidationError as exc:
        raise WireError(f"bad block hash: {exc}") from None


def _from_array(raw: msgspec.Raw) -> Stored | Removed | Cleared | None:
    values = _any.decode(raw)
    if not isinstance(values, list) or not values or not isinstance(values[0], str):
        raise WireError("event is neither a tagged map nor a tagged array")
    tag = values[0]
    if tag == "BlockStored":
        if len(values) < 5:
            raise WireError("array BlockStored needs block_hashes, parent, token_ids and block_size")
        hashes = _hashes(values[1])
        parent = values[2]
        if parent is not None:
            if not isinstance(parent, int) or isinstance(parent, bool):
                raise WireError("parent_block_hash must be an integer")
            parent &= U64_MAX
        tokens, eagle = _decode_tokens(_encoder.encode(values[3]))
        block_size = values[4]
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise WireError("block_size must be an integer")
        medium = _opt(values, 6, str, "medium")
        lora_name = None
        cache_salt = None
        slot7 = values[7] if len(values) > 7 else None
        if isinstance(slot7, dict):  # SGLang "dynamo" format: metadata map in position 7
            salt = slot7.get("cache_salt")
            cache_salt = salt if isinstance(salt, str) else None
            name = slot7.get("lora_name")
            lora_name = name if isinstance(name, str) else None
        else:
            lora_name = _opt(values, 7, str, "lora_name")
        extra = _opt(values, 8, list, "extra_keys")
        group_idx = _opt(values, 9, int, "group_idx")
        kind = _opt(values, 10, str, "kv_cache_spec_kind")
        locality = _opt(values, 12, str, "locality")
        return Stored(
            hashes,
            parent,
            tokens,
            block_size,
            medium,
            lora_name,
            cache_salt,
            extra,
            None,
            group_idx,
            kind,
            locality,
            eagle,
        )
    if tag == "BlockRemoved":
        if len(values) < 2:
            raise WireError("array BlockRemoved needs block_hashes")
        return Removed(
            _hashes(values[1]),
            _opt(values, 2, str, "medium"),
            _opt(values, 3, int, "group_idx"),
            _opt(values, 4, str, "locality"),
        )
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "Ignored":
        return None
    raise WireError(f"unknown event type {tag!r}")


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload; WireError if the batch or ANY of its events is malformed."""
    try:
        ts, typed, dp_rank = _batch_typed.decode(payload)  # vLLM's map-form events: one pass
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass  # array-form or Eagle events, a 2-element batch, or garbage: the general path decides
    else:
        normalised: list[Stored | Removed | Cleared] = []
        for item in typed:
            if type(item) is Removed:
                hashes = item.block_hashes
                if hashes and min(hashes) < 0:
                    item.block_hashes = _u64s(hashes)
                normalised.append(item)
                continue
            out = _normalised(item, item.token_ids if type(item) is _StoredMapTyped else [], False)
            if out is not None:
                normalised.append(out)
        return DecodedBatch(ts, normalised, dp_rank)
    try:
        try:
            ts, raw_events, dp_rank = _batch3.decode(payload)
        except msgspec.ValidationError:
            # Historical SGLang batches carry no dp rank: [ts, events].
            ts, raw_events = _batch2.decode(payload)
            dp_rank = None
        events: list[Stored | Removed | Cleared] = []
        for raw in raw_events:
            ev = _from_map(raw) if _is_map(raw) else _from_array(raw)
            if ev is not None:
                events.append(ev)
    except WireError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise WireError(str(exc)) from None
    return DecodedBatch(ts, events, dp_rank)
