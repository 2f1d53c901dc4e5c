"""HashShards behaves as one dict whatever the hashes (negative, past 64 bits, all in one shard)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_common.hash_shards import MASK, SHARDS, HashShards

_HASH = st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 5).map(lambda k: k * SHARDS))  # the latter: one shard
_OP = st.tuples(
    st.sampled_from(["set", "pop", "del", "set_all"]), st.lists(_HASH, min_size=1, max_size=6), st.integers()
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_OP, max_size=40))
def test_hash_shards_is_one_dict(ops: list[tuple[str, list[int], int]]) -> None:
    shards: HashShards[int] = HashShards()
    model: dict[int, int] = {}
    for op, hashes, value in ops:
        h = hashes[0]
        if op == "set":
            shards[h] = value
            model[h] = value
        elif op == "pop":
            assert shards.pop(h) == model.pop(h, None)
        elif op == "del":
            if h in model:
                del shards[h]
                del model[h]
        else:
            shards.set_all(hashes, value)
            model.update(dict.fromkeys(hashes, value))
        assert len(shards) == len(model)
        assert all((x in shards) == (x in model) and shards.get(x) == model.get(x) for x in hashes)
    assert dict(zip(shards.keys(), shards.values(), strict=True)) == model
    assert all(k & MASK == i for i, part in enumerate(shards.parts) for k in part)
