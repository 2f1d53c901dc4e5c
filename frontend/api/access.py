"""The frontend's deployment guards: which route needs which token, and what a drain refuses.

Routes (``kvroute_common.security`` levels):

- ``/v1/*``: an API key when ``--api-key`` is set (the admin token works too); a refusal is OpenAI's
  own 401 body (``invalid_request_error`` / ``invalid_api_key``), which the SDKs turn into
  ``AuthenticationError``.
- ``/health``, ``/live``, ``/metrics`` and ``GET /busy_threshold``: open (probes, scrapers).
- ``/dashboard`` and its script and style: open (they hold no data; a browser cannot send a header
  when it opens a page); ``/dashboard/data`` is an admin route, the page asks for the token.
- everything else: the admin token when ``--admin-token`` is set: ``/admin/*``,
  ``POST /busy_threshold``, the slot-tracker routes (``/register``, ``/add``, ``/free``,
  ``/register_peer``...; reads such as ``/loads`` too, they expose the routing state), unknown paths.

While draining (``kvroute_common.drain``), ``/health`` answers 503 and new ``/v1/*`` requests get an
OpenAI-style 503; the operator routes keep working until the process exits.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import orjson

from frontend.request.errors import openai_error_body
from kvroute_common.drain import Drain, DrainMiddleware
from kvroute_common.security import ADMIN, API, OPEN, AuthMiddleware, policy_from_args

log = logging.getLogger("frontend")

_OPEN_PATHS = frozenset(
    ("/health", "/live", "/metrics", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css")
)
HEALTH_DRAINING = orjson.dumps({"status": "shutting_down", "message": "Service is shutting down"})
_DRAINING_V1 = openai_error_body(503, "The server is shutting down; retry the request (another replica will take it)")


def access_level(method: str, path: str) -> int:
    if path.startswith("/v1/"):
        return API
    if path in _OPEN_PATHS or (path == "/busy_threshold" and method in ("GET", "HEAD")):
        return OPEN
    return ADMIN


def refusal_body(path: str, level: int, missing: bool) -> bytes:
    if path.startswith("/v1/"):
        message = (
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
            if missing
            else "Incorrect API key provided."
        )
        return orjson.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        )
    return orjson.dumps(
        {
            "error": "admin token required: send `Authorization: Bearer <admin token>`"
            if missing
            else "invalid admin token"
        }
    )


def _refuse_while_draining(method: str, path: str) -> bytes | None:
    return _DRAINING_V1 if path.startswith("/v1/") else None


def guard_app(app: Any, ns: argparse.Namespace, drain: Drain | None) -> Any:
    """``app`` behind the token checks the flags ask for (if any) and the SIGTERM drain (if any)."""
    policy = policy_from_args(ns, access_level, refusal_body)
    if policy is not None:
        if policy.api_keys and not policy.admin_tokens:
            log.warning(
                "--api-key is set but no --admin-token: /admin/*, POST /busy_threshold and the tracker routes are open"
            )
        log.info("access control on: %d API key(s), %d admin token(s)", len(policy.api_keys), len(policy.admin_tokens))
        app = AuthMiddleware(app, policy)
    if drain is not None:
        app = DrainMiddleware(
            app, drain, health_paths=("/health",), health_body=HEALTH_DRAINING, refuse=_refuse_while_draining
        )
    return app


__all__ = ["access_level", "guard_app", "refusal_body"]
