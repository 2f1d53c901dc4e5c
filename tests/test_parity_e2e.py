"""Issue 12 part B end to end: hash-parity alarm, hit-rate decomposition, KV-event health and the
routing record, through a real ``python -m frontend`` and real ``python -m mocker`` processes.

Three workers serve one model: worker 1 hashes exactly as the router does; worker 2 renders a
different chat template (a tokenizer directory whose template adds a system line), so its blocks
never match the router's; worker 3 runs 32-token blocks while its worker spec (and so the router)
says 16. The alarm must fire for 2 and 3, with the likely cause, and stay quiet for 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from test_extensions_e2e import MODEL, metric, metric_sum, run_frontend, run_mocker, words

from frontend.observability.parity import ParityMonitor
from support import REPO_ROOT, wait_until

BLOCK = 16


def _other_template_dir(root: Path) -> str:
    """The built-in tokenizer with a chat template that starts every prompt with a system line."""
    src = Path(REPO_ROOT) / "kvroute_common" / "tokenizer_data"
    dst = root / "other-template"
    shutil.copytree(src, dst)
    conf = json.loads((dst / "tokenizer_config.json").read_text())
    conf["chat_template"] = conf["chat_template"].replace(
        "{{ bos_token }}", "{{ bos_token }}{{ '<|im_start|>system\\nYou are another deployment.<|im_end|>\\n' }}", 1
    )
    (dst / "tokenizer_config.json").write_text(json.dumps(conf))
    return str(dst)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    other = _other_template_dir(tmp_path_factory.mktemp("tok"))
    with run_mocker(1) as w1, run_mocker(2, extra=("--model-path", other)) as w2, run_mocker(3, block_size=32) as w3:
        specs = [w1.spec(), w2.spec(), w3.spec() + f",block_size={BLOCK}"]
        with run_frontend(specs, [MODEL]) as url:
            yield url


def chat(content: str, system: str, **extra) -> dict:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    }
    body.update(extra)
    return body


def send(url: str, body: dict) -> tuple[dict, dict | None, bytes]:
    """(nvext or {}, usage or None, raw bytes) of a chat completion, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        obj = r.json()
        return obj.get("nvext") or {}, obj.get("usage"), r.content
    nvext: dict = {}
    usage = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        nvext.update(ev.get("nvext") or {})
        if ev.get("usage"):
            usage = ev["usage"]
    return nvext, usage, raw


def workers(url: str) -> dict[int, dict]:
    return {w["id"]: w for w in httpx.get(f"{url}/admin/workers", timeout=10).json()["workers"]}


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def test_parity_alarm_fires_for_mismatched_workers_only(cluster):
    url = cluster
    for wid in (1, 2, 3):
        system = f"worker {wid} parity system prompt: " + words(120, seed=f"parity-{wid}")
        for i in range(6):  # the first request meets a cold cache: no evidence; the rest repeat its prefix
            body = chat(words(8, seed=f"q-{wid}-{i}"), system, stream=bool(i % 2), nvext={"backend_instance_id": wid})
            send(url, body)

    def alarms() -> dict[int, float | None]:
        text = scrape(url)
        return {w: metric(text, "kvroute_hash_parity_mismatch", worker=str(w)) for w in (1, 2, 3)}

    wait_until(lambda: alarms()[2] == 1.0 and alarms()[3] == 1.0, timeout=30, what="alarms for workers 2 and 3")
    # the events re-checks (after the grace period) name worker 3's block size
    wait_until(
        lambda: "32-token" in (workers(url)[3]["hash_parity"].get("likely_cause") or ""),
        timeout=30,
        what="worker 3's cause",
    )
    # worker 1 has evidence, and it matches
    wait_until(
        lambda: (workers(url)[1].get("hash_parity") or {}).get("window_matches", 0) >= 6,
        timeout=30,
        what="worker 1 matches",
    )
    assert alarms()[1] == 0.0
    rows = workers(url)
    p1, p2, p3 = (rows[w]["hash_parity"] for w in (1, 2, 3))
    assert p1["mismatch"] is False and p1["matches"] >= 6 and "likely_cause" not in p1
    assert p2["mismatch"] is True and "tokenizer or chat template" in p2["likely_cause"], p2
    assert (
        p2["prompt_tokens_router_vs_engine"][0] < p2["prompt_tokens_router_vs_engine"][1]
    )  # the engine's template adds tokens
    assert p3["mismatch"] is True and "block size" in p3["likely_cause"] and "32-token" in p3["likely_cause"], p3
    text = scrape(url)
    assert metric_sum(text, "kvroute_hash_parity_checks_total", worker="1", source="events", result="mismatch") == 0
    assert (
        metric(text, "kvroute_hash_parity_checks_total", worker="1", source="events", result="match") >= 1
    )  # the cold request
    assert (
        metric(text, "kvroute_hash_parity_checks_total", worker="1", source="usage", result="match") >= 5
    )  # predicted hits
    assert metric(text, "kvroute_hash_parity_checks_total", worker="2", source="events", result="mismatch") >= 4
    # worker 3 stores new 32-token blocks only while its prompts grow past the shared prefix: fewer events checks
    assert metric(text, "kvroute_hash_parity_checks_total", worker="3", source="events", result="mismatch") >= 1
    assert metric(text, "kvroute_hash_parity_checks_total", worker="3", source="usage", result="mismatch") >= 4


