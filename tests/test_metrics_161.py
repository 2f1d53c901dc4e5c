"""Metrics of Dynamo 1.6.1 that dashboards read (names from the installed ai-dynamo-runtime's
prometheus_names / binary strings): model_max_num_seqs, model_context_length, router queue pending ISL
and cached tokens, KV-event source mismatch and applied-event outcomes."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from frontend.request.hints import RequestHints
from frontend.routing.admission import AdmissionQueue
from support import free_ports, service, wait_until


def test_queue_pending_isl_and_cached_tokens():
    async def main() -> None:
        free = {"v": False}
        aq = AdmissionQueue("fcfs", 0.5, lambda m, h, t: free["v"], recheck_interval=0.0)
        calls = []

        def cached(n: int):
            def f() -> int:
                calls.append(n)
                return n

            return f

        first = asyncio.create_task(aq.wait("m", RequestHints(), new_tokens=100, cached_tokens=cached(32)))
        second = asyncio.create_task(aq.wait("m", RequestHints(), new_tokens=50, cached_tokens=cached(0)))
        for _ in range(100):
            await asyncio.sleep(0)
            if aq.depth("m") == 2:
                break
        assert aq.pending_tokens("m") == (150, 32)
        assert aq.pending_tokens("other") == (0, 0)
        free["v"] = True
        aq.notify("m")
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert aq.pending_tokens("m") == (0, 0)
        # a request admitted at once never computes its cached tokens
        await aq.wait("m", RequestHints(), new_tokens=10, cached_tokens=cached(999))
        assert 999 not in calls
        aq.close()

    asyncio.run(main())


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_frontend_exports_the_161_names():
    with contextlib.ExitStack() as stack:
        port, ev, rp, port2, fport = free_ports(5)  # one pick: no port handed out twice
        murl = f"http://127.0.0.1:{port}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--max-num-seqs",
                    "77",
                    "--max-model-len",
                    "4096",
                    "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{ev}",
                    "--replay-endpoint",
                    f"tcp://127.0.0.1:{rp}",
                ],
                ready_url=murl + "/health",
                timeout=90,
            )
        )
        murl2 = f"http://127.0.0.1:{port2}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port2),
                    "--no-kv-events",
                    "--max-num-seqs",
                    "64",
                    "--max-model-len",
                    "2048",
                ],
                ready_url=murl2 + "/health",
                timeout=90,
            )
        )
        url = f"http://127.0.0.1:{fport}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "frontend",
                    "--http-host",
                    "127.0.0.1",
                    "--http-port",
                    str(fport),
                    "--router-mode",
                    "kv",
                    "--router-queue-threshold",
                    "4",
                    "--health-check-interval",
                    "0.5",
                    "--worker",
                    f"id=1,url={murl},kv_events_endpoint=tcp://127.0.0.1:{ev},replay_endpoint=tcp://127.0.0.1:{rp}",
                    "--worker",
                    f"id=2,url={murl2}",
                ],
                ready=lambda: len(httpx.get(url + "/v1/models", timeout=2).json()["data"]) == 1,
                timeout=90,
            )
        )
        wait_until(
            lambda: all(w["healthy"] for w in httpx.get(url + "/admin/workers").json()["workers"]), 30, what="healthy"
        )
        body = {
            "model": "kvroute-demo",
            "messages": [{"role": "user", "content": "hello " * 40}],
            "max_tokens": 2,
            "nvext": {"backend_instance_id": 1},
        }
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        text = wait_until(
            lambda: (
                (t := httpx.get(url + "/metrics").text)
                and (_metric(t, "dynamo_kvrouter_kv_cache_events_applied", event_type="stored", status="ok") or 0) > 0
                and t
            ),
            30,
            what="stored events counted",
        )
        assert (
            _metric(text, "dynamo_frontend_model_max_num_seqs", model="kvroute-demo") == 77
        )  # the largest of the workers (77, 64)
        assert (
            _metric(text, "dynamo_frontend_model_context_length", model="kvroute-demo") == 2048
        )  # every worker accepts it
        labels = dict(model="kvroute-demo", worker_type="decode", policy_class="default")
        assert _metric(text, "dynamo_frontend_router_queue_pending_isl_tokens", **labels) == 0
        assert _metric(text, "dynamo_frontend_router_queue_pending_cached_tokens", **labels) == 0
        # worker 2 is healthy but publishes no KV events although the router runs on them
        assert (
            _metric(
                text,
                "dynamo_component_router_kv_event_source_mismatch_workers",
                model="kvroute-demo",
                worker_type="decode",
            )
            == 1
        )
