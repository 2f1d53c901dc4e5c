"""``DrainingServer``'s main loop: a tick a second while serving (uvicorn's is ten), the Date header still
renewed at each, and an exit or a drain acted on at once, not at the next tick."""

from __future__ import annotations

import signal
import threading
import time

import uvicorn

from kvroute_common.drain import DRAIN_TICK_S, IDLE_TICK_S, Drain, DrainingServer
from support import free_port, wait_until


async def app(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class RecordingServer(DrainingServer):
    """Records each tick: (monotonic time, the default-headers list uvicorn renews with the Date)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config, drain)
        self.ticks: list[tuple[float, object]] = []

    async def on_tick(self, counter: int) -> bool:
        exit_now = await super().on_tick(counter)
        self.ticks.append((time.monotonic(), self.server_state.default_headers))
        return exit_now


def serve(drain: Drain) -> tuple[RecordingServer, threading.Thread]:
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off", log_level="warning")
    server = RecordingServer(config, drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started and len(server.ticks) >= 3, 30, what="three ticks")
    return server, thread


def test_an_idle_server_ticks_once_a_second_and_exits_at_once() -> None:
    server, thread = serve(Drain(timeout=30))
    (t0, h0), (t1, h1), (t2, h2) = server.ticks[:3]
    assert t1 - t0 >= IDLE_TICK_S * 0.95 and t2 - t1 >= IDLE_TICK_S * 0.95  # not uvicorn's 0.1 s
    assert h0 is not h1 and h1 is not h2  # the Date header renewed at every tick
    asked = time.monotonic()
    server.should_exit = True  # from another thread, as a test or an embedding program does
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert server.ticks[-1][0] - asked < IDLE_TICK_S / 2  # woken for the exit, not at the next tick


def test_a_drain_ticks_fast_until_it_ends() -> None:
    drain = Drain(timeout=0.5)
    server, thread = serve(drain)
    begun = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what the first SIGTERM does: drain (nothing in flight)
    thread.join(timeout=30)
    assert not thread.is_alive() and drain.draining
    assert server.ticks[-1][0] - begun < IDLE_TICK_S / 2  # the drain ended within a fast tick or two
    assert DRAIN_TICK_S < IDLE_TICK_S
