"""Issue 12 part B, pure pieces: asking the engine for stream usage, reading it off the wire and
stripping it from a client stream that did not ask for it (events split at awkward places)."""

from __future__ import annotations

import orjson
from prometheus_client import CollectorRegistry

from frontend.observability.parity import (
    ParityMonitor,
    RequestProbe,
    UsageTap,
    parse_usage,
    stream_body_with_usage,
)


def test_stream_body_asks_for_usage_without_reserialising_when_it_can() -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    raw = orjson.dumps(body)
    sent, strip = stream_body_with_usage(body, raw)
    assert strip and orjson.loads(sent) == {**body, "stream_options": {"include_usage": True}}
    assert "stream_options" not in body  # spliced into the bytes, the dict is untouched

    body = {"model": "m", "stream": True, "prompt": "x"}
    assert stream_body_with_usage(body, None) == (None, True)  # the body will be serialised anyway
    assert body["stream_options"] == {"include_usage": True}

    body = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}}
    assert stream_body_with_usage(body, orjson.dumps(body)) == (None, True)
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}

    asked = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert stream_body_with_usage(asked, orjson.dumps(asked)) == (None, False)  # the client wants it: pass through
    bad = {"model": "m", "stream": True, "stream_options": "yes"}
    assert stream_body_with_usage(bad, orjson.dumps(bad)) == (None, False)  # the engine answers the 400
    assert bad["stream_options"] == "yes"


def _events(usage: dict) -> list[bytes]:
    content = [
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"'
        + t
        + b'"},"finish_reason":null}],"usage":null}\n\n'
        for t in (b"a", b"b")
    ]
    last = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}],"usage":null}\n\n'
    use = b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n"
    return [*content, last, use, b"data: [DONE]\n\n"]


def _probe() -> RequestProbe:
    return RequestProbe(ParityMonitor(CollectorRegistry(), lambda: None), None, None, None)  # type: ignore[arg-type]


def test_usage_tap_reads_and_strips_usage_across_any_chunking() -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    stream = b"".join(_events(usage))
    for cut in range(1, len(stream), 7):  # every way of splitting the stream in two, and small pieces
        for strip in (True, False):
            probe = _probe()
            tap = UsageTap(probe, strip)
            pieces = [stream[:cut], stream[cut:]] if cut % 2 else [stream[i : i + 5] for i in range(0, len(stream), 5)]
            out = b"".join(tap.feed(p) for p in pieces) + tap.flush()
            assert (probe.prompt_tokens, probe.cached_tokens) == (40, 32)
            if strip:
                assert b"usage" not in out and b'"choices":[]' not in out
                assert out.count(b"data: ") == 4 and out.endswith(b"data: [DONE]\n\n")
                for ev in out.split(b"\n\n")[:3]:
                    orjson.loads(ev[6:])  # every event still parses
            else:
                assert out == stream


def test_usage_tap_handles_spaced_json_and_leaves_quoted_text_alone() -> None:
    usage_ev = (
        b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, '
        b'"prompt_tokens_details": {"cached_tokens": 0}}}\n\n'
    )
    text_ev = (
        b'data: {"id": "c", "choices": [{"delta": {"content": "say \\"usage\\": null, \\"prompt_tokens\\""}}], '
        b'"usage": null}\n\n'
    )
    probe = _probe()
    tap = UsageTap(probe, True)
    out = tap.feed(text_ev) + tap.feed(usage_ev + b"data: [DONE]\n\n")
    assert (probe.prompt_tokens, probe.cached_tokens) == (5, 0)
    assert out == text_ev.replace(b', "usage": null', b"") + b"data: [DONE]\n\n"
    assert (
        orjson.loads(out.split(b"\n\n")[0][6:])["choices"][0]["delta"]["content"]
        == 'say "usage": null, "prompt_tokens"'
    )


def test_usage_tap_with_crlf_events_and_a_stream_without_event_ends() -> None:
    usage = {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0}}
    stream = b"".join(_events(usage)).replace(b"\n\n", b"\r\n\r\n")
    probe = _probe()
    tap = UsageTap(probe, True)
    out = b"".join(tap.feed(stream[i : i + 9]) for i in range(0, len(stream), 9)) + tap.flush()
    assert (probe.prompt_tokens, probe.cached_tokens) == (12, 0)
    assert b"usage" not in out and out.count(b"data: ") == 4 and out.endswith(b"data: [DONE]\r\n\r\n")
    # no event end ever: bytes are held only up to MAX_HELD, then passed on
    tap = UsageTap(None, True)
    blob = b"x" * (UsageTap.MAX_HELD + 10)
    assert tap.feed(blob[:100]) == b"" and tap.feed(blob[100:]) == blob


def test_parse_usage_of_a_body_and_of_an_engine_without_cache_report() -> None:
    body = orjson.dumps(
        {
            "choices": [{"message": {"content": "x"}}],
            "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
        }
    )
    assert parse_usage(body) == (7, 0)
    assert parse_usage(b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": null}}') == (9, None)
    assert parse_usage(b'{"choices": []}') == (None, None)


def test_alarm_needs_repeated_mismatches_without_a_match_and_one_match_clears_it(caplog) -> None:
    reg = CollectorRegistry()
    mon = ParityMonitor(reg, lambda: None, window=16, min_mismatches=4)

    def gauge(worker: int) -> float | None:
        return reg.get_sample_value("kvroute_hash_parity_mismatch", {"worker": str(worker)})

    # a healthy worker: a stray mismatch (eviction, lagging events) among matches never alarms
    for matched in (True, False, True, True, False, False, False, True):
        assert mon.record(1, "usage", matched, 16) is False
    assert gauge(1) == 0.0
    # a mismatched worker: three pieces are not enough evidence, the fourth raises the alarm with a log line
    with caplog.at_level("WARNING", logger="frontend.observability.parity"):
        assert [mon.record(2, "events", False, 16) for _ in range(4)] == [False, False, False, True]
    assert gauge(2) == 1.0 and mon.describe(2)["mismatch"] is True
    assert any("worker 2" in r.getMessage() and "never match" in r.getMessage() for r in caplog.records)
    assert mon.record(2, "events", True, 16) is False and gauge(2) == 0.0  # one match proves parity
    assert (
        reg.get_sample_value(
            "kvroute_hash_parity_checks_total", {"worker": "2", "source": "events", "result": "mismatch"}
        )
        == 4
    )
    mon.forget(2)
    assert mon.describe(2) is None and gauge(2) is None


def test_evidence_sampled_after_the_warm_up() -> None:
    warm = ParityMonitor.WARMUP_REQUESTS
    every = ParityMonitor(CollectorRegistry(), lambda: None)  # the monitor's own default: every request
    assert all(every.sample() for _ in range(warm + 50))
    mon = ParityMonitor(CollectorRegistry(), lambda: None, sample_every=8)
    picked = [n for n in range(warm + 40) if mon.sample()]
    assert picked == [*range(warm), warm, warm + 8, warm + 16, warm + 24, warm + 32]
