"""``--discovery static``: the workers given with ``--worker`` flags (source ``cli``).

Always present: hand-listed workers can sit beside any other backend's.
"""

from __future__ import annotations

from typing import Any

from frontend.pool.discovery.base import DiscoveryBackend, DiscoveryTarget
from frontend.pool.workers import WorkerSpec


class StaticDiscovery(DiscoveryBackend):
    name = "static"
    source = "cli"

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.specs = list(specs)

    async def start(self, target: DiscoveryTarget) -> None:
        target.set_workers(self.source, self.specs)

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "workers": len(self.specs)}
