"""Disaggregated prefill/decode end to end: real `python -m frontend` in front of real prefill-role and
decode-role `python -m mocker` processes (HTTP + ZMQ KV events), driven with the openai SDK and httpx.

Frontend A: two prefill workers (role=prefill) and one decode worker (role=decode), kv mode. Every
request is prefilled on a prefill worker (chosen by the prefill router from the prefill workers' KV
events) and decoded on the decode worker, which receives the prompt's blocks by "transfer" and never
computes them. Frontend B: the fallbacks: a prefill worker that fails (a decode-role engine that
refuses to prefill for remote decode), then one that is gone.
"""

from __future__ import annotations

import contextlib
import re
import uuid

import httpx
import openai
import pytest

from support import free_ports, service, wait_until

MODEL = "kvroute-demo"
START = 90.0
WAIT = 30.0


class Mock:
    def __init__(self, role: str, stack: contextlib.ExitStack) -> None:
        self.port, self.events, self.replay = free_ports(3)
        self.role = role
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--role",
                    role,
                    "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{self.events}",
                    "--replay-endpoint",
                    f"tcp://127.0.0.1:{self.replay}",
                    "--num-gpu-blocks",
                    "2048",
                ],
                ready_url=self.url + "/health",
                timeout=START,
            )
        )

    def worker(self, wid: int, role: str) -> str:
        return (
            f"id={wid},url={self.url},role={role},kv_events_endpoint=tcp://127.0.0.1:{self.events},"
            f"replay_endpoint=tcp://127.0.0.1:{self.replay}"
        )

    def stats(self) -> dict:
        return httpx.get(self.url + "/mocker/kv_blocks", timeout=10).json()


class Front:
    def __init__(self, workers: list[str], stack: contextlib.ExitStack) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            "-m",
            "frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.port),
            "--router-mode",
            "kv",
            "--health-check-interval",
            "0.5",
            "--log-level",
            "warning",
        ]
        for w in workers:
            args += ["--worker", w]
        self.proc = stack.enter_context(service(args, ready_url=self.url + "/health", timeout=START))
        self.http = stack.enter_context(httpx.Client(base_url=self.url, timeout=60.0))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def idle(self) -> bool:
        return all(
            r["active_prefill_tokens"] == 0 and r["active_decode_blocks"] == 0 for r in self.http.get("/loads").json()
        )


def prompt(tag: str) -> list[dict]:
    return [
        {"role": "system", "content": f"[{tag}] " + " ".join(f"fact{i} about {tag}." for i in range(60))},
        {"role": "user", "content": "and so?"},
    ]


@pytest.fixture(scope="module")
def cluster():
    with contextlib.ExitStack() as stack:
        p1, p2 = Mock("prefill", stack), Mock("prefill", stack)
        d = Mock("decode", stack)
        fe = Front([p1.worker(1, "prefill"), p2.worker(2, "prefill"), d.worker(3, "decode")], stack)
        wait_until(lambda: fe.http.get("/v1/models").json()["data"], WAIT, what="model served")
        wait_until(
            lambda: {w["id"] for w in fe.http.get("/admin/workers").json()["workers"] if w["healthy"]} == {1, 2, 3},
            WAIT,
            what="all workers healthy",
        )
        yield fe, {1: p1, 2: p2}, d


def _chat(fe: Front, messages: list[dict], nvext: dict | None = None, headers: dict | None = None, **kw):
    kw.setdefault("max_tokens", 8)
    comp = fe.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_headers=headers or {},
        extra_body={"nvext": {"extra_fields": ["worker_id"], **(nvext or {})}},
        **kw,
    )
    return comp, comp.model_extra["nvext"]["worker_id"]


