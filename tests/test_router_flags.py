"""Every router flag of the router guide: listed in the flag reference (docs/flags.md), accepted by
`python -m frontend`, and either honoured or logged as having no effect (JetStream flags,
--router-event-threads). Session affinity hard vs soft end to end."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import uuid

import httpx
import pytest

from support import REPO_ROOT, free_ports, service, wait_until

MODEL = "kvroute-demo"


def documented_flags() -> dict[str, str]:
    """flag -> env from the flag reference's tables in docs/flags.md (both spellings of a boolean pair)."""
    text = open(os.path.join(REPO_ROOT, "docs", "flags.md"), encoding="utf-8").read()
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        env = cells[1].strip("`")
        for flag in re.findall(r"`(--[a-z0-9-]+)", cells[0]):
            out[flag] = env
    return out


def guide_router_flags() -> set[str]:
    """The router guide's flags, vendored as data (its source is named in the file's header)."""
    with open(os.path.join(REPO_ROOT, "tests", "data", "router_guide_flags.txt"), encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def test_the_flag_reference_lists_every_router_flag_of_the_guide():
    table = documented_flags()
    missing = guide_router_flags() - set(table)
    assert not missing, f"router guide flags missing from docs/flags.md: {sorted(missing)}"
    assert all(table[f].startswith("DYN_") for f in guide_router_flags())  # every guide flag has its DYN_* variable


def test_frontend_help_accepts_every_flag_of_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "frontend", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    from frontend.cli import build_parser

    parser = build_parser()
    samples = {
        "--router-mode": "kv",
        "--router-queue-policy": "wspt",
        "--router-session-affinity-mode": "soft",
        "--active-decode-blocks-threshold": "0.5",
        "--router-session-affinity-ttl-secs": "30",
        "--router-prune-target-ratio": "0.5",
        "--router-ttl-secs": "5",
        "--router-temperature": "0.5",
        "--router-kv-overlap-score-weight": "2",
        "--router-queue-threshold": "1.5",
        "--active-prefill-tokens-threshold-frac": "1.5",
        "--router-latency-prefill-tokens-per-s": "20000",
        "--router-latency-window": "50",
        "--router-latency-live-horizon": "5",
        "--router-latency-recompute-weight": "4",
        "--discovery": "static",
        "--discovery-backend": "static",
        "--discovery-selector": "kvroute.io/role=worker",
        "--etcd-endpoints": "http://127.0.0.1:2379",
        "--discovery-prefix": "/kvroute/",
        "--mm-hash-algorithm": "sha256",
        "--mm-model-id": "/models/vlm",
    }
    for flag, env in documented_flags().items():
        assert re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", out.stdout, re.M), f"{flag} not in --help"
        action = parser._option_string_actions[flag]
        value = samples.get(flag) or (next(iter(action.choices)) if action.choices else "8")  # a valid value
        args = [flag] if action.nargs == 0 else [flag, value]
        ns = parser.parse_args(args)  # accepted: no SystemExit
        assert ns is not None
        if env.startswith("DYN_ROUTER") or env.startswith("DYN_ACTIVE"):
            assert env in out.stdout or flag == "--router-block-size", f"{env} not documented in --help"


def test_block_size_aliases_and_env():
    from frontend.cli import build_parser
    from router.config import RouterConfig, add_router_args

    assert RouterConfig.from_args(build_parser().parse_args(["--router-block-size", "32"])).kv_cache_block_size == 32
    import argparse

    p = argparse.ArgumentParser()
    add_router_args(p, {"DYN_ROUTER_BLOCK_SIZE": "64"})
    assert p.parse_args([]).kv_cache_block_size == 64


def test_bad_values_are_rejected():
    from frontend.cli import build_parser

    for args in (
        ["--router-session-affinity-mode", "sticky"],
        ["--router-event-threads", "0"],
        ["--router-snapshot-threshold", "-1"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(args)


def test_jetstream_and_event_thread_flags_log_that_they_have_no_effect(caplog):
    from frontend.cli import build_parser, make_state

    ns = build_parser().parse_args(
        [
            "--router-durable-kv-events",
            "--router-reset-states",
            "--router-snapshot-threshold",
            "10",
            "--router-event-threads",
            "4",
            "--router-session-affinity-mode",
            "soft",
        ]
    )
    with caplog.at_level(logging.WARNING, logger="frontend"):
        state = make_state(ns)
    text = caplog.text
    for flag in (
        "--router-durable-kv-events",
        "--router-reset-states",
        "--router-snapshot-threshold",
        "--router-event-threads",
    ):
        assert f"{flag}" in text and "no effect" in text, f"{flag} not logged"
    assert state.config.router_session_affinity_mode == "soft"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="frontend"):
        make_state(build_parser().parse_args([]))
    assert "no effect" not in caplog.text  # defaults say nothing


# ---------------------------------------------------------------------------------------------
# session affinity mode, end to end (two mockers, one hard and one soft frontend)


@pytest.fixture(scope="module")
def two_frontends():
    with contextlib.ExitStack() as stack:
        workers = []
        for wid in (1, 2):
            port, ev, rp = free_ports(3)
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                service(
                    [
                        "-m",
                        "mocker",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--kv-events-endpoint",
                        f"tcp://127.0.0.1:{ev}",
                        "--replay-endpoint",
                        f"tcp://127.0.0.1:{rp}",
                    ],
                    ready_url=url + "/health",
                    timeout=90,
                )
            )
            workers.append(f"id={wid},url={url}")
        urls = {}
        for mode in ("hard", "soft"):
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
                "--router-session-affinity-ttl-secs",
                "300",
                "--router-session-affinity-mode",
                mode,
            ]
            for w in workers:
                args += ["--worker", w]
            stack.enter_context(
                service(args, ready=lambda url=url: httpx.get(url + "/v1/models", timeout=2).json()["data"], timeout=90)
            )
            urls[mode] = url
        yield urls


