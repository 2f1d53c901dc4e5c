"""CPU of a service's whole process tree, also of children that start sessions of their own."""

from __future__ import annotations

import subprocess
import sys

from kvroute_common.processes import session_cpu_s

# a grandchild in a new session (as `python -m frontend --workers N` starts its children) burns CPU,
# says so, and stays alive until its stdin closes
_GRANDCHILD = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\nprint('burnt', flush=True)\nsys.stdin.read()\n"  # noqa: E501
_CHILD = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {_GRANDCHILD!r}], start_new_session=True)\n"


def test_session_cpu_counts_descendants_in_sessions_of_their_own() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "burnt"
        assert session_cpu_s(proc.pid) >= 0.35  # the live grandchild's 0.4 s
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
