"""The text-path benchmark's harness (python -m bench text_path): every variant encodes the schedule to the
same ids (the harness exits otherwise) and reports a row; no figure is asserted."""

from __future__ import annotations

import re

import pytest

from bench import text_path


def test_every_variant_reports_a_row_with_the_same_ids(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "agentic-dense", "--rounds", "1", "--idle-gap-ms", "0.2", "--evict-mb", "1"]
    assert text_path.main(argv) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (.+?) \| ([0-9.]+) \|$", out, re.M))
    idle = "chunk cache, idle 0.2 ms before each"
    evicted = "chunk cache + turn memo, 1 MB evicted before each"
    assert set(rows) == {"whole prompts", "chunk cache", "chunk cache + turn memo", idle, evicted}
    assert all(float(ms) > 0 for ms in rows.values())


def test_the_idle_gap_is_spent_before_each_prompt() -> None:
    """``run`` sleeps the gap before every prompt (the wall time holds it), and the ids do not change."""
    import time

    from kvroute_common.tokenizer import PromptEncoder, load_tokenizer

    prompts = ["a short prompt " * 8, "another one, a little longer " * 40, "and a third " * 100]
    hot = text_path.run(PromptEncoder(load_tokenizer(None)), prompts, 32, 0)
    t0 = time.monotonic()
    idle = text_path.run(PromptEncoder(load_tokenizer(None)), prompts, 32, 0, idle_gap_s=0.02)
    assert time.monotonic() - t0 >= 3 * 0.02
    assert idle[1] == hot[1]
    assert len(idle[0]) == len(prompts)


def test_the_eviction_buffer_is_written_before_each_prompt() -> None:
    """``run`` writes a byte of every cache line of ``evict`` before each prompt; the ids do not change."""
    from kvroute_common.tokenizer import PromptEncoder, load_tokenizer

    prompts = ["a short prompt " * 8, "another one, a little longer " * 40]
    hot = text_path.run(PromptEncoder(load_tokenizer(None)), prompts, 32, 0, turns=True)
    evict = bytearray(b"\x01" * (4 * text_path.CACHE_LINE))
    cold = text_path.run(PromptEncoder(load_tokenizer(None)), prompts, 32, 0, turns=True, evict=evict)
    assert cold[1] == hot[1]
    assert evict[:: text_path.CACHE_LINE] == bytes(4)  # written
    assert evict.count(1) == 4 * text_path.CACHE_LINE - 4  # one byte a line, the rest untouched