def test_kv_event_health_per_worker(cluster):
    url = cluster
    send(url, chat(words(40), "health check", nvext={"backend_instance_id": 1}))
    rows = workers(url)
    for wid in (1, 2, 3):
        health = rows[wid]["kv_events"]["health"]["0"]
        assert health["gaps"] >= 0 and health["replays"] >= 0 and health["batches_dropped"] == 0
    h1 = wait_until(lambda: workers(url)[1]["kv_events"]["health"]["0"], what="worker 1 health")
    assert h1["events_received"] > 0 and h1["blocks_stored"] > 0 and h1["blocks_rejected_block_size"] == 0
    assert h1["last_event_age_seconds"] is not None and h1["last_event_age_seconds"] < 120
    h3 = workers(url)[3]["kv_events"]["health"]["0"]
    assert h3["blocks_rejected_block_size"] > 0 and h3["blocks_stored"] == 0
    text = scrape(url)
    assert metric(text, "kvroute_kv_events_received_total", worker_id="1", dp_rank="0") >= h1["events_received"]
    assert metric(text, "kvroute_kv_event_gaps_total", worker_id="2", dp_rank="0") is not None
    assert metric(text, "kvroute_kv_event_last_timestamp_seconds", worker_id="1", dp_rank="0") > 0


def test_stream_usage_is_asked_of_the_engine_and_stripped_unless_the_client_asked(cluster):
    url = cluster
    system = words(60, seed="usage-strip")
    _, usage, raw = send(url, chat("first", system, stream=True))
    assert (
        usage is None
        and b'"usage"' not in raw
        and b'"choices":[]' not in raw
        and raw.rstrip().endswith(b"data: [DONE]")
    )
    _, usage, raw = send(url, chat("second", system, stream=True, stream_options={"include_usage": True}))
    assert usage is not None and usage["prompt_tokens"] > 0 and "cached_tokens" in usage["prompt_tokens_details"]
    # the client's stream is otherwise the same shape: content chunks, one finish_reason
    assert raw.count(b'"finish_reason":"length"') == 1


def test_routing_record_on_the_real_request(cluster):
    url = cluster
    system = words(80, seed="routing-record")
    for stream in (False, True):
        ext, _, _ = send(
            url, chat(f"record {stream}", system, stream=stream, nvext={"extra_fields": ["routing", "worker_id"]})
        )
        rec = ext["routing"]
        assert rec["model"] == MODEL and rec["router_mode"] == "kv" and rec["block_size"] == BLOCK
        assert {c["worker_id"] for c in rec["candidates"]} == {1, 2, 3}
        chosen = [c for c in rec["candidates"] if c["selected"]]
        assert len(chosen) == 1 and (chosen[0]["worker_id"], chosen[0]["dp_rank"]) == (rec["worker_id"], rec["dp_rank"])
        assert ext["worker_id"]["decode_worker_id"] == rec["worker_id"]  # the record is the decision actually routed
        assert chosen[0]["cost"] == min(c["cost"] for c in rec["candidates"])  # temperature 0
        for c in rec["candidates"]:
            assert (
                c["logit"]
                == c["cost"]
                == pytest.approx(rec["overlap_score_weight"] * c["prefill_blocks"] + c["decode_blocks"])
            )
            assert c["prefill_tokens"] == rec["isl"] - c["overlap_blocks"] * BLOCK
        assert rec["overlap_blocks"] == chosen[0]["overlap_blocks"] <= rec["available_overlap_blocks"]
    # the /admin/route dry run answers in the same shape
    dry = httpx.post(f"{url}/admin/route", json=chat("dry", system), timeout=30).json()
    assert set(dry) == set(rec) and set(dry["candidates"][0]) == set(rec["candidates"][0])


