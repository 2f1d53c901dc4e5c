"""``--discovery file``: a JSON / YAML workers file, re-read when it changes (source ``file``)."""

from __future__ import annotations

from typing import Any

from frontend.pool.discovery.base import DiscoveryBackend, DiscoveryTarget
from frontend.pool.workers import WorkersFileWatcher, WorkerSpec


class FileDiscovery(DiscoveryBackend):
    name = "file"
    source = "file"

    def __init__(self, path: str, interval: float = 1.0) -> None:
        self.target: DiscoveryTarget | None = None
        self.watcher = WorkersFileWatcher(path, self._apply, interval)

    def _apply(self, specs: list[WorkerSpec], models: dict[str, dict[str, Any]]) -> None:
        if self.target is not None:
            self.target.set_model_paths(models)
            self.target.set_workers(self.source, specs)

    async def start(self, target: DiscoveryTarget) -> None:
        self.target = target
        self.watcher.load_now()
        self.watcher.start()

    async def stop(self) -> None:
        self.watcher.stop()

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "path": self.watcher.path, "last_error": self.watcher.last_error}
