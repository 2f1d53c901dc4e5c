"""Per-key rate limits: requests per second and tokens per minute per API key, each a token bucket.

Who is limited: with ``--api-key`` set, each key (the bearer token the client authenticated with; an
admin token used on ``/v1/*`` counts as a key) has its own buckets, sized by its ``--rate-limit-key``
entry or else by the defaults (``--rate-limit-rps`` / ``--rate-limit-tpm``); every other request
(no keys configured, or a token that is not a known key) shares one ``anonymous`` bucket pair with
the default sizes. Keys are named by their *key id*, the first 12 hex digits of the key's SHA-256,
in flags and in ``/metrics``: the secret never appears in either.

The rule, checked once per request after its prompt is tokenized and before anything is routed,
queued or sent to an engine:

- **requests**: a bucket of ``burst`` requests refilled at ``rps`` per second; a request takes one.
- **tokens**: a bucket of ``token_burst`` tokens (default one minute's worth) refilled at ``tpm / 60``
  per second. A request is admitted when the bucket holds at least its prompt tokens (or is full: a
  prompt larger than the bucket passes only then); its prompt tokens are taken at admission and its
  output tokens when the request ends (the tokens its lease counted: the engine's
  ``usage.completion_tokens`` for an answer that arrives whole, one per token event of a stream), so
  the bucket may go below zero and the key waits until it refills.
- Both buckets are checked before either is taken: a refused request costs nothing. A refusal is a 429
  with ``Retry-After`` (whole seconds, at least 1: when the refusing bucket will hold what the request
  needs) in the API's error shape, counted in ``kvroute_rate_limited_requests_total{key,limit}``.

The buckets live in each frontend process: with replicas (or ``--workers N``) a key's limit applies
per process.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from kvroute_common.openai_api import OpenAIError
from kvroute_common.security import bearer_token

if TYPE_CHECKING:
    from frontend.dispatch.lifecycle import Lease

ANONYMOUS = "anonymous"
KEY_ID_HEX = 12
RATE_LIMITED_STATUS = 429


def key_id(key: str | bytes) -> str:
    """The public name of an API key: the first 12 hex digits of its SHA-256."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX]


@dataclass(frozen=True)
class Limit:
    """One key's sizes; None = that dimension is not limited."""

    rps: float | None = None
    burst: float | None = None  # requests; default: one second's worth (at least 1)
    tpm: float | None = None
    token_burst: float | None = None  # tokens; default: one minute's worth

    def __post_init__(self) -> None:
        for name in ("rps", "burst", "tpm", "token_burst"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name.replace('_', '-')} must be a positive number, got {value}")

    @property
    def request_capacity(self) -> float:
        if self.burst is not None:
            return self.burst
        return max(1.0, math.ceil(self.rps or 1.0))

    @property
    def token_capacity(self) -> float:
        return self.token_burst if self.token_burst is not None else (self.tpm or 0.0)

    @property
    def limited(self) -> bool:
        return self.rps is not None or self.tpm is not None


def parse_limit(text: str, flag: str = "--rate-limit-key") -> tuple[str, Limit]:
    """``KEY_ID:rps=R,burst=B,tpm=T,token-burst=N`` (any subset of the sizes) -> (key id, Limit)."""
    kid, sep, spec = text.partition(":")
    kid = kid.strip().lower()
    if not sep or len(kid) != KEY_ID_HEX or any(c not in "0123456789abcdef" for c in kid):
        raise ValueError(
            f"{flag} {text!r}: expected KEY_ID:rps=R,burst=B,tpm=T,token-burst=N with KEY_ID the first "
            f"{KEY_ID_HEX} hex digits of the key's SHA-256"
        )
    sizes: dict[str, float] = {}
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        field = name.strip().replace("-", "_")
        if not eq or field not in ("rps", "burst", "tpm", "token_burst"):
            raise ValueError(f"{flag} {text!r}: unknown size {name.strip()!r} (rps, burst, tpm, token-burst)")
        try:
            sizes[field] = float(value)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {name.strip()} is not a number") from None
    try:
        limit = Limit(**sizes)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None
    if not limit.limited:
        raise ValueError(f"{flag} {text!r}: give rps or tpm")
    return kid, limit


