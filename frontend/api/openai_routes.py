"""The HTTP API's generation routes: OpenAI's /v1/chat/completions, /v1/completions, /v1/responses,
/v1/embeddings, Anthropic's /v1/messages (+ count_tokens), and POST /admin/route (the decision a body
would get, explained). Each request goes down the shared request path (``frontend/dispatch/request_path.py``)."""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import Response

from frontend.dispatch.context import HttpSource
from frontend.dispatch.request_path import BODY_LIMIT, RequestPath
from frontend.request.errors import OpenAIError, as_anthropic, model_not_found, openai_error_response
from frontend.request.hints import parse_request_hints
from frontend.routing import disagg as _disagg
from frontend.routing.prompt import body_tokens, messages_to_chat, tokenize_request
from frontend.routing.routing_record import routing_record
from frontend.state import FrontendState
from kvroute_common import anthropic_api
from kvroute_common.http import ApiError, json_response, read_json
from kvroute_common.openai_api import read_openai_body

log = logging.getLogger("frontend")
_perf = time.perf_counter


class OpenAIRoutes:
    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self.path = RequestPath(state)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def responses(self, request: Request) -> Response:
        """``/v1/responses``: tokenized like chat (instructions + input as messages), routed kv."""
        return await self._generate(request, "responses")

    async def embeddings(self, request: Request) -> Response:
        """``/v1/embeddings``: no decode and no reuse to speak of, so routed by load alone."""
        return await self._generate(request, "embeddings")

    async def messages(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages``: tokenized as the engine renders it, routed kv, proxied to the
        engine's own ``/v1/messages``; errors in Anthropic's shape."""
        return await self._generate(request, "messages")

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt's tokens, counted here (the router's
        tokenizer is the engine's; nothing is sent to a worker)."""
        try:
            _raw, body = await read_openai_body(request, BODY_LIMIT)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise OpenAIError(400, "model: a string is required", "model")
            entry = self.state.models.get(model)
            if entry is None:
                raise model_not_found(model)
            anthropic_api.validate_request(body, require_max_tokens=False)
            chat = messages_to_chat(entry, body)
            from kvroute_common.tokenize_offload import prompt_chars

            tokens = await self.state.tokenize.run(prompt_chars(chat), body_tokens, entry, chat, True)
        except OpenAIError as exc:
            return as_anthropic(openai_error_response(exc.status, exc.message, exc.param))
        return json_response({"input_tokens": len(tokens)})

    async def explain(self, request: Request) -> Response:
        """``POST /admin/route``: the decision an OpenAI body would get now, with every candidate's
        cost terms, without booking or sending anything (operators: "why did it go there?"). A tenant's
        cache salt is read as on the generation routes (``x-tenant-id``, ``nvext.cache_salt``, the body's
        ``cache_salt``)."""
        state = self.state
        body = await read_json(request, dict, BODY_LIMIT)
        model = body.get("model")
        entry = state.models.get(model) if isinstance(model, str) else None
        if entry is None:
            raise ApiError(404, f"Model not found: {model}")
        chat = "messages" in body
        try:
            hints = parse_request_hints(body, request.headers, nvext_enabled=state.nvext_enabled)
            own_salt = body.get("cache_salt")
            salt = hints.cache_salt or (own_salt if isinstance(own_salt, str) and own_salt else None)
            prompt = await tokenize_request(state.tokenize, entry, body, chat, salt, state.image_cache)
            prefill = _disagg.explain_prefill(state, entry.name, prompt.tokens)
            # with a prefill pool the decode side is routed load-only (unless it falls back to decode-only)
            router = state.router if prefill is None or "error" in prefill else state.disagg_decode_router
            remote, source = await self.path.remote_overlaps(entry, prompt) if router is state.router else (None, None)
            d = router.route(entry, prompt.tokens, explain=True, hashes=prompt.hashes, overlaps=remote)
            d.overlap_source = source
        except OpenAIError as exc:
            raise ApiError(exc.status, exc.message) from None
        out = routing_record(router.config, entry, d)
        if (
            state.config.router_mode == "latency"
        ):  # costs are estimated TTFTs (ms); what each rank's estimate has learned
            out["latency_models"] = state.router.latency_models(entry).snapshot()
        if prefill is not None:
            out["prefill"] = prefill  # the prefill router's decision
        return json_response(out)

    async def _generate(self, request: Request, kind: str) -> Response:
        return await self.path.generate(HttpSource(request), kind, self.path.send)
