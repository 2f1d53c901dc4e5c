"""Golden tests: worked examples of the block-hash layout, confirmed on the 1.6.1 binaries."""

import pytest

from kvroute_common.hashing import (
    hash_seed,
    list_to_i64,
    list_to_u64,
    local_block_hashes,
    sequence_hashes,
    to_i64,
    to_u64,
)


def test_ex1_plain_two_blocks() -> None:
    local = local_block_hashes(list(range(32)), 16)
    assert local == [15310707395893867146, 15292316782987903195]
    seq = sequence_hashes(local)
    assert seq == [15310707395893867146, 13769157705258532664]
    assert list_to_i64(local) == [-3136036677815684470, -3154427290721648421]
    assert list_to_i64(seq) == [-3136036677815684470, -4677586368451018952]


def test_ex2_partial_tail_ignored_and_third_block() -> None:
    assert local_block_hashes(list(range(40)), 16) == local_block_hashes(list(range(32)), 16)
    tokens = list(range(48)) + [1, 2, 3]
    local = local_block_hashes(tokens, 16)
    assert local[2] == 5532946206955930018
    seq = sequence_hashes(local)
    assert seq[2] == 11879827756109914528
    assert list_to_i64(seq) == [-3136036677815684470, -4677586368451018952, -6566916317599637088]


def test_ex3_lora_seed() -> None:
    assert hash_seed("foo") == 12352915711150949059
    local = local_block_hashes(list(range(32)), 16, lora_name="foo")
    assert local == [13505459615202993533, 12002954021595949192]
    assert sequence_hashes(local) == [13505459615202993533, 15546473939242864064]


def test_ex4_cache_salt_seed() -> None:
    assert hash_seed(cache_salt="bar") == 13168935522554863413
    local = local_block_hashes(list(range(32)), 16, cache_salt="bar")
    assert local == [8618256885452571372, 10735446356362163534]
    assert sequence_hashes(local) == [8618256885452571372, 12069432123234362774]


def test_ex5_lora_and_salt() -> None:
    assert hash_seed("foo", "bar") == 7075107159996259519
    assert local_block_hashes(list(range(32)), 16, "foo", "bar") == [4129395977714638644, 10600381774126862256]


def test_empty_strings_are_absent() -> None:
    assert local_block_hashes(list(range(32)), 16, "", "") == local_block_hashes(list(range(32)), 16)


def test_ex6_block_size_32() -> None:
    local = local_block_hashes(list(range(64)), 32)
    assert local == [5756925433886871916, 13958166640625465031]
    assert sequence_hashes(local)[1] == 16658382216643214443


def test_ex7_eagle_windows() -> None:
    assert local_block_hashes(list(range(33)), 16, eagle=True) == [11423441316381344367, 6554946393898374776]
    assert len(local_block_hashes(list(range(32)), 16, eagle=True)) == 1


def test_ex8_multimodal_sorted_unsigned() -> None:
    mm = [[(1 << 63) + 7, 5]]
    assert local_block_hashes(list(range(16)), 16, mm_hashes=mm) == [14382495165935072367]


def test_sequence_chain_continues_from_parent() -> None:
    local = local_block_hashes(list(range(64)), 16)
    full = sequence_hashes(local)
    assert sequence_hashes(local[2:], parent=full[1]) == full[2:]


def test_signed_unsigned_roundtrip() -> None:
    for u in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert to_u64(to_i64(u)) == u
    assert list_to_u64([-1, 5]) == [(1 << 64) - 1, 5]


@pytest.mark.parametrize("bad", [[-1], [1 << 32], ["x"]])
def test_invalid_token_ids_rejected(bad: list) -> None:
    with pytest.raises(ValueError):
        local_block_hashes(bad * 16, 16)


def test_block_size_zero_rejected() -> None:
    with pytest.raises(ValueError):
        local_block_hashes([1, 2, 3], 0)
