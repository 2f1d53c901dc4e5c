"""The frontend application: wires the OpenAI routes, the admin routes and the tracker routes onto one
Starlette app whose lifespan starts and stops the FrontendState, behind ``GenerationRoutes``: the
generation POST routes answered before Starlette's router and middleware stack.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import BaseRoute, Route

from frontend.api.admin import AdminRoutes, _tracker_routes
from frontend.api.dashboard import DashboardRoutes
from frontend.api.openai_routes import OpenAIRoutes
from frontend.api.openapi import build_document
from frontend.request.errors import as_anthropic, openai_error_body, openai_error_response, openai_exception_handlers
from frontend.state import FrontendState
from kvroute_common.fast_http import HeaderCoalescingProtocol
from kvroute_common.http import exception_handlers, route
from kvroute_common.openapi import openapi_route

log = logging.getLogger("frontend")

Handler = Callable[[Request], Awaitable[Any]]


class GenerationRoutes:
    """ASGI: ``POST`` on a generation path goes straight to its handler; everything else (other paths
    and methods, lifespan) to the Starlette app. The request path answers every error itself in the
    API's shape, so Starlette's routing table, middleware and exception wrappers (about a quarter of
    a short request's Python time) have nothing to add there."""

    def __init__(self, app: Starlette, handlers: dict[str, Handler]) -> None:
        self.app = app
        self.handlers = handlers
        self.state = app.state  # DrainMiddleware and the tests read the app's state through the wrapper

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                try:
                    response = await handler(Request(scope, receive))
                except Exception as exc:  # a bug: still an API-shaped 500, as Starlette's handlers give
                    log.exception("request failed")
                    response = openai_error_response(500, f"internal error: {type(exc).__name__}: {exc}")
                    if scope["path"].startswith("/v1/messages"):
                        response = as_anthropic(response)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class FrontendHttpProtocol(HeaderCoalescingProtocol):
    """uvicorn's HTTP/1.1 protocol for the frontend: a response's header block goes out in one socket
    write with its first body bytes (a stream's first chunk, a unary answer's body), so a request
    costs one write and one wake-up of its client fewer; an unparsable request gets an OpenAI-shaped
    400."""

    malformed_body = openai_error_body(400, "Invalid HTTP request received.")


def build_app(
    state: FrontendState,
    epp: tuple[str, int] | None = None,
    epp_fallbacks: int = 0,
    epp_conformance_hooks: bool = False,
) -> GenerationRoutes:
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
    return GenerationRoutes(
        app,
        {
            "/v1/chat/completions": oa.chat_completions,
            "/v1/completions": oa.completions,
            "/v1/responses": oa.responses,
            "/v1/embeddings": oa.embeddings,
            "/v1/messages": oa.messages,
        },
    )
