"""The frontend application: wires the OpenAI routes, the admin routes and the tracker routes onto one
Starlette app whose lifespan starts and stops the FrontendState.
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from frontend.api.admin import AdminRoutes, _tracker_routes
from frontend.api.dashboard import DashboardRoutes
from frontend.api.errors import openai_exception_handlers
from frontend.api.openai_routes import OpenAIRoutes
from frontend.api.openapi import build_document
from frontend.state import FrontendState
from kvroute_common.http import exception_handlers, route
from kvroute_common.openapi import openapi_route


def build_app(
    state: FrontendState,
    epp: tuple[str, int] | None = None,
    epp_fallbacks: int = 0,
    epp_conformance_hooks: bool = False,
) -> Starlette:
    """``epp``: (host, port) of the endpoint picker (``--epp-port``), served for the app's lifetime, with
    ``--epp-fallbacks`` and ``--epp-conformance-hooks``."""
    oa = OpenAIRoutes(state)
    state._init_speculative(oa.path.send_pinned)
    ad = AdminRoutes(state)
    dash = DashboardRoutes(state)
    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", oa.chat_completions, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
        Route("/v1/responses", oa.responses, methods=["POST"]),
        Route("/v1/embeddings", oa.embeddings, methods=["POST"]),
        Route("/v1/messages", oa.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", oa.count_tokens, methods=["POST"]),
        Route("/v1/models", ad.models, methods=["GET"]),
        Route("/v1/models/{model:path}", ad.model, methods=["GET"]),
        Route("/health", ad.health, methods=["GET"]),
        Route("/live", ad.live, methods=["GET"]),
        Route("/metrics", ad.metrics, methods=["GET"]),
        route("/busy_threshold", ad.busy_threshold_get, ["GET"]),
        route("/busy_threshold", ad.busy_threshold_post, ["POST"]),
        route("/admin/workers", ad.workers_list, ["GET"]),
        route("/admin/workers", ad.workers_add, ["POST"]),
        route("/admin/workers/{worker_id}", ad.workers_remove, ["DELETE"]),
        route("/admin/route", oa.explain, ["POST"]),
        route("/admin/kv_dump", ad.kv_dump, ["GET"]),
        Route("/dashboard", dash.page, methods=["GET"]),
        route("/dashboard/data", dash.data, ["GET"]),
        route("/dashboard/{name}", dash.asset, ["GET"]),
    ]
    routes += _tracker_routes(state)
    if state.serve_indexer:  # --serve-indexer: the embedded index, queried like a standalone indexer
        from indexer.service import query_handlers

        routes += [route(path, h, ["POST"]) for path, h in query_handlers(lambda: state.events).items()]
    routes.append(openapi_route(build_document()))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        picker = None
        try:
            if epp is not None:
                from frontend.gateway.endpoint_picker import EndpointPicker

                picker = EndpointPicker(state, oa.path, epp_fallbacks, epp_conformance_hooks)
                app.state.endpoint_picker = picker
                await picker.start(*epp)
            yield
        finally:
            if picker is not None:
                await picker.stop()
            await state.stop()

    app = Starlette(
        routes=routes, exception_handlers=openai_exception_handlers(exception_handlers()), lifespan=lifespan
    )
    app.state.frontend = state
    return app
