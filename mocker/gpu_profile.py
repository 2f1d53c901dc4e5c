"""Step times from a GPU's measured tables (``python -m mocker --perf-profile``), instead of the polynomial.

A profile (mocker/profiles/*.json) holds one model's measured forward passes on one GPU: prefill time by
new and cached tokens (one sequence), decode-step time by batch and context per sequence, and the GPU's
memory and bandwidth. A simulated step is priced as its parts: every prefill chunk in the batch at its own
new and cached tokens, the step's decodes as one decode step of that batch at their mean context (the KV
read is the same), summed, less one read of the weights for every part beyond the first (the parts share
the step's weight reads). Between measured points the tables are interpolated linearly; beyond them they
are extended along their last segment (a decode batch beyond the measured ones grows by at least the
bandwidth cost of reading each extra sequence's KV). Below the smallest measured prefill, the time runs
linearly down to a one-sequence decode step at the same context.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
GIB = 1024**3


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending, extended along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class _Row:
    """One measured row of a table: at ``key`` (cached tokens, or context), ms by ``xs`` (new tokens, or batch)."""

    key: int
    xs: tuple[int, ...]
    ms: tuple[float, ...]


def _rows(points: Sequence[Sequence[float]]) -> list[_Row]:
    by_key: dict[int, list[tuple[int, float]]] = {}
    for key, x, ms in points:
        by_key.setdefault(int(key), []).append((int(x), float(ms)))
    rows = []
    for key in sorted(by_key):
        pts = sorted(by_key[key])
        rows.append(_Row(key, tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
    return rows


class GpuProfile:
    """One model's measured step times on one GPU (see the module doc for how a step is priced)."""

    def __init__(self, data: dict, source: str = "") -> None:
        try:
            self.name = str(data.get("name") or source)
            self.provenance = str(data["provenance"])
            self.gpu = str(data["gpu"])
            self.gpu_mem_gib = float(data["gpu_mem_gib"])
            self.hbm_bytes_per_ms = float(data["hbm_tb_s"]) * 1e12 / 1e3
            shape = data["shape"]
            self.weights_gib = float(shape["weights_gib"])
            self.kv_bytes_per_token = int(shape["kv_bytes_per_token"])
            self._prefill = _rows([(c, n, ms) for c, n, ms in data["prefill"]])
            self._decode = _rows([(ctx, b, ms) for b, ctx, ms in data["decode"]])
            self.mixed = [tuple(p) for p in data.get("mixed", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"perf profile {source or '?'}: not a GPU profile ({exc!r})") from None
        if not self._prefill or not self._decode or any(len(r.xs) < 2 for r in self._prefill):
            raise ValueError(f"perf profile {source}: needs prefill rows of two or more points and decode points")
        if self.weights_gib >= self.gpu_mem_gib:
            raise ValueError(f"perf profile {source}: the weights do not fit in the GPU's memory")

    @classmethod
    def load(cls, name_or_path: str) -> GpuProfile:
        """A shipped profile by name (``h200-qwen2.5-32b``) or a JSON file."""
        path = name_or_path
        if not os.path.exists(path):
            path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
        if not os.path.exists(path):
            raise ValueError(f"perf profile {name_or_path!r}: no such file, nor one of {', '.join(shipped())}")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"perf profile {path}: not JSON ({exc})") from None
        return cls(data, path)

    # -- the tables -----------------------------------------------------------------------------------
    @property
    def weight_read_ms(self) -> float:
        """One read of the weights from HBM: what the parts of a mixed step share."""
        return self.weights_gib * GIB / self.hbm_bytes_per_ms

    def kv_capacity_tokens(self) -> int:
        """KV tokens the GPU holds: its memory less the weights."""
        return int((self.gpu_mem_gib - self.weights_gib) * GIB // self.kv_bytes_per_token)

    def prefill_ms(self, new: int, cached: int) -> float:
        """One prefill pass of ``new`` tokens after ``cached`` (interpolated in both)."""
        if new <= 0:
            return 0.0
        low = self._prefill[0].xs[0]
        if new < low:  # down to a one-token pass, i.e. a one-sequence decode step at this context
            one = self.decode_ms(1, max(cached, 1))
            return one + (self.prefill_ms(low, cached) - one) * (new - 1) / max(low - 1, 1)
        keys = [r.key for r in self._prefill]
        at = [_interp(r.xs, r.ms, new) for r in self._prefill]
        return _interp(keys, at, cached)

    def decode_ms(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each (mean context)."""
        if batch <= 0:
            return 0.0
        keys = [r.key for r in self._decode]
        at = [self._decode_row(r, batch) for r in self._decode]
        return _interp(keys, at, context)

    def _decode_row(self, row: _Row, batch: int) -> float:
        if batch <= row.xs[-1] or len(row.xs) == 1:
            return _interp(row.xs, row.ms, batch) if len(row.xs) > 1 else row.ms[0]
        # beyond the measured batches: at least the bandwidth cost of each extra sequence's KV
        slope = (row.ms[-1] - row.ms[-2]) / (row.xs[-1] - row.xs[-2])
        per_seq = max(slope, row.key * self.kv_bytes_per_token / self.hbm_bytes_per_ms)
        return row.ms[-1] + per_seq * (batch - row.xs[-1])

    def step_ms(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """A step of prefill chunks ``(new, cached)`` and decodes at ``decode_contexts``: the sum of the
        parts less one weight read for every part beyond the first."""
        parts = [self.prefill_ms(new, cached) for new, cached in prefills if new > 0]
        if decode_contexts:
            parts.append(self.decode_ms(len(decode_contexts), sum(decode_contexts) / len(decode_contexts)))
        if not parts:
            return 0.0
        return sum(parts) - self.weight_read_ms * (len(parts) - 1)


def shipped() -> list[str]:
    """The profiles in mocker/profiles, by name."""
    return sorted(f[: -len(".json")] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
