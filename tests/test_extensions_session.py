"""Session affinity table (router/session.py): binding, idle TTL, refcount, worker loss, limits."""

from __future__ import annotations

import pytest

from router.session import SessionError, SessionTable


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def table(clock, ttl=10.0, **kw) -> SessionTable:
    return SessionTable(ttl, clock=clock, **kw)


def test_ttl_bounds():
    with pytest.raises(ValueError):
        SessionTable(0)
    with pytest.raises(ValueError):
        SessionTable(31_536_001)
    assert SessionTable(1).ttl_secs == 1.0
    assert SessionTable(31_536_000).reap_interval_secs == 30.0
    assert SessionTable(5).reap_interval_secs == 5.0


def test_first_dispatch_binds_and_later_requests_follow(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    assert lease.target is None  # not bound yet: route freely
    assert lease.bind(3, 1) == (3, 1)
    lease.release()
    second = t.lease("m", "s")
    assert second.target == (3, 1)
    second.release()
    assert t.lookup("m", "s") == (3, 1)


def test_scope_is_per_model(clock):
    t = table(clock)
    a = t.lease("m1", "s")
    a.bind(1, 0)
    a.release()
    b = t.lease("m2", "s")
    assert b.target is None
    b.release()


def test_idle_ttl_expires_binding(clock):
    t = table(clock, ttl=10)
    lease = t.lease("m", "s")
    lease.bind(3, 0)
    lease.release()
    clock.t += 9.9
    assert t.lookup("m", "s") == (3, 0)
    clock.t += 0.2
    assert t.lookup("m", "s") is None
    fresh = t.lease("m", "s")
    assert fresh.target is None
    fresh.release()


def test_each_request_end_restarts_the_idle_ttl(clock):
    t = table(clock, ttl=10)
    for _ in range(5):  # a request every 8 s keeps the session for 40 s
        lease = t.lease("m", "s")
        lease.bind(2, 0)
        assert lease.target == (2, 0)
        lease.release()
        clock.t += 8
    assert t.lookup("m", "s") == (2, 0)


def test_live_request_keeps_the_binding_past_the_ttl(clock):
    t = table(clock, ttl=10)
    long_req = t.lease("m", "s")
    long_req.bind(4, 1)
    clock.t += 1000
    assert t.expire() == 0
    other = t.lease("m", "s")  # concurrent request of the same session shares the binding
    assert other.target == (4, 1)
    other.release()
    clock.t += 1000
    assert t.lookup("m", "s") == (4, 1)  # still live: long_req not finished
    long_req.release()
    clock.t += 9
    assert t.lookup("m", "s") == (4, 1)
    clock.t += 2
    assert t.expire() == 1 and len(t) == 0


def test_release_is_idempotent(clock):
    t = table(clock, ttl=10)
    a = t.lease("m", "s")
    a.bind(1, 0)
    b = t.lease("m", "s")
    a.release()
    a.release()  # must not drop b's reference
    clock.t += 100
    assert t.expire() == 0
    assert t.lookup("m", "s") == (1, 0)
    b.release()
    clock.t += 100
    assert t.expire() == 1


def test_first_bind_wins_unless_rebind(clock):
    t = table(clock)
    a = t.lease("m", "s")
    b = t.lease("m", "s")  # concurrent first requests: both unbound
    assert a.target is None and b.target is None
    assert a.bind(1, 0) == (1, 0)
    assert b.bind(2, 0) == (1, 0)  # first wins
    assert b.bind(2, 1, rebind=True) == (2, 1)  # soft affinity follows where it ran
    a.release()
    b.release()
    assert t.lookup("m", "s") == (2, 1)


def test_unbound_session_leaves_no_entry(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    lease.release()  # e.g. dispatch failed before bind
    assert len(t) == 0


def test_dp_rank_none_binding(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    assert lease.bind(5, None) == (5, None)
    lease.release()
    assert t.lookup("m", "s") == (5, None)


def test_drop_worker_forgets_its_bindings(clock):
    t = table(clock)
    for sid, (w, r) in {"a": (1, 0), "b": (1, 1), "c": (2, 0)}.items():
        lease = t.lease("m", sid)
        lease.bind(w, r)
        lease.release()
    live = t.lease("m", "a")
    assert t.drop_worker(1) == 2
    assert t.lookup("m", "a") is None and t.lookup("m", "b") is None and t.lookup("m", "c") == (2, 0)
    assert live.target is None  # the in-flight request sees the binding gone
    assert live.bind(2, 0) == (2, 0)  # and the next dispatch re-binds
    live.release()
    assert t.lookup("m", "a") == (2, 0)


def test_drop_worker_single_rank(clock):
    t = table(clock)
    for sid, r in (("a", 0), ("b", 1)):
        lease = t.lease("m", sid)
        lease.bind(1, r)
        lease.release()
    assert t.drop_worker(1, dp_rank=1) == 1
    assert t.lookup("m", "a") == (1, 0) and t.lookup("m", "b") is None


def test_invalidate_after_failure_rebinds_next_request(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    lease.bind(1, 0)
    lease.invalidate()
    lease.release()
    nxt = t.lease("m", "s")
    assert nxt.target is None
    nxt.bind(2, 0)
    nxt.release()
    assert t.lookup("m", "s") == (2, 0)


def test_session_count_limit_529_and_expiry_makes_room(clock):
    t = table(clock, ttl=10, max_sessions=3)
    leases = []
    for i in range(3):
        lease = t.lease("m", f"s{i}")
        lease.bind(1, 0)
        leases.append(lease)
    with pytest.raises(SessionError) as ei:
        t.lease("m", "s3")
    assert ei.value.status == 529
    again = t.lease("m", "s1")  # an existing session is still served when full
    assert again.target == (1, 0)
    again.release()
    leases[0].release()
    clock.t += 11  # s0 idle past its TTL: its slot is reclaimed for a new session
    newcomer = t.lease("m", "s3")
    assert newcomer.target is None and len(t) == 3
    newcomer.release()


def test_session_id_limits(clock):
    t = table(clock, max_id_bytes=256)
    t.lease("m", "a" * 256).release()
    with pytest.raises(SessionError) as ei:
        t.lease("m", "a" * 257)
    assert ei.value.status == 400
    with pytest.raises(SessionError) as ei:
        t.lease("m", "é" * 129)  # 258 bytes in UTF-8
    assert ei.value.status == 400
    with pytest.raises(SessionError):
        t.lease("m", "")
    assert len(t) == 0


def test_bind_after_release_does_not_resurrect(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    lease.release()
    lease.bind(1, 0)
    assert len(t) == 0


def test_bindings_listing(clock):
    t = table(clock)
    lease = t.lease("m", "s")
    lease.bind(7, 2)
    assert t.bindings() == [{"model": "m", "session_id": "s", "worker_id": 7, "dp_rank": 2, "active_requests": 1}]
    lease.release()


def test_an_engine_restart_drops_the_workers_bindings_and_has_it_read_again(clock):
    """A new engine process behind a worker (its KV-event stream started again): the sessions bound to the
    worker lose their binding (the engine's state for them is gone) and the worker is read again."""
    from types import SimpleNamespace

    from frontend.state import FrontendState

    t = table(clock)
    for sid, w in (("a", 1), ("b", 1), ("c", 2)):
        lease = t.lease("m", sid)
        lease.bind(w, 0)
        lease.release()
    read_again: list[int] = []
    state = SimpleNamespace(sessions=t, pool=SimpleNamespace(rediscover=read_again.append))
    FrontendState._engine_restarted(state, 1, 0)  # type: ignore[arg-type]
    assert t.lookup("m", "a") is None and t.lookup("m", "b") is None and t.lookup("m", "c") == (2, 0)
    assert read_again == [1]