class Bucket:
    """A token bucket: ``capacity`` at most, refilled at ``rate`` per second; may go below zero."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity, self.level, self.stamp = rate, capacity, capacity, now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.level

    def wait(self, need: float) -> float:
        """Seconds until the bucket holds ``need`` (0 when it does); call after ``refill``."""
        return 0.0 if self.level >= need else (need - self.level) / self.rate


class RateLimited(OpenAIError):
    """A 429 with its ``Retry-After`` header (the request path answers it in the API's shape)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(RATE_LIMITED_STATUS, message)
        self.headers = {"retry-after": str(retry_after)}


class KeyState:
    """One key's buckets; also the lease hook that charges the output tokens when the request ends."""

    __slots__ = ("kid", "requests", "tokens", "clock")

    def __init__(self, kid: str, limit: Limit, now: float, clock: Callable[[], float]) -> None:
        self.kid = kid
        self.clock = clock
        self.requests = Bucket(limit.rps, limit.request_capacity, now) if limit.rps is not None else None
        self.tokens = Bucket(limit.tpm / 60.0, limit.token_capacity, now) if limit.tpm is not None else None

    def on_tokens(self, lease: Lease, n: int) -> None:
        pass

    def on_release(self, lease: Lease) -> None:
        if self.tokens is not None and lease.tokens_out:
            self.tokens.refill(self.clock())
            self.tokens.level -= lease.tokens_out


class RateLimits:
    """The frontend's buckets (one pair per known key, one for everything else) and its 429 counter."""

    def __init__(
        self,
        default: Limit | None,
        per_key: Mapping[str, Limit],
        known_digests: Iterable[bytes],
        registry: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``known_digests``: SHA-256 digests of the accepted bearer tokens (API keys and admin tokens)
        when ``--api-key`` is set, else empty (every request is anonymous)."""
        self.default = default
        self.per_key = dict(per_key)
        self._ids = {d: d.hex()[:KEY_ID_HEX] for d in known_digests}
        unknown = set(self.per_key) - set(self._ids.values())
        if unknown:
            raise ValueError(
                f"--rate-limit-key names key ids that are no --api-key / --admin-token: {', '.join(sorted(unknown))}"
            )
        self._keys: dict[str, KeyState] = {}
        self.clock = clock
        self.refused = Counter(
            "kvroute_rate_limited_requests",
            "Requests refused with 429 by the per-key rate limits, by key id (SHA-256 prefix) and limit",
            ("key", "limit"),
            registry=registry,
        )

    def key_of(self, headers: Mapping[str, str]) -> str:
        """The key id a request's ``Authorization: Bearer`` names, ``anonymous`` for anything else."""
        if not self._ids:
            return ANONYMOUS
        header = headers.get("authorization")
        token = bearer_token(header.encode("latin-1")) if header else None
        if token is None:
            return ANONYMOUS
        return self._ids.get(hashlib.sha256(token).digest(), ANONYMOUS)

    def _state(self, kid: str, now: float) -> KeyState | None:
        state = self._keys.get(kid)
        if state is None:
            limit = self.per_key.get(kid, self.default)
            if limit is None or not limit.limited:
                return None
            state = self._keys[kid] = KeyState(kid, limit, now, self.clock)
        return state

    def admit(self, headers: Mapping[str, str], prompt_tokens: int) -> KeyState | None:
        """Take one request and the prompt's tokens from the request's key, or raise ``RateLimited``.
        Returns the key's state (the lease hook charging the output tokens), None when unlimited."""
        now = self.clock()
        kid = self.key_of(headers)
        state = self._state(kid, now)
        if state is None:
            return None
        wait, limit = 0.0, ""
        req, tok = state.requests, state.tokens
        if req is not None:
            req.refill(now)
            wait, limit = req.wait(1.0), "requests"
        if tok is not None:
            tok.refill(now)
            need = min(float(prompt_tokens), tok.capacity)
            token_wait = tok.wait(need)
            if token_wait > wait:
                wait, limit = token_wait, "tokens"
        if wait > 0.0:
            self.refused.labels(kid, limit).inc()
            what = "requests per second" if limit == "requests" else "tokens per minute"
            raise RateLimited(f"Rate limit reached for key {kid} ({what}); retry later", max(1, math.ceil(wait)))
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens
        return state


# -- command line --------------------------------------------------------------------------------


def _positive(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value!r}")
    return x


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def add_rate_limit_args(parser: argparse.ArgumentParser) -> None:
    """``--rate-limit-rps``, ``--rate-limit-burst``, ``--rate-limit-tpm``, ``--rate-limit-token-burst``
    (the default for every key and for anonymous requests) and ``--rate-limit-key`` (one key's own)."""
    g = parser.add_argument_group("rate limits (per API key; per frontend process)")
    g.add_argument(
        "--rate-limit-rps",
        type=_positive,
        default=_env("KVROUTE_RATE_LIMIT_RPS"),
        metavar="R",
        help="requests per second per API key (each key without its own --rate-limit-key, and anonymous "
        "requests together), answered 429 with Retry-After beyond it [env KVROUTE_RATE_LIMIT_RPS; default: none]",
    )
    g.add_argument(
        "--rate-limit-burst",
        type=_positive,
        default=_env("KVROUTE_RATE_LIMIT_BURST"),
        metavar="N",
        help="requests a key may send at once above --rate-limit-rps (the bucket's size) "
        "[env KVROUTE_RATE_LIMIT_BURST; default: one second's worth, at least 1]",
    )
    g.add_argument(
        "--rate-limit-tpm",
        type=_positive,
        default=_env("KVROUTE_RATE_LIMIT_TPM"),
        metavar="T",
        help="tokens per minute per API key: prompt tokens at admission, output tokens when the request ends "
        "[env KVROUTE_RATE_LIMIT_TPM; default: none]",
    )
    g.add_argument(
        "--rate-limit-token-burst",
        type=_positive,
        default=_env("KVROUTE_RATE_LIMIT_TOKEN_BURST"),
        metavar="N",
        help="tokens a key may use at once (the token bucket's size) [env KVROUTE_RATE_LIMIT_TOKEN_BURST; "
        "default: one minute's worth]",
    )
    g.add_argument(
        "--rate-limit-key",
        action="append",
        default=None,
        metavar="KEY_ID:SIZES",
        help="one key's own limits, e.g. 3f2a9c0b7d41:rps=5,burst=10,tpm=60000,token-burst=20000 (KEY_ID: the first "
        '12 hex digits of the key\'s SHA-256, `printf %%s "$KEY" | sha256sum | cut -c1-12`; repeatable) '
        "[env KVROUTE_RATE_LIMIT_KEYS, space-separated]",
    )


def rate_limits_from_args(ns: argparse.Namespace, known_digests: Iterable[bytes], registry: Any) -> RateLimits | None:
    """The limits the flags ask for, None when none is set (nothing is checked: the no-limit path costs
    one attribute test per request)."""
    entries = ns.rate_limit_key if ns.rate_limit_key is not None else (_env("KVROUTE_RATE_LIMIT_KEYS") or "").split()
    try:
        per_key = dict(parse_limit(text) for text in entries)
        sizes = {"rps": ns.rate_limit_rps, "burst": ns.rate_limit_burst, "tpm": ns.rate_limit_tpm}
        sizes["token_burst"] = ns.rate_limit_token_burst
        given = {k: float(v) for k, v in sizes.items() if v is not None}
        default = Limit(**given) if given else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if default is not None and not default.limited:
        raise SystemExit("--rate-limit-burst / --rate-limit-token-burst need --rate-limit-rps / --rate-limit-tpm")
    if default is None and not per_key:
        return None
    digests = list(known_digests)
    if per_key and not digests:
        raise SystemExit("--rate-limit-key needs --api-key (without keys every request is anonymous)")
    try:
        return RateLimits(default, per_key, digests, registry)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


__all__ = [
    "ANONYMOUS",
    "Limit",
    "RateLimited",
    "RateLimits",
    "add_rate_limit_args",
    "key_id",
    "parse_limit",
    "rate_limits_from_args",
]
