"""nvext + routing headers + session identity -> RequestHints (frontend/request/hints.py)."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from frontend.request.hints import (
    MAX_SESSION_ID_BYTES,
    U32_MAX,
    U64_MAX,
    RequestHints,
    RequestTiming,
    engine_priority,
    kv_hit_rate,
    parse_request_hints,
    response_nvext,
)
from kvroute_common.http import ApiError


def parse(nvext=None, headers=None, **kw) -> RequestHints:
    body = {"model": "m", "messages": []}
    if nvext is not None:
        body["nvext"] = nvext
    hints = parse_request_hints(body, Headers(headers or {}), **kw)
    assert "nvext" not in body  # always stripped before the worker sees the body
    return hints


def bad(nvext) -> str:
    with pytest.raises(ApiError) as ei:
        parse(nvext)
    assert ei.value.status == 400
    assert ei.value.message.startswith("invalid nvext")
    return ei.value.message


# --- nvext body ---------------------------------------------------------------------------------


def test_no_nvext_no_headers_gives_empty_hints():
    h = parse()
    assert h == RequestHints()
    assert not h.is_pinned and h.priority_jump == 0.0 and h.queue_tier == 0
    assert h.session_id is None and not h.want_timing and not h.want_worker_id


def test_empty_or_null_nvext_is_absent():
    assert parse({}) == RequestHints()
    body = {"model": "m", "nvext": None}
    assert parse_request_hints(body, Headers({})) == RequestHints()
    assert "nvext" not in body


def test_every_nvext_field_is_read():
    h = parse(
        {
            "greed_sampling": True,
            "use_raw_prompt": False,
            "annotations": ["formatted_prompt"],
            "backend_instance_id": 11,
            "token_data": [1, 2, 3],
            "max_thinking_tokens": 64,
            "cache_salt": "tenant-a",
            "extra_fields": ["worker_id", "timing", "stop_reason", "future_thing"],
            "metadata_upload": {"url": "s3://b/p"},
            "prefill_worker_id": 12,
            "decode_worker_id": 13,
            "dp_rank": 2,
            "prefill_dp_rank": 1,
            "agent_hints": {
                "priority": 5,
                "strict_priority": 2,
                "osl": 256,
                "speculative_prefill": True,
                "latency_sensitivity": 1.5,
            },
            "request_timestamp_ms": 1712345678901.5,
            "routing_constraints": {"required_taints": ["gpu-a"], "preferred_taints": {"fast": 1.5}},
            "router": {"ttft_target": 100.0, "itl_target": 10},
        }
    )
    assert (h.backend_instance_id, h.prefill_worker_id, h.decode_worker_id) == (11, 12, 13)
    assert (h.dp_rank, h.prefill_dp_rank) == (2, 1)
    assert (h.priority, h.strict_priority, h.osl, h.speculative_prefill, h.latency_sensitivity) == (
        5,
        2,
        256,
        True,
        1.5,
    )
    assert h.want_worker_id and h.want_timing  # unknown extra_fields items are ignored, not errors
    assert h.cache_salt == "tenant-a" and h.token_data == [1, 2, 3] and h.greed_sampling is True
    assert h.annotations == ["formatted_prompt"] and h.max_thinking_tokens == 64
    assert h.pinned_worker_id == 11 and h.pinned_dp_rank == 2 and h.is_pinned
    assert h.priority_jump == 5.0 and h.queue_tier == 2


@pytest.mark.parametrize(
    "nvext, where",
    [
        ({"unknown_field": 1}, "unknown field `unknown_field`"),
        ({"agent_context": {"session_id": "x"}}, "agent_context"),  # session identity is header-only
        ({"session_control": {}}, "session_control"),
        ({"agent_hints": {"nope": 1}}, "unknown field `nope`"),
        ({"agent_hints": {"priority": "high"}}, "$.agent_hints.priority"),
        ({"agent_hints": {"priority": 2**31}}, "$.agent_hints.priority"),
        ({"agent_hints": {"priority": 1.5}}, "$.agent_hints.priority"),
        ({"agent_hints": {"strict_priority": -1}}, "$.agent_hints.strict_priority"),
        ({"agent_hints": {"osl": -5}}, "$.agent_hints.osl"),
        ({"agent_hints": {"osl": 2**32}}, "$.agent_hints.osl"),
        ({"agent_hints": {"speculative_prefill": 1}}, "$.agent_hints.speculative_prefill"),
        ({"agent_hints": {"latency_sensitivity": "fast"}}, "$.agent_hints.latency_sensitivity"),
        ({"agent_hints": []}, "$.agent_hints"),
        ({"backend_instance_id": -1}, "$.backend_instance_id"),
        ({"backend_instance_id": "7"}, "$.backend_instance_id"),
        ({"backend_instance_id": True}, "$.backend_instance_id"),
        ({"backend_instance_id": 2**64}, "$.backend_instance_id"),
        ({"decode_worker_id": 2**64}, "$.decode_worker_id"),
        ({"dp_rank": -1}, "$.dp_rank"),
        ({"dp_rank": 2**32}, "$.dp_rank"),
        ({"extra_fields": "timing"}, "$.extra_fields"),
        ({"token_data": [1, -2]}, "$.token_data"),
        ({"metadata_upload": {}}, "url"),
        ({"metadata_upload": {"url": "  "}}, "metadata_upload.url"),
        ({"metadata_upload": {"url": "s3://x", "format": "json"}}, "format"),
        ({"routing_constraints": {"required": []}}, "required"),
        ({"router": {"ttft": 1}}, "ttft"),
    ],
)
def test_invalid_nvext_is_a_400_naming_the_problem(nvext, where):
    assert where in bad(nvext)


@pytest.mark.parametrize("value", ["x", 3, [1], True])
def test_nvext_that_is_not_an_object_is_a_400(value):
    assert "expected an object" in bad(value)


def test_u64_and_u32_edges_are_accepted():
    h = parse(
        {"backend_instance_id": U64_MAX, "dp_rank": U32_MAX - 1, "agent_hints": {"priority": -(2**31), "osl": U32_MAX}}
    )
    assert h.backend_instance_id == U64_MAX and h.dp_rank == U32_MAX - 1 and h.priority == -(2**31) and h.osl == U32_MAX


def test_prefill_dp_rank_sentinel_means_unset():
    assert parse({"prefill_dp_rank": U32_MAX}).prefill_dp_rank is None
    assert parse(headers={"x-dynamo-prefill-dp-rank": str(U32_MAX)}).prefill_dp_rank is None


def test_empty_cache_salt_is_absent_and_tenant_header_overrides():
    assert parse({"cache_salt": ""}).cache_salt is None
    assert parse({"cache_salt": "a"}, {"x-tenant-id": "b"}).cache_salt == "b"
    assert parse({"cache_salt": "a"}, {"x-tenant-id": ""}).cache_salt == "a"


def test_query_instance_id_annotation_turns_on_worker_id():
    assert parse({"annotations": ["query_instance_id:abc"]}).want_worker_id


def test_decode_worker_id_alone_pins_an_aggregated_request():
    h = parse({"decode_worker_id": 9})
    assert h.pinned_worker_id == 9 and h.is_pinned


# --- headers ------------------------------------------------------------------------------------


def test_worker_header_beats_nvext_and_sets_decode_worker_too():
    h = parse({"backend_instance_id": 1, "decode_worker_id": 2}, {"x-dynamo-worker-instance-id": "7"})
    assert h.backend_instance_id == 7 and h.decode_worker_id == 7 and h.pinned_worker_id == 7


@pytest.mark.parametrize(
    "header, value, attr, expected",
    [
        ("x-dynamo-worker-instance-id", "7", "backend_instance_id", 7),
        ("x-worker-instance-id", "8", "backend_instance_id", 8),
        ("x-dynamo-prefill-instance-id", "9", "prefill_worker_id", 9),
        ("x-prefill-instance-id", "10", "prefill_worker_id", 10),
        ("x-dynamo-dp-rank", "3", "dp_rank", 3),
        ("x-dp-rank", "4", "dp_rank", 4),
        ("x-data-parallel-rank", "5", "dp_rank", 5),
        ("x-dynamo-prefill-dp-rank", "6", "prefill_dp_rank", 6),
        ("x-prefill-dp-rank", "7", "prefill_dp_rank", 7),
        ("x-dynamo-request-priority", "12", "priority", 12),
        ("x-dynamo-request-priority", " -3 ", "priority", -3),
        ("x-dynamo-request-strict-priority", " 4", "strict_priority", 4),
        ("x-tenant-id", "t1", "cache_salt", "t1"),
        ("X-Dynamo-Worker-Instance-Id", "77", "backend_instance_id", 77),  # names are case-insensitive
        ("x-dynamo-worker-instance-id", str(U64_MAX), "backend_instance_id", U64_MAX),
    ],
)
def test_each_header_and_alias_overrides_the_body(header, value, attr, expected):
    body = {
        "backend_instance_id": 1,
        "prefill_worker_id": 1,
        "dp_rank": 0,
        "prefill_dp_rank": 0,
        "cache_salt": "body",
        "agent_hints": {"priority": 1, "strict_priority": 1},
    }
    assert getattr(parse(body, {header: value}), attr) == expected


def test_headers_work_without_any_nvext():
    h = parse(headers={"x-worker-instance-id": "5", "x-dp-rank": "1", "x-dynamo-request-priority": "2"})
    assert (h.backend_instance_id, h.decode_worker_id, h.dp_rank, h.priority) == (5, 5, 1, 2)


@pytest.mark.parametrize(
    "header, value, attr, body_value",
    [
        ("x-dynamo-worker-instance-id", "abc", "backend_instance_id", 1),
        ("x-dynamo-worker-instance-id", "-1", "backend_instance_id", 1),
        ("x-dynamo-worker-instance-id", str(2**64), "backend_instance_id", 1),
        ("x-dynamo-worker-instance-id", "1.0", "backend_instance_id", 1),
        ("x-dynamo-worker-instance-id", "", "backend_instance_id", 1),
        ("x-dynamo-dp-rank", "x", "dp_rank", 0),
        ("x-dynamo-dp-rank", str(2**32), "dp_rank", 0),
        ("x-dynamo-request-priority", "high", "priority", 1),
        ("x-dynamo-request-priority", str(2**31), "priority", 1),
        ("x-dynamo-request-priority", "1e3", "priority", 1),
        ("x-dynamo-request-strict-priority", "-1", "strict_priority", 1),
        ("x-dynamo-request-strict-priority", "²", "strict_priority", 1),
    ],
)
def test_unparsable_header_values_are_ignored(header, value, attr, body_value):
    body = {"backend_instance_id": 1, "dp_rank": 0, "agent_hints": {"priority": 1, "strict_priority": 1}}
    assert getattr(parse(body, {header: value}), attr) == body_value


def test_canonical_header_is_read_before_the_alias():
    h = parse(
        headers={
            "x-dynamo-worker-instance-id": "1",
            "x-worker-instance-id": "2",
            "x-dynamo-dp-rank": "3",
            "x-dp-rank": "4",
            "x-data-parallel-rank": "5",
        }
    )
    assert h.backend_instance_id == 1 and h.dp_rank == 3
    h = parse(headers={"x-dp-rank": "4", "x-data-parallel-rank": "5"})
    assert h.dp_rank == 4


def test_plain_mapping_and_pair_list_headers_work_too():
    body = {"model": "m"}
    assert parse_request_hints(body, {"X-Dynamo-Worker-Instance-Id": "3"}).backend_instance_id == 3
    assert parse_request_hints(body, [(b"x-dynamo-dp-rank", b"2")]).dp_rank == 2
    assert parse_request_hints(body, None) == RequestHints()


def test_disabled_nvext_strips_body_and_ignores_routing_headers_but_keeps_session():
    h = parse(
        {"backend_instance_id": 3},
        {"x-dynamo-worker-instance-id": "4", "x-dynamo-session-id": "s"},
        nvext_enabled=False,
    )
    assert h.backend_instance_id is None and h.session_id == "s"
    assert parse({"bogus": 1}, nvext_enabled=False) == RequestHints()  # not even validated


# --- priority -----------------------------------------------------------------------------------


def test_priority_resolution_and_jump():
    assert parse({"agent_hints": {"priority": 3}}).priority_jump == 3.0
    assert parse({"agent_hints": {"latency_sensitivity": 2.5}}).priority_jump == 2.5
    # priority (even 0) wins over the deprecated latency_sensitivity
    assert parse({"agent_hints": {"priority": 0, "latency_sensitivity": 9.0}}).priority_jump == 0.0
    # header priority wins over body priority and latency_sensitivity
    h = parse({"agent_hints": {"priority": 3, "latency_sensitivity": 9.0}}, {"x-dynamo-request-priority": "7"})
    assert h.priority == 7 and h.priority_jump == 7.0
    # negative values never move a request later in the router queue
    assert parse({"agent_hints": {"priority": -4}}).priority_jump == 0.0
    assert parse({"agent_hints": {"latency_sensitivity": -1.0}}).priority_jump == 0.0


def test_engine_priority_polarity():
    assert engine_priority(parse()) is None
    assert engine_priority(parse({"agent_hints": {"latency_sensitivity": 5.0}})) is None  # router-only
    h = parse({"agent_hints": {"priority": 5}})
    assert engine_priority(h) == -5  # vLLM: lower value = scheduled first
    assert engine_priority(h, "mocker") == -5
    assert engine_priority(h, "sglang") == 5
    assert engine_priority(parse(headers={"x-dynamo-request-priority": "-2"})) == 2
    # higher Dynamo priority -> smaller vLLM value -> scheduled first
    assert engine_priority(parse({"agent_hints": {"priority": 10}})) < engine_priority(
        parse({"agent_hints": {"priority": 1}})
    )


# --- session identity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers, sid, parent",
    [
        ({"x-dynamo-session-id": " s1 "}, "s1", None),
        ({"x-dynamo-session-id": "s1", "x-dynamo-parent-session-id": "p"}, "s1", "p"),
        ({"x-dynamo-session-id": "s1", "x-dynamo-parent-session-id": "s1"}, "s1", None),
        ({"x-dynamo-session-id": "s1", "x-claude-code-session-id": "c"}, "s1", None),  # dynamo first
        ({"x-dynamo-session-id": "  ", "x-session-id": "oc"}, "oc", None),  # empty ignored
        ({"x-claude-code-session-id": "root"}, "root", None),
        ({"x-claude-code-session-id": "root", "x-claude-code-agent-id": "sub"}, "sub", "root"),
        (
            {
                "x-claude-code-session-id": "root",
                "x-claude-code-agent-id": "sub",
                "x-claude-code-parent-agent-id": "mid",
            },
            "sub",
            "mid",
        ),
        ({"thread-id": "codex-1", "x-codex-parent-thread-id": "codex-0"}, "codex-1", "codex-0"),
        ({"x-deepseek-harness-session-id": "ds"}, "ds", None),
        ({"x-session-id": "oc", "x-parent-session-id": "op"}, "oc", "op"),
        ({"x-claude-code-session-id": "c", "thread-id": "t", "x-session-id": "o"}, "c", None),  # order
        ({"thread-id": "t", "x-session-id": "o"}, "t", None),
    ],
)
def test_session_id_from_headers(headers, sid, parent):
    h = parse(headers=headers)
    assert (h.session_id, h.parent_session_id) == (sid, parent)


def test_session_final_flag():
    assert parse(headers={"x-dynamo-session-id": "s", "x-dynamo-session-final": "true"}).session_final is True
    assert parse(headers={"x-dynamo-session-id": "s", "x-dynamo-session-final": "0"}).session_final is False
    assert parse(headers={"x-dynamo-session-id": "s", "x-dynamo-session-final": "maybe"}).session_final is None


def test_long_session_id_is_identity_only_here():
    # the 256-byte limit belongs to the session-affinity table (router/session.py): without affinity
    # a long id must not fail the request
    long_id = "a" * (MAX_SESSION_ID_BYTES + 10)
    assert parse(headers={"x-dynamo-session-id": long_id}).session_id == long_id


# --- response nvext -----------------------------------------------------------------------------


def test_response_nvext_only_when_requested():
    assert response_nvext(parse(), 3, 1, RequestTiming()) is None
    assert response_nvext(parse({"extra_fields": ["stop_reason"]}), 3, 1, RequestTiming()) is None


def test_response_nvext_worker_id_aggregated():
    ext = response_nvext(parse({"extra_fields": ["worker_id"]}), 3, 1, RequestTiming())
    assert ext == {
        "worker_id": {"prefill_worker_id": 3, "prefill_dp_rank": 1, "decode_worker_id": 3, "decode_dp_rank": 1}
    }
    assert response_nvext(parse({"extra_fields": ["worker_id"]}), 3, None) == {
        "worker_id": {"prefill_worker_id": 3, "decode_worker_id": 3}
    }


def test_response_nvext_timing():
    t = RequestTiming(received=100.0, received_wall_ms=1_700_000_000_000.0)
    t.dispatched, t.first_token, t.finished, t.kv_hit_rate = 100.002, 100.050, 100.500, 0.75
    ext = response_nvext(parse({"extra_fields": ["timing", "worker_id"]}), 4, 0, t)
    timing = ext["timing"]
    assert timing["request_received_ms"] == 1_700_000_000_000
    assert timing["prefill_wait_time_ms"] == pytest.approx(2.0)
    assert timing["prefill_time_ms"] == pytest.approx(48.0)
    assert timing["ttft_ms"] == pytest.approx(50.0)
    assert timing["total_time_ms"] == pytest.approx(500.0)
    assert timing["kv_hit_rate"] == 0.75
    assert ext["worker_id"]["decode_worker_id"] == 4
    # a chunk without finish_reason gets no timing (caller passes timing=None)
    assert response_nvext(parse({"extra_fields": ["timing"]}), 4, 0, None) is None


def test_timing_omits_what_did_not_happen():
    t = RequestTiming()
    assert set(t.as_dict()) == {"request_received_ms"}


def test_kv_hit_rate():
    assert kv_hit_rate(3, 64, 16) == 0.75
    assert kv_hit_rate(3, 60, 16) == 0.75  # ceil(60/16) = 4
    assert kv_hit_rate(0, 0, 16) == 0.0
    assert kv_hit_rate(5, 64, 16) == 1.0
