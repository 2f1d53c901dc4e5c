"""How a benchmark hands over its result: the JSON on stdout, and in ``--out`` when given."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
