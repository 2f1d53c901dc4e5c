"""Session affinity: bind a session id to the (worker, DP rank) its first request ran on.

Pure and synchronous (one asyncio loop uses it); the clock is injectable. As the reference frontend's session affinity:

- Off unless ``--router-session-affinity-ttl-secs`` is set (the frontend simply has no table).
- The first successfully dispatched request of a session binds it; later requests of the session
  go exactly there while the binding lives.
- Concurrent requests share a binding; a binding with a live request never expires. The TTL is an
  *idle* timeout restarted when each request's lease ends.
- A binding is dropped when its worker goes away (:meth:`SessionTable.drop_worker`) or when a
  request fails on it for a reason other than cancellation (:meth:`SessionLease.invalidate`).
- Limits: at most ``max_sessions`` sessions (a new one beyond that -> 529) and session ids of at
  most ``max_id_bytes`` bytes (-> 400).

Typical use in the request path::

    lease = table.lease(model, session_id)          # SessionError(400/529) on bad id / table full
    target = lease.target                           # (worker_id, dp_rank) or None = route freely
    ... route (pinned to target if set), dispatch ...
    lease.bind(worker_id, dp_rank)                  # after a successful dispatch
    ... stream ...
    lease.release()                                 # always, in a finally (idempotent)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvroute_common.errors import ServiceError

DEFAULT_MAX_SESSIONS = 65_536
DEFAULT_MAX_ID_BYTES = 256
MIN_TTL_SECS = 1.0
MAX_TTL_SECS = 31_536_000.0


class SessionError(ServiceError):
    """A session request that cannot be served: ``status`` 400 (bad id) or 529 (table full)."""


class _Session:
    __slots__ = ("target", "refs", "idle_since")

    def __init__(self, now: float) -> None:
        self.target: tuple[int, int | None] | None = None
        self.refs = 0
        self.idle_since = now


class SessionLease:
    """One request's hold on its session. ``release()`` it exactly once (extra calls are no-ops)."""

    __slots__ = ("_table", "key", "_session", "_released")

    def __init__(self, table: SessionTable, key: tuple[str, str], session: _Session) -> None:
        self._table = table
        self.key = key
        self._session = session
        self._released = False

    @property
    def session_id(self) -> str:
        return self.key[1]

    @property
    def target(self) -> tuple[int, int | None] | None:
        """(worker_id, dp_rank or None) this session is bound to, or None if not bound (yet)."""
        s = self._session
        return s.target if self._table._sessions.get(self.key) is s else None

    def bind(self, worker_id: int, dp_rank: int | None, *, rebind: bool = False) -> tuple[int, int | None]:
        """Record where this request was dispatched; returns the session's binding afterwards.

        The first bind wins (a concurrent first request that went elsewhere keeps the earlier
        binding) unless ``rebind`` (soft affinity: the session follows where it last ran).
        """
        return self._table._bind(self, worker_id, dp_rank, rebind)

    def invalidate(self) -> None:
        """Forget the binding after a non-cancellation failure on the bound worker."""
        self._table._invalidate(self)

    def release(self) -> None:
        """End of this request (EOF, error, cancellation): restarts the idle TTL when last."""
        if self._released:
            return
        self._released = True
        self._table._release(self)

    @property
    def released(self) -> bool:
        return self._released


