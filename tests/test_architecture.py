"""The package layout the design promises: no import cycle among kvroute's modules (counting imports
made only for type checking or inside functions too: a cycle there is still a knot a reader goes
round), the indexer does not depend on the routing core (``router/`` may use the indexer, not the
other way round), and inside the frontend imports run one way: nothing below the routes imports
``frontend/api``, and the request model (``frontend/request``) imports nothing else of the frontend.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from support import REPO_ROOT


def _modules(package: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(os.path.join(REPO_ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str) -> set[str]:
    """Absolute names of every module ``name`` imports, wherever the import stands (TYPE_CHECKING,
    inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    base = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = (
                ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


PACKAGES = ("frontend", "router", "slot_tracker", "indexer", "kvroute_common", "mocker", "bench")


def test_no_import_cycle_among_the_packages() -> None:
    mods = {m: p for package in PACKAGES for m, p in _modules(package).items()}
    graph = {m: {t for t in _imports(m, p) if t in mods and t != m} for m, p in mods.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_indexer_does_not_import_the_routing_core() -> None:
    offenders = {
        m: sorted(t for t in _imports(m, p) if t == "router" or t.startswith("router."))
        for m, p in _modules("indexer").items()
    }
    assert {m: v for m, v in offenders.items() if v} == {}


# The routes' layer and what only composes the process may import ``frontend.api``; everything the
# routes call (request path, endpoint picker, router, pool, state, observability) sits below it.
ABOVE_THE_API = {"frontend.app", "frontend.cli"}
# What the request model (``frontend/request``) may import from ``frontend``: itself only.
REQUEST_MODEL = "frontend.request"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_nothing_below_the_routes_imports_the_api() -> None:
    offenders = {
        m: sorted(t for t in _imports(m, p) if _under(t, "frontend.api"))
        for m, p in _modules("frontend").items()
        if not _under(m, "frontend.api") and m not in ABOVE_THE_API
    }
    assert {m: v for m, v in offenders.items() if v} == {}


def test_the_request_model_imports_nothing_above_it() -> None:
    offenders = {
        m: sorted(t for t in _imports(m, p) if _under(t, "frontend") and not _under(t, REQUEST_MODEL))
        for m, p in _modules("frontend").items()
        if _under(m, REQUEST_MODEL)
    }
    assert {m: v for m, v in offenders.items() if v} == {}


def test_imports_are_seen_wherever_they_stand(tmp_path: Path) -> None:
    """The direction checks count imports made only for type checking and inside functions too."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from frontend.api.access import guard_app\n"
        "def f():\n"
        "    import frontend.api.admin\n"
        "    from ..api import openapi\n"
    )
    seen = _imports("frontend.routing.mod", str(path))
    assert {"frontend.api.access", "frontend.api.admin", "frontend.api", "frontend.api.openapi"} <= seen
