"""The admin API on the frontend's port: models, health, metrics, busy thresholds, worker registration,
and the embedded slot tracker's routes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from frontend.pool.workers import WorkerSpec
from frontend.request.errors import openai_error_response
from frontend.routing.models import BusyThresholds, validate_update
from frontend.state import FrontendState
from frontend.supervisor import child_index
from kvroute_common.http import ApiError, json_response, read_json


class AdminRoutes:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "kvroute"} for name in sorted(self.state.models)
        ]
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.state.models:
            return openai_error_response(404, f"Model not found: {name}", "model")
        return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvroute"})

    async def health(self, request: Request) -> Response:
        st = self.state
        if st.shutting_down:
            return json_response({"status": "shutting_down", "message": "Service is shutting down"}, 503)
        workers = list(st.pool.workers.values())
        instances = [
            {
                "worker_id": w.id,
                "url": w.spec.url,
                "healthy": w.healthy,
                "models": w.models,
                "dp_size": w.spec.dp_size,
                "last_error": w.last_error,
            }
            for w in workers
        ]
        endpoints = sorted({w.spec.url for w in workers if w.healthy})
        ready = st.serving
        body = {
            "status": "healthy" if ready else "not_ready",
            "message": "Service is ready" if ready else "No healthy worker yet",
            "endpoints": endpoints,
            "instances": instances,
            "models": sorted(st.models),
        }
        return json_response(body, 200 if ready else 503)

    async def live(self, request: Request) -> Response:
        if self.state.shutting_down:
            return json_response({"status": "shutting_down", "message": "Service is shutting down"}, 503)
        # pid / process: which of the `--workers N` processes answered (frontend/supervisor.py)
        return json_response(
            {"status": "live", "message": "Service is live", "pid": os.getpid(), "process": child_index() or 0}
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- /busy_threshold ------------------------------------------------------------------------
    async def busy_threshold_get(self, request: Request) -> Response:
        st = self.state
        items = [t.to_dict(m) for m, t in sorted(st.thresholds.items()) if t.enabled]
        return json_response({"thresholds": items})

    async def busy_threshold_post(self, request: Request) -> Response:
        st = self.state
        body = await read_json(request, dict)
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(422, "Failed to deserialize the JSON body into the target type: missing field `model`")
        decode = body.get("active_decode_blocks_threshold")
        prefill = body.get("active_prefill_tokens_threshold")
        frac = body.get("active_prefill_tokens_threshold_frac")
        if isinstance(prefill, float) and prefill.is_integer():
            prefill = int(prefill)
        for name, v in (
            ("active_decode_blocks_threshold", decode),
            ("active_prefill_tokens_threshold", prefill),
            ("active_prefill_tokens_threshold_frac", frac),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ApiError(422, f"Failed to deserialize the JSON body into the target type: {name}: invalid type")
        if decode is None and prefill is None and frac is None:
            return json_response((st.thresholds.get(model) or BusyThresholds()).to_dict(model))
        try:
            validate_update(decode, prefill, frac)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if model not in st.models:
            raise ApiError(404, f"Model '{model}' not found. Thresholds can only be set for discovered models.")
        t = st.thresholds.get(model)
        if t is None:
            t = st.thresholds[model] = BusyThresholds()
            st.models[model].thresholds = t
        if decode is not None:
            t.active_decode_blocks_threshold = float(decode)
        if prefill is not None:
            t.active_prefill_tokens_threshold = int(prefill)
        if frac is not None:
            t.active_prefill_tokens_threshold_frac = float(frac)
        st.capacity_changed(model)
        return json_response(t.to_dict(model))

    # ---- worker registration API ----------------------------------------------------------------
    async def workers_list(self, request: Request) -> Response:
        st = self.state
        kv_events = st.events
        events: dict[int, dict[str, Any]] = (
            {e["instance_id"]: e for e in kv_events.workers()} if kv_events is not None else {}
        )
        rows = []
        for w in sorted(st.pool.workers.values(), key=lambda w: w.id):
            row = w.describe()
            ev = events.get(w.id)
            if ev is not None:  # the embedded indexer's KV-event listeners of this worker, with their health
                row["kv_events"] = {
                    "status": ev["status"],
                    "listeners": ev["listeners"],
                    "health": kv_events.health(w.id) if kv_events is not None else None,
                }
            parity = st.parity.describe(w.id)
            if parity is not None:
                row["hash_parity"] = parity
            rows.append(row)
        body: dict[str, Any] = {"workers": rows}
        if st.discovery:
            body["discovery"] = [b.status() for b in st.discovery]
        if st.file_watcher is not None:
            body["workers_file"] = {"path": st.file_watcher.path, "last_error": st.file_watcher.last_error}
        return json_response(body)

    async def kv_dump(self, request: Request) -> Response:
        """The embedded index in the standalone indexer's ``/dump`` shape (``{}`` without KV events):
        lets tests and the leak benchmark compare it with the engines' caches."""
        events = self.state.events
        return json_response(events.dump() if events is not None else {})

    async def workers_add(self, request: Request) -> Response:
        body = await read_json(request, object)  # a worker object, or a bare URL string
        if isinstance(body, str):
            body = {"url": body}
        if not isinstance(body, dict):
            raise ApiError(422, "a worker must be an object or a URL string")
        try:
            spec = WorkerSpec.from_mapping(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        pool = self.state.pool
        existing = pool.workers.get(spec.id)
        worker = pool.add(spec, "api")
        if request.query_params.get("wait", "true").lower() not in ("0", "false", "no"):
            await pool.probe(worker)
        return json_response(worker.describe(), 200 if existing is not None else 201)

    async def workers_remove(self, request: Request) -> Response:
        try:
            worker_id = int(request.path_params["worker_id"])
        except ValueError:
            raise ApiError(400, "worker id must be an integer") from None
        if self.state.pool.remove(worker_id) is None:
            raise ApiError(404, f"worker {worker_id} not found")
        return json_response({"status": "ok"})


def _tracker_routes(state: FrontendState) -> list[BaseRoute]:
    """The slot tracker's HTTP API on the frontend's port, backed by the embedded tracker."""
    try:
        from slot_tracker import service
    except ImportError:  # pragma: no cover
        return []
    factory = getattr(service, "tracker_routes", None)
    if factory is None:
        return []
    routes = factory(state.slots, state.replica_sync)
    # the frontend's own /health wins
    return [r for r in routes if getattr(r, "path", None) != "/health"]
