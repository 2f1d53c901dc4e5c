"""Latency mode end to end: real mockers of different speeds, a real frontend, the openai SDK streaming.

The frontend learns each worker's prefill speed from the TTFTs it observes, then sends new prompts
to the fast worker, and keeps a cached prefix on the worker holding it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter

from test_frontend_e2e import (
    MODEL,
    START_TIMEOUT,
    WAIT,
    Frontend,
    _all_healthy,
    start_frontend,
    start_mockers,
    system_prompt,
    wait_ready,
)

from support import wait_until


def _stream(fe: Frontend, messages: list[dict], pin: int | None = None) -> int:
    """Stream a chat completion to the end; returns the worker that served it."""
    nvext: dict = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    stream = fe.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True, extra_body={"nvext": nvext}
    )
    worker = None
    for chunk in stream:
        nvext = (chunk.model_extra or {}).get("nvext") or {}
        if "worker_id" in nvext:
            worker = nvext["worker_id"]["decode_worker_id"]
    assert worker is not None
    return worker


def _prompt(words: int = 60) -> list[dict]:
    return [
        {"role": "user", "content": f"{uuid.uuid4().hex} " + "describe a quiet harbour town at dawn. " * (words // 6)}
    ]


def test_latency_mode_learns_speeds_and_keeps_prefixes() -> None:
    with contextlib.ExitStack() as stack:
        slow, fast = (
            start_mockers(1, stack, ["--speedup-ratio", "0.04"])[0],
            start_mockers(1, stack, ["--speedup-ratio", "4"])[0],
        )
        fe = start_frontend(
            ["--router-mode", "latency", "--worker", slow.worker_arg(1), "--worker", fast.worker_arg(2)], stack
        )
        wait_ready([slow, fast], [fe])
        wait_until(lambda: _all_healthy(fe, 2), START_TIMEOUT, what="both workers healthy")

        # before any observation both ranks share the prior: an idle tie, costs are estimated TTFTs in ms
        d = fe.explain(_prompt())
        assert d["router_mode"] == "latency" and len({c["cost"] for c in d["candidates"]}) == 1
        assert all(c["cost"] > 0 for c in d["candidates"])

        # learn: every request whose first token is seen is an observation (pinned here to observe both workers)
        # (pinned, so that both workers are observed whatever the first picks are)
        streamed = 0
        for _ in range(4):
            for w in (1, 2):
                assert _stream(fe, _prompt(), pin=w) == w
                streamed += 1
        est = {c["worker_id"]: c["cost"] for c in fe.explain(_prompt())["candidates"]}
        assert est[1] > 2 * est[2], (
            est,
            fe.explain(_prompt())["latency_models"],
        )  # the same prompt is estimated 2x+ slower (~450 vs ~5 ms of prefill) on the slow worker
        models = fe.explain(_prompt())["latency_models"]
        assert models["1:0"]["observations"] == models["2:0"]["observations"] == 4, models
        fe.chat(_prompt())  # non-streaming, sent to the engine as a stream: its real first token is an observation too
        assert sum(m["observations"] for m in fe.explain(_prompt())["latency_models"].values()) == streamed + 1

        # learned: new prompts go to the fast worker
        picks = Counter(_stream(fe, _prompt()) for _ in range(8))
        assert picks[2] >= 7, picks

        # a long prefix cached on a worker keeps its follow-ups there (its uncached work is far smaller)
        system = {"role": "system", "content": system_prompt("latency-prefix", words=400)}
        holder = _stream(fe, [system, {"role": "user", "content": "first"}])

        def indexed() -> bool:
            d = fe.explain([system, {"role": "user", "content": "next"}])
            by = {c["worker_id"]: c for c in d["candidates"]}
            return by[holder]["overlap_blocks"] > 10 and d["worker_id"] == holder

        wait_until(indexed, WAIT, what="the prefix indexed and preferred")
        d = fe.explain([system, {"role": "user", "content": "next"}])
        by = {c["worker_id"]: c for c in d["candidates"]}
        other = 3 - holder
        assert by[holder]["prefill_tokens"] < by[other]["prefill_tokens"] and by[holder]["cost"] < by[other]["cost"]
        follow = Counter(_stream(fe, [system, {"role": "user", "content": f"question {i}"}]) for i in range(5))
        assert follow == Counter({holder: 5}), follow
        wait_until(fe.idle, WAIT, what="loads back to zero")
