"""The engine ``priority`` follows the chosen worker's engine, end to end: a real frontend in front of
real mockers, one looking like vLLM (its own metrics), one looking like SGLang (``--impersonate
sglang``: SGLang's metric names and ``GET /get_server_info``, detected as SGLang), and one vLLM-like
mocker declared ``engine=sglang`` in its worker spec (the override). Dynamo's ``priority`` (higher =
more important) must reach vLLM negated and SGLang unchanged; each mocker reports the ``priority``
field it received (``GET /mocker/priorities``). A second frontend runs the same mockers
disaggregated (SGLang-like prefill, vLLM-like decode): each hop gets its own engine's sign.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
import orjson
import pytest

from support import free_ports, service, wait_until

MODEL = "kvroute-demo"
START = 90.0


class Mock:
    def __init__(self, stack: contextlib.ExitStack, *extra: str) -> None:
        self.port, self.events = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{self.events}",
                    "--replay-endpoint",
                    "",
                    "--num-gpu-blocks",
                    "1024",
                    *extra,
                ],
                ready_url=self.url + "/health",
                timeout=START,
            )
        )

    def spec(self, wid: int, *extra: str) -> str:
        return ",".join([f"id={wid}", f"url={self.url}", f"kv_events_endpoint=tcp://127.0.0.1:{self.events}", *extra])

    def last_priority(self) -> int | None:
        got = httpx.get(self.url + "/mocker/priorities", timeout=10).json()["priorities"]
        assert got, "the mocker received no generation request"
        return got[-1]


def frontend(stack: contextlib.ExitStack, workers: list[str]) -> str:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--router-mode",
        "kv",
        "--health-check-interval",
        "0.5",
        "--log-level",
        "warning",
    ]
    for w in workers:
        args += ["--worker", w]
    stack.enter_context(service(args, ready_url=url + "/health", timeout=START))
    return url


@pytest.fixture(scope="module")
def cluster():
    with contextlib.ExitStack() as stack:
        vllm_like, sglang_like, declared = Mock(stack), Mock(stack, "--impersonate", "sglang"), Mock(stack)
        agg = frontend(stack, [vllm_like.spec(1), sglang_like.spec(2), declared.spec(3, "engine=sglang")])
        disagg = frontend(stack, [sglang_like.spec(12, "role=prefill"), vllm_like.spec(11, "role=decode")])
        for url, n in ((agg, 3), (disagg, 2)):
            wait_until(
                lambda url=url, n=n: (
                    sum(w["healthy"] for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"]) == n
                ),
                timeout=60,
                what="workers healthy",
            )
        yield SimpleNamespace(agg=agg, disagg=disagg, vllm_like=vllm_like, sglang_like=sglang_like, declared=declared)


def chat(url: str, headers: dict[str, str], stream: bool = False, nvext: dict | None = None) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "priorities, please"}],
        "max_tokens": 3,
        "stream": stream,
    }
    if nvext is not None:
        body["nvext"] = nvext
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_engines_are_detected_and_declared(cluster):
    workers = {w["id"]: w for w in httpx.get(cluster.agg + "/admin/workers", timeout=10).json()["workers"]}
    assert workers[1]["engine"] == "mocker"
    assert workers[2]["engine"] == "sglang" and workers[2]["engine_detected"] == "sglang"
    assert workers[3]["engine"] == "sglang" and workers[3]["engine_detected"] == "mocker"  # the spec wins


@pytest.mark.parametrize("stream", [False, True])
def test_each_engine_gets_its_own_sign(cluster, stream):
    for wid, mock, expected in ((1, cluster.vllm_like, -7), (2, cluster.sglang_like, 7), (3, cluster.declared, 7)):
        chat(cluster.agg, {"x-dynamo-worker-instance-id": str(wid), "x-dynamo-request-priority": "7"}, stream)
        assert mock.last_priority() == expected, (wid, stream)
    # the body's nvext route (agent_hints.priority) as well, negative values too
    chat(cluster.agg, {"x-dynamo-worker-instance-id": "2"}, nvext={"agent_hints": {"priority": -3}})
    assert cluster.sglang_like.last_priority() == -3
    chat(cluster.agg, {"x-dynamo-worker-instance-id": "1"}, nvext={"agent_hints": {"priority": -3}})
    assert cluster.vllm_like.last_priority() == 3


def test_no_priority_sends_none(cluster):
    for wid, mock in ((1, cluster.vllm_like), (2, cluster.sglang_like)):
        chat(cluster.agg, {"x-dynamo-worker-instance-id": str(wid)})
        assert mock.last_priority() is None


def test_disaggregated_hops_get_each_engines_sign(cluster):
    before = len(httpx.get(cluster.sglang_like.url + "/mocker/priorities", timeout=10).json()["priorities"])
    chat(cluster.disagg, {"x-dynamo-request-priority": "5"})
    got = httpx.get(cluster.sglang_like.url + "/mocker/priorities", timeout=10).json()["priorities"]
    assert len(got) == before + 1 and got[-1] == 5  # the prefill hop, on the SGLang-like worker
    assert cluster.vllm_like.last_priority() == -5  # the decode hop, on the vLLM-like worker


# ---------------------------------------------------------------------------------------------
# the rewrite itself (real WorkerSpec / EngineCapacity; the worker is a plain holder of both)
# ---------------------------------------------------------------------------------------------


def _worker(engine_spec: str | None, detected: str, low_first: bool | None = None) -> SimpleNamespace:
    from frontend.pool.capacity import EngineCapacity
    from frontend.pool.workers import WorkerSpec

    raw = {"id": 1, "url": "http://127.0.0.1:1"}
    if engine_spec is not None:
        raw["engine"] = engine_spec
    return SimpleNamespace(
        spec=WorkerSpec.from_mapping(raw), capacity=EngineCapacity(engine=detected, low_priority_first=low_first)
    )


def test_for_worker_rewrites_only_for_higher_first_engines():
    from frontend.request.hints import RequestHints
    from frontend.routing.engine_polarity import for_worker

    hints = RequestHints(priority=4)
    body = orjson.dumps({"model": MODEL, "priority": -4, "messages": []})
    assert for_worker(body, hints, _worker(None, "vllm")) is body  # vLLM: as parsed, no re-serialisation
    assert for_worker(body, RequestHints(), _worker(None, "sglang")) is body  # no priority: untouched
    assert orjson.loads(for_worker(body, hints, _worker(None, "sglang")))["priority"] == 4
    assert orjson.loads(for_worker(body, hints, _worker("sglang", "mocker")))["priority"] == 4
    assert for_worker(body, hints, _worker("vllm", "sglang")) is body  # the spec overrides detection both ways
    assert (
        for_worker(body, hints, _worker(None, "sglang", low_first=True)) is body
    )  # --schedule-low-priority-values-first


def test_engine_spec_key_is_validated():
    from frontend.pool.workers import WorkerSpec, parse_worker_arg

    assert parse_worker_arg("id=1,url=http://127.0.0.1:1,engine=SGLang").engine == "sglang"
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang"):
        WorkerSpec.from_mapping({"id": 1, "url": "http://127.0.0.1:1", "engine": "trtllm"})
