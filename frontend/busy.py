"""Busy thresholds: exclude a worker from routing while all its DP ranks are overloaded.

A rank is overloaded when any configured check fires (the reference router's busy checks):
prefill tokens in flight > ``active_prefill_tokens_threshold``; prefill tokens in flight >
``floor(frac * max_num_batched_tokens)``; decode blocks in flight > ``threshold * total KV blocks``.
The loads are the frontend's own accounting (the embedded slot tracker). Thresholds are per model
and can be changed at runtime through ``/busy_threshold``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the reference's stand-in when a worker does not say how many tokens it batches
UNKNOWN_MAX_BATCHED_TOKENS = 10_000_000


@dataclass(slots=True)
class BusyThresholds:
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None

    @property
    def enabled(self) -> bool:
        return (
            self.active_decode_blocks_threshold is not None
            or self.active_prefill_tokens_threshold is not None
            or self.active_prefill_tokens_threshold_frac is not None
        )

    def to_dict(self, model: str) -> dict:
        """The router guide's /busy_threshold shape; the 1.6.1 ``_frac`` field only once it is set
        (the guide's examples show the two fields, the 1.6.1 binary adds the third)."""
        out = {
            "model": model,
            "active_decode_blocks_threshold": self.active_decode_blocks_threshold,
            "active_prefill_tokens_threshold": self.active_prefill_tokens_threshold,
        }
        if self.active_prefill_tokens_threshold_frac is not None:
            out["active_prefill_tokens_threshold_frac"] = self.active_prefill_tokens_threshold_frac
        return out

    def rank_overloaded(
        self,
        prefill_tokens: int,
        decode_blocks: int,
        total_kv_blocks: int | None,
        max_num_batched_tokens: int | None,
    ) -> bool:
        t = self.active_prefill_tokens_threshold
        if t is not None and prefill_tokens > t:
            return True
        f = self.active_prefill_tokens_threshold_frac
        if f is not None and prefill_tokens > math.floor(f * (max_num_batched_tokens or UNKNOWN_MAX_BATCHED_TOKENS)):
            return True
        d = self.active_decode_blocks_threshold
        if d is not None and total_kv_blocks and decode_blocks > d * total_kv_blocks:
            return True
        return False


def validate_update(decode: object, prefill: object, frac: object) -> None:
    """ValueError with the reason when a /busy_threshold update is out of range."""
    if decode is not None:
        if not isinstance(decode, (int, float)) or isinstance(decode, bool) or not math.isfinite(decode) or not 0.0 <= decode <= 1.0:
            raise ValueError("active_decode_blocks_threshold must be between 0.0 and 1.0")
    if prefill is not None:
        if not isinstance(prefill, int) or isinstance(prefill, bool) or prefill < 0:
            raise ValueError("active_prefill_tokens_threshold must be a non-negative integer")
    if frac is not None:
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not math.isfinite(frac) or frac < 0:
            raise ValueError("active_prefill_tokens_threshold_frac must be a non-negative finite number")
