"""Graceful drain on SIGTERM, shared by the three HTTP services.

What Kubernetes (and systemd) expect of a server being stopped: on SIGTERM, stop looking ready at
once (``/health`` answers 503, so the endpoint leaves the Service), admit no new work (the frontend
answers ``/v1/*`` with an OpenAI-style 503 and ``connection: close``, so clients retry on another
replica), let the requests in flight finish, bounded by ``--drain-timeout``, then shut down and exit
with status 0.

uvicorn alone closes its listening socket on the first SIGTERM (probes then see "connection refused"
instead of 503), waits ``timeout_graceful_shutdown`` and re-raises the signal after shutting down
(exit status 143). ``DrainingServer`` keeps the socket open while draining, ends the drain from its
once-per-100-ms tick when nothing is in flight or the deadline passes (the streams still running are
then cancelled at once), and exits normally. Until a drain or an exit, its main loop ticks once a second
instead of uvicorn's ten times (the Date header it renews is per second), and an exit or a drain wakes it
at once: an idle frontend's ticks were a third of its Python time. A second SIGTERM ends the drain early;
SIGINT (Ctrl-C) keeps uvicorn's behaviour. ``DrainMiddleware`` counts the requests in flight and answers for the
draining server; without a drain it is not installed at all.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("kvroute.drain")

DEFAULT_DRAIN_TIMEOUT = 30.0


def add_drain_arg(parser: argparse._ActionsContainer) -> None:
    """``--drain-timeout`` (env ``DYN_DRAIN_TIMEOUT``)."""
    raw = os.environ.get("DYN_DRAIN_TIMEOUT")
    try:
        default = float(raw) if raw not in (None, "") else DEFAULT_DRAIN_TIMEOUT
    except ValueError:
        raise SystemExit(f"invalid value for DYN_DRAIN_TIMEOUT={raw!r}: not a number") from None
    parser.add_argument(
        "--drain-timeout",
        type=_non_negative,
        default=default,
        metavar="SECONDS",
        help="on SIGTERM: /health answers 503 at once, requests in flight get this long to finish (the "
        "frontend refuses new /v1 requests meanwhile), then the process exits 0 "
        f"[env DYN_DRAIN_TIMEOUT; default {DEFAULT_DRAIN_TIMEOUT:g}]",
    )


def _non_negative(value: str) -> float:
    v = float(value)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


class Drain:
    """The drain's state: whether it started, requests in flight, its deadline."""

    __slots__ = ("timeout", "draining", "inflight", "deadline")

    def __init__(self, timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        self.timeout = timeout
        self.draining = False
        self.inflight = 0
        self.deadline = 0.0

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + self.timeout
            log.warning("SIGTERM: draining (%d request(s) in flight, up to %gs)", self.inflight, self.timeout)

    def cut_short(self) -> None:
        """End the drain at the next tick (a second SIGTERM)."""
        self.deadline = 0.0

    def finished(self) -> bool:
        return self.draining and (self.inflight == 0 or time.monotonic() >= self.deadline)


_JSON = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")


class DrainMiddleware:
    """ASGI wrapper: counts HTTP requests in flight; while draining, answers ``health_paths`` with
    ``health_body`` (503) and refuses what ``refuse(method, path)`` returns a body for (503)."""

    def __init__(
        self,
        app: Any,
        drain: Drain,
        *,
        health_paths: Iterable[str] = ("/health",),
        health_body: bytes = b'{"error":"shutting down"}',
        refuse: Callable[[str, str], bytes | None] | None = None,
    ) -> None:
        self.app = app
        self.drain = drain
        self.health_paths = frozenset(health_paths)
        self.health_body = health_body
        self.refuse = refuse
        self.state = getattr(app, "state", None)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            path = scope["path"]
            body = self.health_body if path in self.health_paths else None
            if body is None and self.refuse is not None:
                body = self.refuse(scope["method"], path)
            if body is not None:
                headers = [_JSON, _CLOSE, (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        drain.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.inflight -= 1


IDLE_TICK_S = 1.0
"""Seconds between two ticks of ``DrainingServer``'s main loop while it neither drains nor exits."""
DRAIN_TICK_S = 0.1
"""Seconds between two ticks while draining (uvicorn's own tick)."""


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM drains (see the module doc) and whose drained exit is clean."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._should_exit = False
        super().__init__(config)
        self.drain = drain

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value:
            self._tick_now()

    def _tick_now(self) -> None:
        """Wake the main loop for a tick now (safe from a signal handler or another thread)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: nothing waits any more
                pass

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # before the server started (still in its start-up) nothing is in flight: uvicorn's own way
        if sig == signal.SIGTERM and not self.should_exit and self.started:
            if self.drain.draining:
                self.drain.cut_short()
            else:
                self.drain.begin()
            self._tick_now()
            return  # not recorded: uvicorn would re-raise it after shutdown (exit 143 instead of 0)
        super().handle_exit(sig, frame)

    async def main_loop(self) -> None:
        """uvicorn's main loop at ``IDLE_TICK_S`` (``DRAIN_TICK_S`` while draining), woken at once by an exit
        or a drain. uvicorn's ``on_tick`` renews the Date header at counters that are multiples of ten."""
        self._loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            draining = self.drain.draining
            counter = (counter + 1 if draining else (counter // 10 + 1) * 10) % 864000
            try:
                await asyncio.wait_for(wake.wait(), DRAIN_TICK_S if draining else IDLE_TICK_S)
            except TimeoutError:
                pass
            wake.clear()
            should_exit = await self.on_tick(counter)

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        drain = self.drain
        if not should_exit and drain.finished():
            if drain.inflight:
                log.warning("drain timeout: cutting %d request(s) still in flight", drain.inflight)
                self.config.timeout_graceful_shutdown = 0  # cancel them now: the drain already waited
            else:
                log.info("drained: shutting down")
            return True
        return should_exit


__all__ = ["DEFAULT_DRAIN_TIMEOUT", "Drain", "DrainMiddleware", "DrainingServer", "add_drain_arg"]