class SessionTable:
    """Session id -> (worker, rank) bindings, scoped per model."""

    def __init__(
        self,
        ttl_secs: float,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_id_bytes: int = DEFAULT_MAX_ID_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (MIN_TTL_SECS <= ttl_secs <= MAX_TTL_SECS):
            raise ValueError(
                f"session affinity TTL must be between {MIN_TTL_SECS:g} and {MAX_TTL_SECS:g} seconds, got {ttl_secs}"
            )
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.ttl_secs = float(ttl_secs)
        self.max_sessions = max_sessions
        self.max_id_bytes = max_id_bytes
        self._clock = clock
        self._sessions: dict[tuple[str, str], _Session] = {}

    # --- request path ------------------------------------------------------------------------

    def validate_id(self, session_id: str) -> None:
        if not session_id:
            raise SessionError(400, "session id must not be empty")
        if (
            len(session_id) > self.max_id_bytes // 4
            and len(session_id.encode("utf-8", "surrogatepass")) > self.max_id_bytes
        ):
            raise SessionError(400, f"session id is longer than {self.max_id_bytes} bytes")

    def lease(self, model: str, session_id: str) -> SessionLease:
        """Start a request of this session. Raises SessionError(400) for a bad id, 529 when full."""
        self.validate_id(session_id)
        key = (model, session_id)
        now = self._clock()
        s = self._sessions.get(key)
        if s is not None and s.refs == 0 and now - s.idle_since >= self.ttl_secs:
            del self._sessions[key]
            s = None
        if s is None:
            if len(self._sessions) >= self.max_sessions:
                self.expire(now)
                if len(self._sessions) >= self.max_sessions:
                    raise SessionError(529, f"session affinity table is full ({self.max_sessions} sessions)")
            s = _Session(now)
            self._sessions[key] = s
        s.refs += 1
        return SessionLease(self, key, s)

    def lookup(self, model: str, session_id: str) -> tuple[int, int | None] | None:
        """The live binding, without taking a lease (for inspection)."""
        s = self._sessions.get((model, session_id))
        if s is None or s.target is None:
            return None
        if s.refs == 0 and self._clock() - s.idle_since >= self.ttl_secs:
            return None
        return s.target

    def _bind(self, lease: SessionLease, worker_id: int, dp_rank: int | None, rebind: bool) -> tuple[int, int | None]:
        s = lease._session
        if lease.released or self._sessions.get(lease.key) is not s:
            # a session with a live lease is never removed, so only a released lease gets here
            return (worker_id, dp_rank)
        if s.target is None or rebind:
            s.target = (worker_id, dp_rank)
        return s.target

    def _invalidate(self, lease: SessionLease) -> None:
        s = self._sessions.get(lease.key)
        if s is not None and s is lease._session:
            s.target = None

    def _release(self, lease: SessionLease) -> None:
        s = lease._session
        s.refs -= 1
        if s.refs <= 0:
            s.refs = 0
            s.idle_since = self._clock()
            if s.target is None and self._sessions.get(lease.key) is s:
                del self._sessions[lease.key]  # never bound: nothing to keep

    # --- maintenance ---------------------------------------------------------------------------

    def drop_worker(self, worker_id: int, dp_rank: int | None = None) -> int:
        """Forget every binding to ``worker_id`` (only its ``dp_rank`` if given). Returns how many."""
        dropped = 0
        for key, s in list(self._sessions.items()):
            t = s.target
            if t is not None and t[0] == worker_id and (dp_rank is None or t[1] == dp_rank):
                s.target = None
                dropped += 1
                if s.refs == 0:
                    del self._sessions[key]
        return dropped

    def expire(self, now: float | None = None) -> int:
        """Remove idle sessions older than the TTL (the reaper; run every min(ttl, 30 s))."""
        if now is None:
            now = self._clock()
        ttl = self.ttl_secs
        dead = [k for k, s in self._sessions.items() if s.refs == 0 and now - s.idle_since >= ttl]
        for k in dead:
            del self._sessions[k]
        return len(dead)

    @property
    def reap_interval_secs(self) -> float:
        return min(self.ttl_secs, 30.0)

    def __len__(self) -> int:
        return len(self._sessions)

    def bindings(self) -> list[dict]:
        """Live bindings, for debugging/metrics."""
        return [
            {"model": m, "session_id": sid, "worker_id": s.target[0], "dp_rank": s.target[1], "active_requests": s.refs}
            for (m, sid), s in self._sessions.items()
            if s.target is not None
        ]
