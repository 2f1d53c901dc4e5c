"""How a benchmark hands over its result: the JSON on stdout, and in ``--out`` when given; and how an
in-process microbenchmark measures another checkout in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def measure_checkout(script: str, directory: str) -> Any:
    """One round of ``script --measure`` in a fresh process importing ``directory``'s code: its JSON."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), "--measure"],
        cwd=directory,
        env=dict(os.environ, PYTHONPATH=directory),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)
