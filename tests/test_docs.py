"""The documentation cannot drift from the code: the flag reference is what the CLI defines, every
relative link resolves, and the README stays a landing page."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from frontend.cli import build_parser
from frontend.flag_reference import BEGIN, END, markdown, rows, splice
from support import REPO_ROOT

DOCS = ["README.md", *(f"docs/{n}" for n in sorted(os.listdir(os.path.join(REPO_ROOT, "docs"))) if n.endswith(".md"))]


def read(path: str) -> str:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_the_flag_reference_is_the_one_the_cli_generates() -> None:
    document = read("docs/flags.md")
    generated = markdown(build_parser)
    assert document.count(BEGIN) == 1 and document.count(END) == 1
    assert splice(document, generated) == document, (
        "docs/flags.md is stale: python -m frontend flags --write docs/flags.md"
    )


def test_every_flag_of_the_cli_is_documented_and_no_other() -> None:
    parser = build_parser()
    documented = {m for _, table in rows(parser) for flags, *_ in table for m in re.findall(r"`(--[a-z0-9-]+)", flags)}
    defined = {
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }
    assert documented == defined
    table = read("docs/flags.md")
    assert "| `--router-mode` | `DYN_ROUTER_MODE` | round_robin |" in table
    assert "| `--router-kv-events` / `--no-router-kv-events` | `DYN_ROUTER_USE_KV_EVENTS` | on |" in table


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_resolve(path: str) -> None:
    base = os.path.dirname(os.path.join(REPO_ROOT, path))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(path)):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert os.path.exists(os.path.normpath(os.path.join(base, target))), f"{path}: broken link {target}"


def test_the_readme_is_a_landing_page_that_reaches_the_rest() -> None:
    readme = read("README.md")
    assert len(readme.splitlines()) <= 150
    for page in ("docs/engines.md", "docs/flags.md", "docs/metrics.md", "docs/deploy.md", "docs/benchmarks.md"):
        assert f"]({page})" in readme, page
    # the two set-up commands, and the test command exactly as .ci/run runs it
    assert "pip install -e . && python -m frontend demo" in readme
    test_command = (
        "pip install -q -c constraints.txt -e '.[test]' && pip install -q -c constraints.txt --no-deps "
        "--force-reinstall opentelemetry-proto && python -m pytest -q"
    )
    assert test_command in readme and test_command in read(".ci/run")
