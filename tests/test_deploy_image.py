"""deploy/Dockerfile and .dockerignore: what can be checked without a Docker daemon.

- the entrypoint is ``python -m frontend`` (the other services: another command, same image);
- the build stage copies exactly the packages pyproject.toml packages, and .dockerignore sends them;
- its dependency install step reads pyproject.toml's dependencies (the step's own command is run here
  and compared), and the package install step, run on the build context .dockerignore leaves, gives a
  wheel with every package and the tokenizer data;
- multi-stage; the final stage runs as a non-root numeric user, installs nothing and has no compiler.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from support import REPO_ROOT

DOCKERFILE = os.path.join(REPO_ROOT, "deploy", "Dockerfile")
DOCKERIGNORE = os.path.join(REPO_ROOT, ".dockerignore")
COMPILERS = ("gcc", "g++", "cc", "clang", "make", "build-essential", "cmake", "rustc", "cargo", "gfortran")


def instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            full = (pending + line).strip()
            pending = ""
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(DOCKERFILE):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def pyproject() -> dict:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def top_level_packages() -> set[str]:
    """The top-level packages setuptools' find (with pyproject's include patterns) packages."""
    patterns = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    return {
        name
        for name in os.listdir(REPO_ROOT)
        if os.path.isfile(os.path.join(REPO_ROOT, name, "__init__.py"))
        and any(fnmatch.fnmatch(name, p) for p in patterns)
    }


def test_entrypoint_is_the_frontend_and_other_services_are_a_command_away() -> None:
    final = stages()[-1]
    entry = [args for word, args in final if word == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["python", "-m", "frontend"]
    cmd = [args for word, args in final if word == "CMD"]
    assert not cmd or json.loads(cmd[-1]) == []  # no baked-in flags: the deployment gives them
    with open(DOCKERFILE, encoding="utf-8") as f:
        text = f.read()
    assert "-m indexer" in text and "-m slot_tracker" in text  # documented in the header


def test_multi_stage_final_stage_non_root_without_build_tools() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2
    build_name = all_stages[0][0][1].split()[-1]
    final = all_stages[-1]
    base = final[0][1].split()[0]
    assert base == "${PYTHON_IMAGE}" or "slim" in base
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in instructions(DOCKERFILE) if w == "ARG" and "=" in a}
    assert "slim" in args.get("PYTHON_IMAGE", base)
    users = [a for w, a in final if w == "USER"]
    assert users, "the final stage must drop root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: Kubernetes' runAsNonRoot can verify it
    for word, a in final:
        if word == "RUN":
            words = set(re.split(r"[\s;&|()]+", a))
            assert not words & set(COMPILERS), f"build tool in the final stage: {a}"
            assert "apt-get" not in words and "pip" not in words, f"the final stage installs nothing: {a}"
        if word == "COPY":
            assert f"--from={build_name}" in a, f"the final stage takes only the build stage's result: {a}"


def test_build_stage_copies_what_pyproject_packages() -> None:
    build = stages()[0]
    copied = set()
    for word, a in build:
        if word == "COPY":
            parts = shlex.split(a)
            copied.update(p.rstrip("/") for p in parts[:-1] if not p.startswith("--"))
    packages = top_level_packages()
    assert packages == {"router", "slot_tracker", "indexer", "frontend", "mocker", "kvroute_common", "bench"}
    readme = pyproject()["project"]["readme"]
    assert copied == packages | {"pyproject.toml", readme}
    # .dockerignore lets exactly these through (and the package data inside them)
    sent = context_files()
    for name in copied:
        assert any(f == name or f.startswith(name + "/") for f in sent), f".dockerignore drops {name}"
    assert "kvroute_common/tokenizer_data/tokenizer.json" in sent
    assert not any(f.startswith(("tests/", ".git/", "docs/", "deploy/")) for f in sent)
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in sent)


def test_dependency_install_step_installs_pyprojects_dependencies_and_the_extras_the_manifests_use() -> None:
    runs = [a for w, a in stages()[0] if w == "RUN" and "requirements" in a]
    assert len(runs) == 1
    generate, _, install = runs[0].partition("&&")
    assert "pip install" in install and "-r /tmp/requirements.txt" in install
    command = generate.split(">")[0].strip()
    out = subprocess.run(
        ["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    project = pyproject()["project"]
    extras = project["optional-dependencies"]  # what deploy/k8s runs: kubernetes discovery, the endpoint picker
    wanted = project["dependencies"] + extras["k8s"] + extras["epp"]
    assert out.split() == [d.replace(" ", "") for d in wanted]


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    with open(DOCKERIGNORE, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return out


def _ignored(path: str, patterns: list[tuple[bool, str]]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent directory matches too."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for negate, pattern in patterns:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            hit = any(fnmatch.fnmatch(p, tail) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) and p.count("/") == pattern.count("/") for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def context_files() -> set[str]:
    """The repository files `docker build .` would send, per .dockerignore (git's files only)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    patterns = dockerignore_patterns()
    return {f for f in files if not _ignored(f, patterns)}


def test_package_install_step_builds_a_complete_package(tmp_path) -> None:
    """The build stage's ``pip install --no-deps .``, on the files the build context holds."""
    ctx = tmp_path / "context"
    for rel in context_files():
        dest = ctx / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, rel), dest)
    out = tmp_path / "wheel"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ctx)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0 and "No module named" in r.stderr and "setuptools" in r.stderr:
        pytest.fail(f"setuptools is needed to build the package: {r.stderr[-2000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.iterdir()
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in top_level_packages():
        assert f"{pkg}/__init__.py" in names
    for must in (
        "frontend/__main__.py",
        "indexer/__main__.py",
        "slot_tracker/__main__.py",
        "kvroute_common/tokenizer_data/tokenizer.json",
        "kvroute_common/security.py",
        "kvroute_common/drain.py",
    ):
        assert must in names, must
