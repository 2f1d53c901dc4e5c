"""Shared test plumbing: free loopback ports, real service processes, waiting on conditions.

Tests never sleep to synchronise: they poll a condition with a deadline (``wait_until``). The process
and port helpers live in the package (``kvroute_common.processes``, ``kvroute_common.ports``) because
the benchmarks use them too; they are re-exported here for the tests.
"""

from __future__ import annotations

import importlib.util

from kvroute_common.ports import free_port, free_port_block, free_ports
from kvroute_common.processes import REPO_ROOT, http_ready, service, stop_process, wait_until

__all__ = [
    "REPO_ROOT",
    "free_port",
    "free_port_block",
    "free_ports",
    "http_ready",
    "reference_installed",
    "service",
    "stop_process",
    "wait_until",
]


def reference_installed() -> bool:
    """Whether the reference implementation (ai-dynamo-runtime) is importable."""
    return importlib.util.find_spec("dynamo") is not None