def _route(url: str, headers: dict) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} hello"}],
        "max_tokens": 2,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _worker(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["nvext"]["worker_id"]["decode_worker_id"]


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_session_affinity_mode(two_frontends, mode):
    url = two_frontends[mode]
    sid = f"s-{uuid.uuid4()}"
    assert _worker(_route(url, {"x-dynamo-session-id": sid, "x-dynamo-worker-instance-id": "1"})) == 1  # binds to 1
    assert _worker(_route(url, {"x-dynamo-session-id": sid})) == 1
    try:  # make worker 1 busy: any decode load exceeds the threshold; hold a stream open on it
        r = httpx.post(
            url + "/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 0.0001}, timeout=10
        )
        assert r.status_code == 200, r.text
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "long " * 100}],
            "max_tokens": 5000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"x-dynamo-worker-instance-id": "1"}, timeout=60
        ) as s:
            assert s.status_code == 200, s.read()
            lines = s.iter_lines()  # keep the iterator: dropping it closes the stream
            assert next(lines).startswith("data:")
            wait_until(
                lambda: any(
                    row["worker_id"] == 1 and row["active_decode_blocks"] > 0
                    for row in httpx.get(url + "/loads", timeout=5).json()
                ),
                20,
                what="worker 1 loaded",
            )
            r = _route(url, {"x-dynamo-session-id": sid})
            if mode == "hard":
                assert r.status_code == 529, r.text  # the bound worker or nothing
            else:
                assert _worker(r) == 2  # a preference: routed elsewhere...
        if mode == "soft":  # ...and the session follows to where it ran
            assert _worker(_route(url, {"x-dynamo-session-id": sid})) == 2
        else:
            wait_until(
                lambda: _route(url, {"x-dynamo-session-id": sid}).status_code == 200, 30, what="worker 1 free again"
            )
            assert _worker(_route(url, {"x-dynamo-session-id": sid})) == 1
    finally:
        httpx.post(url + "/busy_threshold", json={"model": MODEL, "active_decode_blocks_threshold": 1.0}, timeout=10)
