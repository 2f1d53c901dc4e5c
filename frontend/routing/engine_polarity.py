"""The sign of the engine ``priority`` field, per worker: which way the chosen engine schedules.

Dynamo's ``priority`` means "higher = more important". vLLM (``--scheduling-policy priority``)
and our mocker run *lower* values first; SGLang runs *higher* values first by default (the same
direction as Dynamo). The frontend parses the request before a worker is chosen, so the body is
written once with vLLM's sign (``hints.engine_priority``); ``for_worker`` rewrites it to the chosen
worker's sign just before each send (after routing, after a migration, and for each side of a
disaggregated prefill/decode hop).

The engine comes from the worker spec's ``engine=vllm|sglang`` when given, else from detection
(``frontend.pool.capacity``: vLLM/mocker metrics, SGLang metrics or ``/get_server_info``). An SGLang
server started with ``--schedule-low-priority-values-first`` (reported by ``/get_server_info``) gets
vLLM's sign. Unknown engines keep vLLM's sign (the engines kvroute is most often put in front of).

Cost: with no priority in the request (the common case) nothing is parsed or serialised; with a
priority and a vLLM-like worker the body goes out as it is; only an SGLang target re-serialises.
"""

from __future__ import annotations

from typing import Any

import orjson

from frontend.request.hints import engine_priority

# engine kinds whose scheduler runs higher priority values first
HIGHER_FIRST_ENGINES = frozenset(("sglang",))


def engine_of(worker: Any) -> str:
    """The worker's engine kind: the spec's explicit ``engine`` first, else what detection found."""
    explicit = getattr(worker.spec, "engine", None)
    if explicit:
        return explicit
    cap = worker.capacity
    return cap.engine if cap is not None else "unknown"


def higher_first(worker: Any) -> bool:
    """True when the worker's engine schedules higher ``priority`` values first: SGLang, unless its
    ``/get_server_info`` said it runs with ``--schedule-low-priority-values-first``."""
    if engine_of(worker) not in HIGHER_FIRST_ENGINES:
        return False
    cap = worker.capacity
    return not (cap is not None and cap.low_priority_first)


def for_worker(body: bytes, hints: Any, worker: Any) -> bytes:
    """``body`` (written with vLLM's sign) as the worker's engine must receive it.

    ``body`` is a JSON request already carrying ``engine_priority(hints)`` as its ``priority``.
    """
    if hints is None or hints.priority is None or not higher_first(worker):
        return body
    value = engine_priority(hints, "sglang")
    if value == engine_priority(hints, "vllm"):  # 0: the same either way
        return body
    doc = orjson.loads(body)
    doc["priority"] = value
    return orjson.dumps(doc)
