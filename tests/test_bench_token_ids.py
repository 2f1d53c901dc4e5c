"""The token-ids benchmark (python -m bench token_ids) on two real mockers: both sides of every prompt are
answered and reported; no figure is asserted."""

from __future__ import annotations

import re

import pytest

from bench import token_ids


def test_every_prompt_goes_as_text_and_as_ids_and_both_sides_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert token_ids.main(["--requests", "6", "--gap-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 prompts")
    rows = dict(
        (side, (float(p50), float(p90)))
        for side, p50, p90 in re.findall(r"^\| (text|ids) \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    )
    assert set(rows) == {"text", "ids"}
    assert all(0 < p50 <= p90 for p50, p90 in rows.values())
