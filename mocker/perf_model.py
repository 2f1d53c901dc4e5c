"""How long a simulated forward pass takes: the reference mocker's default polynomial, or a GPU's
measured tables (mocker/gpu_profile.py) when a profile is given.

The polynomial: prefill ms = 4.209989e-7 * T^2 + 1.518344e-2 * T + 16.50142 for T uncached tokens
computed in the step (0 when nothing is prefilled), so prefix-cache hits cut time to first token;
decode ms = max(1, -25.74 p^2 + 54.01 p + 5.74) with p = active KV tokens / KV capacity, so
decoding slows down as the cache fills. Either is divided by the speedup ratio (0 = no delay).
"""

from __future__ import annotations

from collections.abc import Sequence

from mocker.gpu_profile import GpuProfile


class PerfModel:
    def __init__(self, speedup_ratio: float = 1.0, profile: GpuProfile | None = None) -> None:
        if speedup_ratio < 0:
            raise ValueError("speedup ratio must be >= 0")
        self.speedup_ratio = speedup_ratio
        self.profile = profile

    @staticmethod
    def prefill_ms(new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142

    @staticmethod
    def decode_ms(kv_fraction: float) -> float:
        p = min(max(kv_fraction, 0.0), 1.0)
        return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)

    def step_seconds(self, prefill_tokens: int, num_decodes: int, kv_fraction: float) -> float:
        """Wall time of one scheduler step by the polynomial, after the speedup ratio."""
        if self.speedup_ratio == 0:
            return 0.0
        ms = self.prefill_ms(prefill_tokens)
        if num_decodes:
            ms += self.decode_ms(kv_fraction)
        return ms / 1000.0 / self.speedup_ratio

    def step_time(
        self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int], kv_fraction: float
    ) -> float:
        """Wall time of one scheduler step of prefill chunks ``(new, cached)`` and decodes at
        ``decode_contexts`` (tokens in each one's KV), after the speedup ratio: by the profile when there
        is one, else by the polynomial (which sees only the step's new tokens and the cache's fill)."""
        if self.speedup_ratio == 0:
            return 0.0
        if self.profile is None:
            return self.step_seconds(sum(n for n, _ in prefills), len(decode_contexts), kv_fraction)
        return self.profile.step_ms(prefills, decode_contexts) / 1000.0 / self.speedup_ratio