def test_hit_rate_decomposition_adds_up_on_a_known_workload(cluster):
    """Three requests sharing a prefix: cold on worker 1, warm on worker 1 (captured = available =
    delivered), then worker 1 loaded so the router trades reuse for load (captured < available)."""
    url = cluster
    names = (
        "prompt_tokens",
        "available_cached_tokens",
        "captured_cached_tokens",
        "delivered_cached_tokens",
        "decomposed_requests",
    )

    def counters() -> dict[str, float]:
        text = scrape(url)
        return {n: metric(text, f"kvroute_router_{n}_total", model=MODEL) or 0.0 for n in names}

    before = counters()
    system = "decomposition: " + words(150, seed="decomposition")
    want = {"extra_fields": ["routing"]}
    records, usages = [], []

    def run(content: str, stream: bool, nvext: dict) -> None:
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        ext, usage, _ = send(url, chat(content, system, nvext={**want, **nvext}, **extra))
        records.append(ext["routing"])
        usages.append(usage)

    run("one", False, {"backend_instance_id": 1})
    assert records[0]["overlap_blocks"] == 0 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    probe = chat("two", system)
    wait_until(
        lambda: (
            next(
                c
                for c in httpx.post(f"{url}/admin/route", json=probe, timeout=10).json()["candidates"]
                if c["worker_id"] == 1
            )["overlap_blocks"]
            >= 8
        ),
        what="worker 1's blocks indexed",
    )
    run("two", True, {})
    assert records[1]["worker_id"] == 1 and records[1]["overlap_blocks"] == records[1]["available_overlap_blocks"] >= 8
    assert (
        usages[1]["prompt_tokens_details"]["cached_tokens"] == records[1]["overlap_blocks"] * BLOCK
    )  # parity: engine agrees
    # load worker 1 through the embedded tracker's API: its prefix is still the best, but too busy
    r = httpx.post(
        f"{url}/add",
        json={
            "model_name": MODEL,
            "request_id": "decomp-load",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": [],
            "new_isl_tokens": 100_000,
        },
        timeout=10,
    )
    assert r.status_code == 201, r.text
    try:
        run("three", False, {})
    finally:
        httpx.post(f"{url}/free", json={"model_name": MODEL, "request_id": "decomp-load"}, timeout=10)
    assert (
        records[2]["worker_id"] != 1
        and records[2]["overlap_blocks"] == 0
        and records[2]["available_overlap_blocks"] >= 8
    )

    expect = {
        "prompt_tokens": sum(r["isl"] for r in records),
        "available_cached_tokens": sum(min(r["available_overlap_blocks"] * BLOCK, r["isl"]) for r in records),
        "captured_cached_tokens": sum(min(r["overlap_blocks"] * BLOCK, r["isl"]) for r in records),
        "delivered_cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
        "decomposed_requests": 3,
    }
    assert [u["prompt_tokens"] for u in usages[:2]] == [
        r["isl"] for r in records[:2]
    ]  # worker 1 tokenizes as the router does
    after = wait_until(
        lambda: (c := counters())["decomposed_requests"] - before["decomposed_requests"] >= 3 and c, what="counted"
    )
    got = {n: after[n] - before[n] for n in names}
    assert got == expect
    assert got["captured_cached_tokens"] < got["available_cached_tokens"]  # the third request traded reuse for load
    assert got["delivered_cached_tokens"] >= records[1]["overlap_blocks"] * BLOCK


def test_evidence_is_sampled_after_the_warm_up_and_other_streams_pass_untouched():
    """``--parity-sample-every 4``: the first 64 requests and then one in four collect the engine's usage;
    the client's streams look the same either way, and a client that asked for usage gets it unsampled too."""
    warmup = ParityMonitor.WARMUP_REQUESTS
    with run_mocker(1) as w, run_frontend([w.spec()], [MODEL], "--parity-sample-every", "4") as url:
        system = "sampled evidence: " + words(40, seed="sampled")

        def decomposed() -> float:
            return metric(scrape(url), "kvroute_router_decomposed_requests_total", model=MODEL) or 0.0

        streams = [send(url, chat(f"q{i}", system, max_tokens=1, stream=True)) for i in range(warmup + 9)]
        for _, usage, raw in streams:  # sampled or not: no usage the client did not ask for
            assert usage is None and b'"usage"' not in raw and raw.rstrip().endswith(b"data: [DONE]")
        # requests 0..63, then 64, 68 and 72 of 64..72
        wait_until(lambda: decomposed() == warmup + 3, what="evidence from the sampled requests")
        _, usage, raw = send(url, chat("mine", system, stream=True, stream_options={"include_usage": True}))
        assert usage is not None and usage["prompt_tokens"] > 0  # request 73, not sampled: its usage passes
        _, usage, _ = send(url, chat("unary", system, max_tokens=1))  # request 74, not sampled
        assert usage is not None
        text = scrape(url)
        assert metric(text, "kvroute_router_decomposed_requests_total", model=MODEL) == warmup + 3
