"""``python -m bench <benchmark> [args]``: run one of the benchmarks in this package.

Each benchmark is a module ``bench.<name>`` with ``main(argv) -> int``; ``replay`` is the trace
replay of routing quality (``python -m bench replay --help``).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys

import bench


def available() -> list[str]:
    names = []
    for info in pkgutil.iter_modules(bench.__path__):
        if info.name.startswith("_"):
            continue
        spec = importlib.util.find_spec(f"bench.{info.name}")
        if spec and spec.origin and "def main(" in open(spec.origin, encoding="utf-8").read():
            names.append(info.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("benchmarks:", ", ".join(available()))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in available():
        print(f"unknown benchmark {name!r}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"bench.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
