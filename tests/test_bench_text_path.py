"""The text-path benchmark's harness (python -m bench text_path): every variant encodes the schedule to the
same ids (the harness exits otherwise) and reports a row; no figure is asserted."""

from __future__ import annotations

import re

import pytest

from bench import text_path


def test_every_variant_reports_a_row_with_the_same_ids(capsys: pytest.CaptureFixture[str]) -> None:
    assert text_path.main(["--workload", "agentic-dense", "--rounds", "1", "--idle-gap-ms", "0.2"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (.+?) \| ([0-9.]+) \|$", out, re.M))
    idle = "chunk cache, idle 0.2 ms before each"
    assert set(rows) == {"whole prompts", "chunk cache", "chunk cache + turn memo", idle}
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
