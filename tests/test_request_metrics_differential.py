"""Differential test: which refused requests enter ``dynamo_frontend_requests_total``, in the reference
frontend's HTTP service (Dynamo 1.6.1's ``HttpService``, tests/reference_http.py) and in kvroute.

The same refused requests go to both; each one's change to the request counters (``requests_total``,
``requests_started_total``, the request-duration histogram's count) must be the same, labels included. The
reference counts a request for a model nobody serves (as ``model="unknown_model"``, ``not_found``) on
every API, a value out of range (``validation``) on chat completions and responses but not on text
completions (those validate before counting), and never a body that does not deserialize (a field of the
wrong type, a missing role, an unknown role, a response without its input): kvroute's ``RequestShapeError``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support import free_port, frontend_client, mocker_url, reference_installed, service

pytestmark = pytest.mark.skipif(not reference_installed(), reason="reference dynamo (ai-dynamo-runtime) not installed")

MODEL = "kvroute-demo"  # the mocker's served name, and the reference's
COUNTERS = (
    "dynamo_frontend_requests_total",
    "dynamo_frontend_requests_started_total",
    "dynamo_frontend_request_duration_seconds_count",
)
USER = [{"role": "user", "content": "Say something."}]

CHAT: dict[str, dict[str, Any]] = {
    # counted: a model nobody serves, values out of range
    "unknown model": {"model": "nobody-serves-this", "messages": USER},
    "unknown model, streamed": {"model": "nobody-serves-this", "messages": USER, "stream": True},
    "empty model": {"model": "", "messages": USER},
    "temperature -3": {"model": MODEL, "messages": USER, "temperature": -3},
    "temperature -3, streamed": {"model": MODEL, "messages": USER, "temperature": -3, "stream": True},
    "top_p 7": {"model": MODEL, "messages": USER, "top_p": 7},
    "no messages": {"model": MODEL, "messages": []},
    "presence_penalty 5": {"model": MODEL, "messages": USER, "presence_penalty": 5},
    "n 0": {"model": MODEL, "messages": USER, "n": 0},
    "max_tokens 0": {"model": MODEL, "messages": USER, "max_tokens": 0},
    "an empty stop string": {"model": MODEL, "messages": USER, "stop": [""]},
    "stream_options, not streamed": {"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}},
    "no tools": {"model": MODEL, "messages": USER, "tools": []},
    "min_p 3": {"model": MODEL, "messages": USER, "min_p": 3},
    "top_k -5": {"model": MODEL, "messages": USER, "top_k": -5},
    "repetition_penalty 0": {"model": MODEL, "messages": USER, "repetition_penalty": 0},
    # not counted: bodies that do not deserialize
    "model a number": {"model": 5, "messages": USER},
    "no model": {"messages": USER},
    "stream a string": {"model": MODEL, "messages": USER, "stream": "yes"},
    "messages a string": {"model": MODEL, "messages": "hello"},
    "a message a string": {"model": MODEL, "messages": ["hello"]},
    "an unknown role": {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    "no role": {"model": MODEL, "messages": [{"content": "x"}]},
    "null user content": {"model": MODEL, "messages": [{"role": "user", "content": None}]},
    "temperature a string": {"model": MODEL, "messages": USER, "temperature": "hot"},
    "max_tokens a string": {"model": MODEL, "messages": USER, "max_tokens": "a"},
    "seed a fraction": {"model": MODEL, "messages": USER, "seed": 1.5},
    "logprobs a string": {"model": MODEL, "messages": USER, "logprobs": "x"},
    "stop a number": {"model": MODEL, "messages": USER, "stop": 5},
    "a tool without its function": {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]},
}
COMPLETIONS: dict[str, dict[str, Any]] = {
    "unknown model": {"model": "nobody-serves-this", "prompt": "x"},
    "unknown model, streamed": {"model": "nobody-serves-this", "prompt": "x", "stream": True},
    "empty model": {"model": "", "prompt": "x"},
    "top_p 7": {"model": MODEL, "prompt": "x", "top_p": 7},
    "max_tokens 0": {"model": MODEL, "prompt": "x", "max_tokens": 0},
    "n 0": {"model": MODEL, "prompt": "x", "n": 0},
    "stream_options, not streamed": {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
    "temperature a string": {"model": MODEL, "prompt": "x", "temperature": "hot"},
    "stream a string": {"model": MODEL, "prompt": "x", "stream": "yes"},
}
RESPONSES: dict[str, dict[str, Any]] = {
    "unknown model": {"model": "nobody-serves-this", "input": "x"},
    "unknown model, streamed": {"model": "nobody-serves-this", "input": "x", "stream": True},
    "temperature -3": {"model": MODEL, "input": "x", "temperature": -3},
    "top_p 7": {"model": MODEL, "input": "x", "top_p": 7},
    "max_output_tokens 0": {"model": MODEL, "input": "x", "max_output_tokens": 0},
    "model a number": {"model": 5, "input": "x"},
    "temperature a string": {"model": MODEL, "input": "x", "temperature": "hot"},
    "no input": {"model": MODEL},
}
CASES = [("/v1/chat/completions", name, body) for name, body in CHAT.items()]
CASES += [("/v1/responses", name, body) for name, body in RESPONSES.items()]
CASES += [("/v1/completions", name, body) for name, body in COMPLETIONS.items()]


def counters(client: httpx.Client) -> Counter[str]:
    """Every sample of COUNTERS, by its line's name and labels."""
    out: Counter[str] = Counter()
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(COUNTERS):
            key, value = line.rsplit(" ", 1)
            out[key] = int(float(value))
    return out


def change(client: httpx.Client, path: str, body: dict[str, Any] | bytes) -> tuple[int, dict[str, int]]:
    """The status of ``body`` sent to ``path``, and what it added to the counters."""
    before = counters(client)
    if isinstance(body, bytes):
        status = client.post(path, content=body, headers={"content-type": "application/json"}).status_code
    else:
        status = client.post(path, json=body).status_code
    added = counters(client)
    added.subtract(before)
    return status, {k: v for k, v in added.items() if v}


@pytest.fixture(scope="module")
def routers() -> Iterator[tuple[httpx.Client, httpx.Client]]:
    port = free_port()
    reference_url = f"http://127.0.0.1:{port}"
    with (
        service(
            ["tests/reference_http.py", "--port", str(port), "--model", MODEL], ready_url=f"{reference_url}/v1/models"
        ),
        httpx.Client(base_url=reference_url, timeout=30) as reference,
        mocker_url(MODEL) as engine,
        frontend_client([engine]) as kvroute,
    ):
        yield reference, kvroute


@pytest.mark.parametrize(("path", "name", "body"), CASES, ids=[f"{p.rsplit('/', 1)[-1]}: {n}" for p, n, _ in CASES])
def test_a_refused_request_is_counted_as_the_reference_counts_it(
    routers: tuple[httpx.Client, httpx.Client], path: str, name: str, body: dict[str, Any]
) -> None:
    reference, kvroute = routers
    ref_status, ref_added = change(reference, path, body)
    status, added = change(kvroute, path, body)
    assert ref_status >= 400 and status >= 400, (ref_status, status)
    assert added == ref_added


def test_a_body_that_is_not_json_is_counted_by_neither(routers: tuple[httpx.Client, httpx.Client]) -> None:
    reference, kvroute = routers
    for client in (reference, kvroute):
        status, added = change(client, "/v1/chat/completions", b"not json")
        assert status == 400 and added == {}
