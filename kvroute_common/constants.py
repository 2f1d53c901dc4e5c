"""Wire constants shared by every service: integer ranges of the JSON and msgpack formats (ids and
hashes are u64 on the wire, i64 where the reference uses signed fields) and the default tenant."""

from __future__ import annotations

from typing import Annotated

import msgspec

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1  # also the mask that folds a Python int into u64
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
DEFAULT_TENANT = "default"  # the tenant (routing group) of requests and workers that name none

I64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # decoders check the upper bound after decoding (msgspec bounds are int64)
