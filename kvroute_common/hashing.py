"""Block hashing shared by the frontend, the indexer, the slot tracker and the mocker.

The layout is the reference router's (see docs/architecture.md):

* a prompt is cut into *full* blocks of ``block_size`` tokens (a partial tail is never hashed);
* each block's **local hash** is XXH3-64 over its tokens packed as u32 little-endian, with a seed
  of 1337 plus optional LoRA-name and cache-salt terms;
* the **sequence hash** chains them: ``seq[0] = local[0]``,
  ``seq[i] = xxh3(le64(seq[i-1]) || le64(local[i]), seed=1337)``.

JSON APIs carry hashes as signed i64 (two's complement); internally they are unsigned u64.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

from kvroute_common.constants import U64_MAX

BASE_SEED = 1337
U32_MAX = (1 << 32) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_pack_u64 = struct.Struct("<Q").pack
_LITTLE = sys.byteorder == "little"

# array typecode for a 4-byte unsigned int on this platform
_U32 = "I" if array("I").itemsize == 4 else "L"


def hash_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Seed for local block hashes; empty strings count as absent (as in the reference)."""
    seed = BASE_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode("utf-8"), 0)) & U64_MAX
    if cache_salt:
        seed = (seed + _xxh3(cache_salt.encode("utf-8"), 1)) & U64_MAX
    return seed


def mm_object_hash(identifier: str) -> int:
    """The u64 a multimodal object (an image) adds to the local hash of each block it overlaps.

    vLLM's identifiers are 64-hex-digit digests: their first 16 digits, read as hex (what the
    reference router takes from vLLM's ``extra_keys``). Any other identifier (a request's ``uuid``)
    is hashed to 64 bits."""
    if len(identifier) == 64:
        try:
            return int(identifier[:16], 16)
        except ValueError:
            pass
    return _xxh3(identifier.encode("utf-8"), 0)


def pack_tokens(tokens: Sequence[int] | bytes | memoryview) -> bytes:
    """Tokens as one u32-little-endian byte string (bulk conversion, never per token).

    Raises ValueError/OverflowError for ids outside u32.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return bytes(tokens)
    if isinstance(tokens, array) and tokens.typecode == _U32:
        buf = tokens
    else:
        try:
            buf = array(_U32, tokens)
        except OverflowError as exc:
            raise ValueError("token ids must be integers in [0, 4294967295]") from exc
        except TypeError as exc:
            raise ValueError("token ids must be integers") from exc
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        buf = array(_U32, buf)
        buf.byteswap()
    return buf.tobytes()


def token_array(tokens: Sequence[int]) -> array:
    """Token ids as a compact u32 array (hashed without a conversion; freed as one block)."""
    return array(_U32, tokens)


def local_block_hashes(
    tokens: Sequence[int] | bytes,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[Sequence[int] | None] | None = None,
    eagle: bool = False,
) -> list[int]:
    """Local (per-block, unchained) hashes of the full blocks of ``tokens``.

    ``mm_hashes[i]``, when given and non-empty, lists block i's multimodal object hashes; they are
    appended as sorted u64 little-endian (the 1.6.1 layout). ``eagle`` hashes windows of
    ``block_size + 1`` tokens with stride ``block_size``.
    """
    if block_size <= 0:
        raise ValueError("block_size must be greater than 0")
    data = pack_tokens(tokens)
    seed = hash_seed(lora_name, cache_salt)
    step = block_size * 4
    width = step + (4 if eagle else 0)
    n_tokens = len(data) // 4
    n_blocks = (n_tokens - (1 if eagle else 0)) // block_size if n_tokens else 0
    if n_blocks <= 0:
        return []
    view = memoryview(data)
    if mm_hashes is None:
        return [_xxh3(view[i : i + width], seed) for i in range(0, n_blocks * step, step)]
    out: list[int] = []
    for b in range(n_blocks):
        chunk = view[b * step : b * step + width]
        objs = mm_hashes[b] if b < len(mm_hashes) else None
        if objs:
            extra = b"".join(_pack_u64(h & U64_MAX) for h in sorted(h & U64_MAX for h in objs))
            out.append(_xxh3(bytes(chunk) + extra, seed))
        else:
            out.append(_xxh3(chunk, seed))
    return out


def sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chain local hashes into sequence hashes; ``parent`` continues an existing chain."""
    out: list[int] = []
    append = out.append
    prev = parent
    xxh3, pack = _xxh3, _pack_pair
    for h in local_hashes:
        prev = h if prev is None else xxh3(pack(prev, h), BASE_SEED)
        append(prev)
    return out


def block_hashes(
    tokens: Sequence[int] | bytes,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of a prompt: what the router computes per request."""
    local = local_block_hashes(tokens, block_size, lora_name, cache_salt)
    return local, sequence_hashes(local)


def to_i64(u: int) -> int:
    """u64 -> signed i64 (JSON form)."""
    return u - (1 << 64) if u >= (1 << 63) else u


def to_u64(i: int) -> int:
    """signed i64 (or any int that fits 64 bits) -> u64."""
    return i & U64_MAX


def list_to_i64(values: Sequence[int]) -> list[int]:
    return [v - (1 << 64) if v >= (1 << 63) else v for v in values]


def list_to_u64(values: Sequence[int]) -> list[int]:
    return [v & U64_MAX for v in values]
