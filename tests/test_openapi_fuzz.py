"""schemathesis against the three HTTP services, each a real process reading its own ``/openapi.json``.

Every generated request (schema-valid and schema-violating ones) must get: no 5xx, a documented
status, a documented content type, a body matching the documented schema. The frontend runs in kv
mode in front of two mockers (KV events on), so ``/v1`` requests go the whole way through routing,
booking, the engine and back. Afterwards every process is still running, the frontend's loads on
its real workers are all back to 0 (nothing generated leaked a booking) and no standalone tracker
load is negative.

Generated data is steered only so the run stays bounded and loopback-only and reaches success paths:
``/v1`` bodies name the served model and ask for at most a few tokens (the engine's default is the
whole context); worker URLs, and ZMQ endpoints that could be usable, point at a closed loopback
port (no DNS, no traffic leaves the machine); the two real workers' ids cannot be generated for
``/admin/workers``; on the standalone services half the generated names and ids are replaced by the
worker the fixture registered, so success paths are reached. Every operation gets schemathesis's
three phases: the schema's own examples, the coverage phase (deterministic: each field's boundary,
missing and wrong-typed values, other methods; ~4,900 requests over the three services) and the fuzzing
phase, ``KVROUTE_FUZZ_EXAMPLES`` random requests per operation (default 10; seeded anew each run). At 25
the module took 150-165 s on 2 vCPUs, at 10 about 97 s: generating a random request costs more than
sending it.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis  # the test extra; a missing tool fails the run
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from support import free_port, free_ports, service, wait_until

MODEL = "fuzz-model"
WORKER_IDS = (7001, 7002)
EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "10"))
MAX_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)

# the worker each standalone service is started with (the documents' example model)
TRACKER_SEED = {
    "model_name": "llama-3-8b",
    "worker_id": 7,
    "dp_rank": 0,
    "tenant_id": "default",
    "routing_group": "default",
}
INDEXER_SEED = {"model_name": "llama-3-8b", "instance_id": 1, "tenant_id": "default", "routing_group": "default"}

_CLOSED_PORT = free_port()  # nothing listens here: connects are refused at once


def _is_real_worker(value: Any) -> bool:
    """Whether the frontend would read ``value`` as one of the two real workers' ids."""
    try:
        return int(str(value).strip()) in WORKER_IDS
    except ValueError:
        return False


def _steer(case: Any, seeded: dict[str, Any] | None = None) -> None:
    """Keep a generated request bounded and on loopback; on the standalone services, aim half the
    requests at the worker the fixture registered so success paths get exercised too."""
    body = case.body
    path = case.path
    if not isinstance(body, dict):
        return
    if path.startswith("/v1/") or path == "/admin/route":
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[name] = MAX_TOKENS
        if path == "/v1/responses":
            if "max_output_tokens" not in body:
                body["max_output_tokens"] = MAX_TOKENS
        elif path != "/v1/embeddings" and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    for key in ("endpoint", "replay_endpoint", "kv_events_endpoint", "url"):
        value = body.get(key)
        if path == "/admin/workers" and key == "url" and isinstance(value, str):
            body[key] = f"http://127.0.0.1:{_CLOSED_PORT}"  # every worker URL: added workers are probed
        elif isinstance(value, str) and "://" in value:
            body[key] = f"tcp://127.0.0.1:{_CLOSED_PORT}"
    if path == "/admin/workers" and _is_real_worker(body.get("id")):
        body["id"] = 7999
    if seeded is not None and path != "/unregister":  # the seeded worker stays registered
        for key, value in seeded.items():
            current = body.get(key)
            if isinstance(current, str) and len(current) % 2 == 0:
                body[key] = value
            elif isinstance(current, int) and not isinstance(current, bool) and current % 2 == 0:
                body[key] = value


def _run(case: Any, seeded: dict[str, Any] | None = None, seed_registration: tuple[str, dict] | None = None) -> None:
    if seed_registration is not None:  # a generated /unregister may have dropped it (201 or 409: registered)
        url, body = seed_registration
        assert httpx.post(url, json=body, timeout=10).status_code in (201, 409)
    _steer(case, seeded)
    if case.path == "/admin/workers/{worker_id}" and _is_real_worker(case.path_parameters.get("worker_id")):
        case.path_parameters["worker_id"] = "7999"
    case.call_and_validate(checks=CHECKS, timeout=60)


def _load(url: str) -> Any:
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


# ------------------------------------------------------------------------------------------ slot tracker


@pytest.fixture(scope="module")
def tracker_service():
    port, sync_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "slot_tracker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--replica-sync-bind",
        f"tcp://127.0.0.1:{sync_port}",
    ]
    with service(args, ready_url=f"{url}/health") as proc:
        seed = {
            "worker_id": TRACKER_SEED["worker_id"],
            "model_name": TRACKER_SEED["model_name"],
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 2,
        }
        yield url, (f"{url}/register", seed)
        assert proc.poll() is None, "the slot tracker died during the run"
        for row in httpx.get(f"{url}/loads", timeout=10).json():  # what the fuzzer booked, never below 0
            assert row["active_prefill_tokens"] >= 0 and row["active_decode_blocks"] >= 0


@pytest.fixture
def tracker_schema(tracker_service):
    return _load(tracker_service[0])


tracker = schemathesis.pytest.from_fixture("tracker_schema")


@tracker.parametrize()
@FUZZ_SETTINGS
def test_slot_tracker_conforms(case, tracker_service):
    _run(case, TRACKER_SEED, tracker_service[1])


