"""The screenshot-heavy agentic benchmark (python -m bench screenshots): its schedule has the shape agents
send, and its --quick form runs through real mockers serving the tiny VLM's files, where kv-aware routing
reuses more than round robin on keys the engines agree with. Not a benchmark: no latency is asserted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bench import screenshots
from bench.traces import oracle, oracle_of_keys

TINY = replace(screenshots.ScreenshotWorkload(), sessions=3, turns=3, prefixes=1, prefix_tokens=(300, 400),
               screen=(320, 200), noise=(16, 16))  # fmt: skip


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield screenshots.write_model(str(tmp_path_factory.mktemp("tiny-vlm")))


def images_of(messages: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p["type"] == "image_url"]  # fmt: skip


def test_every_turn_sends_the_history_and_a_new_screenshot(vlm_dir: str) -> None:
    """Turn k+1 repeats turn k's messages (with its reply) and adds a screenshot never sent before; with
    --keep-screenshots K only the last K screenshots stay. Keys with image identities reuse less than
    plain token ids claim: sessions on one system prompt open with different screenshots of one size,
    alike as placeholder tokens."""
    st = screenshots.build_trace(TINY, vlm_dir)
    by_session: dict[int | None, list] = {}
    for r in st.trace.requests:
        by_session.setdefault(r.session, []).append(r)
    seen: set[str] = set()
    for turns in by_session.values():
        assert len(turns) == TINY.turns
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert cur.tokens[: len(prev.tokens) - 1] == prev.tokens[:-1]
        for r in turns:
            new = images_of(r.messages)[-1]
            assert new not in seen
            seen.add(new)
    assert (
        oracle_of_keys(st.keyed, screenshots.BLOCK_SIZE).hit_blocks
        < oracle([r.tokens for r in st.trace.requests], screenshots.BLOCK_SIZE).hit_blocks
    )
    kept = screenshots.build_trace(replace(TINY, keep_screenshots=1), vlm_dir)
    assert all(len(images_of(r.messages)) == 1 for r in kept.trace.requests)


def test_quick_run_kv_beats_round_robin_on_keys_the_engines_share(vlm_dir: str, tmp_path: Path) -> None:
    """``--quick`` through the harness, kv and round robin on fresh mockers: every request answered, the
    kv router's predicted cached tokens are the ones the engines report (image-aware keys agree), no
    parity alarm, and kv reuses clearly more than round robin."""
    argv = ["--quick", "--modes", "kvroute-kv,round_robin", "--model-dir", vlm_dir, "--out-dir", str(tmp_path)]
    assert screenshots.main(argv) == 0
    report = json.loads((tmp_path / "screenshots-quick.json").read_text())
    rows = {r["router"]: r for r in report["routers"]}
    for row in rows.values():
        assert row["completed"] == row["requests"] == report["trace"]["requests"], row["error_examples"]
        assert row["hit_rate"] is not None and row["router_cpu_ms_per_request"] is not None
        assert not row["frontend"]["kvroute_hash_parity_mismatch"]
    kv, rr = rows["kvroute-kv"], rows["round_robin"]
    predicted = kv["frontend"]["kvroute_router_captured_cached_tokens"]
    delivered = kv["frontend"]["kvroute_router_delivered_cached_tokens"]
    assert predicted > 0 and abs(predicted - delivered) <= 0.02 * delivered, (predicted, delivered)
    assert kv["hit_rate"] >= rr["hit_rate"] + 0.1, (kv["hit_rate"], rr["hit_rate"])
    assert kv["hit_rate"] <= report["oracle"]["token_share"] + 0.01