def test_unary_is_prefilled_remotely_and_decode_never_computes_the_prompt(cluster):
    fe, prefills, d = cluster
    before_d = d.stats()
    before_p = {wid: m.stats()["computed_prompt_tokens"] for wid, m in prefills.items()}
    remote = fe.metric("kvroute_disagg_prefill_requests_total", outcome="remote")
    comp, info = _chat(fe, prompt(uuid.uuid4().hex), max_tokens=8)
    assert comp.choices[0].message.content
    assert comp.choices[0].finish_reason in ("stop", "length")
    isl = comp.usage.prompt_tokens
    assert isl > 100
    assert "kv_transfer_params" not in comp.model_extra  # the client sees a normal response
    assert info["decode_worker_id"] == 3
    assert info["prefill_worker_id"] in (1, 2)
    after_d = d.stats()
    # the decode engine computed only the last prompt token; the rest arrived by transfer
    assert after_d["computed_prompt_tokens"] - before_d["computed_prompt_tokens"] == 1
    assert after_d["remote_kv_tokens"] - before_d["remote_kv_tokens"] == isl - 1
    p = prefills[info["prefill_worker_id"]]
    assert p.stats()["computed_prompt_tokens"] - before_p[info["prefill_worker_id"]] == isl
    assert fe.metric("kvroute_disagg_prefill_requests_total", outcome="remote") == remote + 1
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_stream_is_normal(cluster):
    fe, prefills, d = cluster
    before = d.stats()
    chunks = list(
        fe.client.chat.completions.create(
            model=MODEL,
            messages=prompt(uuid.uuid4().hex),
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    info = finals[0].model_extra["nvext"]["worker_id"]
    assert info["decode_worker_id"] == 3 and info["prefill_worker_id"] in (1, 2)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 1
    after = d.stats()
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == 1
    assert after["remote_kv_tokens"] - before["remote_kv_tokens"] == usage.prompt_tokens - 1
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_prefill_router_follows_the_prefill_workers_kv_events(cluster):
    fe, prefills, d = cluster
    msgs = prompt(uuid.uuid4().hex)
    _, info = _chat(fe, msgs, max_tokens=2)
    first = info["prefill_worker_id"]

    def cached_on_first() -> bool:
        ex = fe.http.post("/admin/route", json={"model": MODEL, "messages": msgs}).json()
        cands = {c["worker_id"]: c["overlap_blocks"] for c in ex["prefill"]["candidates"]}
        return cands[first] > 0 and cands[3 - first] == 0

    # the prefill worker's BlockStored events reached the prefill router's index
    wait_until(cached_on_first, WAIT, what="prefill worker's KV events indexed")
    for _ in range(3):
        _, info = _chat(fe, msgs, max_tokens=2)
        assert info["prefill_worker_id"] == first
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_prefill_pins(cluster):
    fe, prefills, d = cluster
    msgs = prompt(uuid.uuid4().hex)
    _, info = _chat(fe, msgs, nvext={"prefill_worker_id": 2})
    assert info["prefill_worker_id"] == 2 and info["decode_worker_id"] == 3
    _, info = _chat(fe, msgs, headers={"x-dynamo-prefill-instance-id": "1", "x-dynamo-prefill-dp-rank": "0"})
    assert info["prefill_worker_id"] == 1 and info["prefill_dp_rank"] == 0
    with pytest.raises(openai.BadRequestError) as err:
        _chat(fe, msgs, nvext={"prefill_worker_id": 3})  # the decode worker is not a prefill worker
    assert "not a prefill worker" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        _chat(fe, msgs, nvext={"prefill_worker_id": 1, "prefill_dp_rank": 5})
    wait_until(fe.idle, WAIT, what="loads back to zero")


def test_metrics_show_both_pools(cluster):
    fe, prefills, d = cluster
    _chat(fe, prompt(uuid.uuid4().hex), max_tokens=2)
    text = fe.http.get("/metrics").text
    assert re.search(
        r'dynamo_component_router_worker_registered\{[^}]*router_worker_id="1"[^}]*worker_type="prefill"', text
    )
    assert re.search(
        r'dynamo_component_router_worker_registered\{[^}]*router_worker_id="3"[^}]*worker_type="decode"', text
    )
    assert re.search(r'dynamo_frontend_worker_last_time_to_first_token_seconds\{[^}]*worker_type="prefill"', text)
    assert fe.metric("kvroute_disagg_prefill_requests_total", outcome="remote") >= 1


def test_fallback_to_decode_only():
    with contextlib.ExitStack() as stack:
        bad = Mock("decode", stack)  # registered as a prefill worker, but refuses to prefill for remote decode
        d = Mock("decode", stack)
        fe = Front([bad.worker(1, "prefill"), d.worker(2, "decode")], stack)
        wait_until(
            lambda: {w["id"] for w in fe.http.get("/admin/workers").json()["workers"] if w["healthy"]} == {1, 2},
            WAIT,
            what="workers healthy",
        )
        wait_until(lambda: fe.http.get("/v1/models").json()["data"], WAIT, what="model served")

        # 1. the prefill phase fails: the original request is served decode-only
        before = d.stats()
        comp, info = _chat(fe, prompt(uuid.uuid4().hex), max_tokens=4)
        assert comp.choices[0].message.content
        assert info["decode_worker_id"] == 2 and info["prefill_worker_id"] == 2  # aggregated on the decode worker
        after = d.stats()
        assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == comp.usage.prompt_tokens
        assert after["remote_kv_tokens"] == before["remote_kv_tokens"]
        assert fe.metric("kvroute_disagg_prefill_requests_total", outcome="prefill_failed") == 1

        # 2. the prefill worker is gone: no prefill worker available, decode-only again (stream)
        from support import stop_process

        stop_process(bad.proc)
        wait_until(
            lambda: not next(w for w in fe.http.get("/admin/workers").json()["workers"] if w["id"] == 1)["healthy"],
            WAIT,
            what="prefill worker unhealthy",
        )
        chunks = list(
            fe.client.chat.completions.create(model=MODEL, messages=prompt(uuid.uuid4().hex), max_tokens=4, stream=True)
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert fe.metric("kvroute_disagg_prefill_requests_total", outcome="no_prefill_worker") == 1
        wait_until(fe.idle, WAIT, what="loads back to zero")


def test_routing_record_shows_both_decisions(cluster):
    fe, prefills, d = cluster
    comp, info = _chat(fe, prompt(uuid.uuid4().hex), nvext={"extra_fields": ["worker_id", "routing"]}, max_tokens=2)
    rec = comp.model_extra["nvext"]["routing"]
    assert rec["worker_id"] == 3 and rec["overlap_score_weight"] == 0.0  # decode: load only
    assert rec["prefill"]["worker_id"] == info["prefill_worker_id"] in (1, 2)
    assert {c["worker_id"] for c in rec["prefill"]["candidates"]} == {1, 2}  # the prefill pool's candidates
    ex = fe.http.post("/admin/route", json={"model": MODEL, "messages": prompt("x")}).json()
    assert (
        ex["overlap_score_weight"] == 0.0
        and {c["worker_id"] for c in ex["candidates"]} == {3}
        and {c["worker_id"] for c in ex["prefill"]["candidates"]} == {1, 2}
    )