# ------------------------------------------------------------------------------------------ indexer


@pytest.fixture(scope="module")
def indexer_service():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(
        ["-m", "indexer", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        ready_url=f"{url}/health",
    ) as proc:
        seed = {
            "instance_id": INDEXER_SEED["instance_id"],
            "model_name": INDEXER_SEED["model_name"],
            "block_size": 16,
            "endpoint": f"tcp://127.0.0.1:{_CLOSED_PORT}",
        }
        yield url, (f"{url}/register", seed)
        assert proc.poll() is None, "the indexer died during the run"


@pytest.fixture
def indexer_schema(indexer_service):
    return _load(indexer_service[0])


indexer = schemathesis.pytest.from_fixture("indexer_schema")


@indexer.parametrize()
@FUZZ_SETTINGS
def test_indexer_conforms(case, indexer_service):
    _run(case, INDEXER_SEED, indexer_service[1])


# ------------------------------------------------------------------------------------------ frontend


@pytest.fixture(scope="module")
def frontend_url():
    import contextlib

    with contextlib.ExitStack() as stack:
        workers = []
        for worker_id in WORKER_IDS:
            port, events, replay = free_ports(3)
            stack.enter_context(
                service(
                    [
                        "-m",
                        "mocker",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--served-model-name",
                        MODEL,
                        "--speedup-ratio",
                        "0",
                        "--num-gpu-blocks",
                        "4096",
                        "--kv-events-endpoint",
                        f"tcp://127.0.0.1:{events}",
                        "--replay-endpoint",
                        f"tcp://127.0.0.1:{replay}",
                        "--log-level",
                        "warning",
                    ],
                    ready_url=f"http://127.0.0.1:{port}/health",
                    timeout=90,
                )
            )
            workers.append(
                f"id={worker_id},url=http://127.0.0.1:{port},kv_events_endpoint=tcp://127.0.0.1:{events},"
                f"replay_endpoint=tcp://127.0.0.1:{replay}"
            )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = ["-m", "frontend", "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv"]
        for w in workers:
            args += ["--worker", w]
        proc = stack.enter_context(service(args, ready_url=f"{url}/live", timeout=90))
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 60, what="frontend ready")
        yield url
        assert proc.poll() is None, "the frontend died during the run"
        # nothing generated may leave a booking behind on the real workers
        wait_until(
            lambda: all(
                row["active_prefill_tokens"] == 0 and row["active_decode_blocks"] == 0
                for row in httpx.get(f"{url}/loads", params={"model_name": MODEL}, timeout=5).json()
            ),
            30,
            what="all loads back to 0",
        )


@pytest.fixture
def frontend_schema(frontend_url):
    return _load(frontend_url)


frontend = schemathesis.pytest.from_fixture("frontend_schema")


@frontend.parametrize()
@FUZZ_SETTINGS
def test_frontend_conforms(case):
    _run(case)


# ------------------------------------------------------------------------------------------ the documents themselves


def test_documents_are_served_on_every_service(tracker_service, indexer_service, frontend_url):
    """Each service answers /openapi.json (on the ordinary ASGI path) with its own OpenAPI 3.1 document."""
    titles = {}
    tracker_url, indexer_url = tracker_service[0], indexer_service[0]
    for url in (tracker_url, indexer_url, frontend_url):
        r = httpx.get(f"{url}/openapi.json", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        assert doc["openapi"].startswith("3.1")
        titles[url] = doc["info"]["title"]
        assert "/openapi.json" in doc["paths"]
    assert titles == {
        tracker_url: "kvroute slot tracker",
        indexer_url: "kvroute indexer",
        frontend_url: "kvroute frontend",
    }
    front = httpx.get(f"{frontend_url}/openapi.json", timeout=10).json()["paths"]
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/admin/workers",
        "/busy_threshold",
        "/potential_loads",
        "/metrics",
    ):
        assert path in front


# ----------------------------------------------------------------------------------------- regressions found by the run


def test_v1_framework_errors_are_openai_shaped(frontend_url):
    """A /v1 path no route matches (a model id with a newline, an unknown route) or a wrong method gets
    the OpenAI error body, like every other /v1 error; other paths keep {"error": "..."}."""
    for method, path, status in (
        ("GET", "/v1/models/a%0Ab", 404),
        ("GET", "/v1/nope", 404),
        ("GET", "/v1/chat/completions", 405),
    ):
        r = httpx.request(method, f"{frontend_url}{path}", timeout=10)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        assert body["error"]["code"] == status and body["code"] == status and isinstance(body["message"], str), body
    r = httpx.get(f"{frontend_url}/v1/chat/completions", timeout=10)
    assert r.headers["allow"] == "POST"
    r = httpx.get(f"{frontend_url}/nope", timeout=10)
    assert (r.status_code, r.json()) == (404, {"error": "route not found"})


def test_admin_workers_refuses_ids_beyond_64_bits(frontend_url):
    """Found by schemathesis: an id (or alias) over 2**64-1 was accepted and its answer failed to encode (500)."""
    for body in (
        {"id": 1 << 70, "url": "http://127.0.0.1:9"},
        {"instance_id": str(1 << 66), "url": "http://127.0.0.1:9"},
    ):
        r = httpx.post(f"{frontend_url}/admin/workers", params={"wait": "false"}, json=body, timeout=10)
        assert r.status_code == 400 and "out of range" in r.json()["error"], r.text
    assert all(w["id"] < 1 << 64 for w in httpx.get(f"{frontend_url}/admin/workers", timeout=10).json()["workers"])
