"""Tokenizer parity proven before traffic, against mockers serving vLLM's render routes
(``--enable-scale-out``): a worker whose rendering matches the router's shows it, one started with
another chat template raises the hash-parity alarm as soon as it joins (no request routed yet) with
the first differing position and both texts, and one without the routes is left to request-time
evidence. The same against real vLLM is in tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import contextlib

from support import frontend_client, mocker_url, wait_until

MODEL = "render-probe"
OTHER_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def mocker(*flags: str) -> contextlib.AbstractContextManager[str]:
    return mocker_url(MODEL, *flags)


def _metric(text: str, name: str, worker: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'worker="{worker}"' in line
    )


def test_rendering_is_compared_when_a_worker_joins_before_any_request() -> None:
    with (
        mocker("--enable-scale-out", "--enable-lora", "--lora-modules", "a1=/adapters/a1") as same,
        mocker("--enable-scale-out", "--chat-template", OTHER_TEMPLATE) as other,
        mocker() as plain,
    ):
        with frontend_client([same, other, plain]) as fe:

            def parity() -> dict[int, dict]:
                rows = fe.get("/admin/workers").json()["workers"]
                return {w["id"]: w.get("hash_parity", {}).get("render") for w in rows}

            checks = wait_until(lambda: (p := parity()) and all(p.values()) and p, 30, what="render checks")
            assert checks[1]["status"] == "match"
            assert checks[1]["probes"] == {
                "chat_with_system": "match",
                "chat_with_tools": "match",
                "chat_tool_choice_none": "match",
                "completion": "match",
                "lora_a1": "match",
                "anthropic_messages": "match",
            }
            assert checks[2]["status"] == "mismatch"
            assert checks[2]["probes"]["completion"] == "match"  # no template: the same tokens
            assert checks[2]["probes"]["chat_with_system"] == checks[2]["probes"]["chat_with_tools"] == "mismatch"
            diff = checks[2]["first_difference"]
            assert diff["probe"] == "chat_with_system" and diff["position"] >= 0
            assert "<<system>>" in diff["engine_text"] and "<<system>>" not in diff["router_text"]
            assert checks[3]["status"] == "unavailable"
            # completions tokenize alike on all three (rendered, or through /tokenize where there is no render
            # route): each may be sent the router's ids (--send-token-ids auto)
            assert [checks[w]["prompt_ids"] for w in (1, 2, 3)] == ["match"] * 3

            rows = {w["id"]: w for w in fe.get("/admin/workers").json()["workers"]}
            assert rows[2]["hash_parity"]["mismatch"] is True
            assert "render" in rows[2]["hash_parity"]["likely_cause"]
            assert rows[1]["hash_parity"]["mismatch"] is False
            assert all(rows[w]["prompt_ids_proven"] for w in (1, 2, 3))
            text = fe.get("/metrics").text
            assert _metric(text, "kvroute_hash_parity_mismatch", "2") == 1
            assert _metric(text, "kvroute_hash_parity_mismatch", "1") == 0
            routed = [ln for ln in text.splitlines() if ln.startswith("dynamo_frontend_requests_total{")]
            assert sum(float(ln.rsplit(" ", 1)[1]) for ln in routed) == 0  # before any request
            assert (
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("kvroute_hash_parity_checks_total{")
                    and 'source="render"' in line
                    and 'worker="2"' in line
                    and 'result="mismatch"' in line
                )
                == 4
            )  # the three chat probes and the Messages probe
