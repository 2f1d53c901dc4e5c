"""Response ``nvext`` and speculative prefill: what a request asked to be added to, or collected from,
its response (only for such requests: the others are relayed untouched)."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from frontend.dispatch.context import RequestContext
from frontend.dispatch.lifecycle import Lease
from frontend.routing.routing_record import routing_record, wants_routing
from frontend.state import FrontendState

log = logging.getLogger("frontend")
_perf = time.perf_counter


class ResponseRewriter:
    """Only for requests that asked for response metadata or speculative prefill: adds ``nvext`` to
    the body, or to a stream's chunks (``worker_id`` to each, the rest to the final one), and collects
    the assistant's text."""

    def __init__(self, state: FrontendState, ctx: RequestContext, lease: Lease) -> None:
        self.state = state
        self.ctx = ctx
        self.lease = lease
        self.collector = None
        self._buf = b""
        h = ctx.hints
        assert h is not None, "a response is rewritten only for requests with hints (RequestContext.rewrite)"
        self.hints = h
        self.routing = wants_routing(h)
        self.want_nvext = h.want_worker_id or h.want_timing or h.want_stop_reason or self.routing
        # speculative prefill warms an OpenAI chat turn; an Anthropic answer is not one
        if h.speculative_prefill and state.speculative is not None and ctx.kind != "messages":
            from frontend.routing.speculative import TurnTextCollector

            self.collector = TurnTextCollector()

    def _nvext(self, stop_reason: Any = None) -> dict | None:
        from frontend.request.hints import response_nvext

        h = self.hints
        if not self.want_nvext:
            return None
        timing = self.ctx.timing
        if timing is not None:
            now = time.monotonic()
            if timing.first_token is None:
                timing.first_token = now
            timing.finished = now
        d = self.lease.decision
        p = self.ctx.prefill
        out = response_nvext(
            h, d.worker.id, d.dp_rank, timing, None if p is None else (p.worker_id, p.dp_rank), stop_reason
        )
        if self.routing:  # the decision this request actually got (the last attempt's)
            if out is None:
                out = {}
            st = self.state
            out["routing"] = routing_record(
                st.config if p is None else st.disagg_decode_router.config, self.ctx.entry, d
            )
            if p is not None and p.record is not None:  # disaggregated: the prefill router's decision too
                out["routing"]["prefill"] = p.record
        return out

    def unary(self, data: bytes) -> bytes:
        if self.collector is not None:
            self.collector.feed_json(data)
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        ext = self._nvext(_stop_reason(obj))
        if ext is None:
            return data
        if isinstance(obj, dict):
            obj["nvext"] = ext
            return orjson.dumps(obj)
        return data

    def first_token(self) -> None:
        t = self.ctx.timing
        if t is not None and t.first_token is None:
            t.first_token = time.monotonic()

    def chunk(self, data: bytes) -> bytes:
        """Rewrite whole SSE events; a partial event is held until its end arrives."""
        if self.collector is not None:
            self.collector.feed_sse(data)
        if not self.want_nvext:
            return data
        buf = self._buf + data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        events = buf[: end + 2].split(b"\n\n")
        out = []
        for ev in events:
            if not ev:
                continue
            if ev.startswith(b"event: message_delta\n"):  # Anthropic: the event with the stop reason
                head, _, data = ev.partition(b"\ndata: ")
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    obj = None
                ext = self._nvext() if isinstance(obj, dict) else None
                if ext is not None and isinstance(obj, dict):
                    obj["nvext"] = ext
                    ev = head + b"\ndata: " + orjson.dumps(obj)
            elif ev.startswith(b"data: {"):
                finishing = b'"finish_reason":null' not in ev.replace(b" ", b"")
                if finishing or self.hints.want_worker_id:
                    ev = self._annotated(ev, finishing)
            out.append(ev + b"\n\n")
        return b"".join(out)

    def _annotated(self, ev: bytes, finishing: bool) -> bytes:
        """An OpenAI stream event with its ``nvext``: everything asked for on the event that finishes a
        choice; ``worker_id`` alone on every other event with choices, as the reference adds it to each
        piece of a stream once the request is routed (``timing`` only with the finish). ``finishing``:
        the event may finish a choice (its text has no ``"finish_reason":null``)."""
        try:
            obj = orjson.loads(ev[6:])
        except orjson.JSONDecodeError:
            return ev
        if not isinstance(obj, dict):
            return ev
        choices = obj.get("choices") or []
        if finishing and any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            ext = self._nvext(_stop_reason(obj))
        elif choices and self.hints.want_worker_id:
            from frontend.request.hints import response_nvext

            d, p = self.lease.decision, self.ctx.prefill
            ext = response_nvext(
                self.hints, d.worker.id, d.dp_rank, None, None if p is None else (p.worker_id, p.dp_rank)
            )
        else:
            return ev
        if ext is None:
            return ev
        obj["nvext"] = ext
        return b"data: " + orjson.dumps(obj)

    def flush(self) -> bytes:
        buf, self._buf = self._buf, b""
        return buf

    def finished(self, lease: Lease) -> None:
        """After a successful turn: schedule the speculative next-turn prefill."""
        spec = self.state.speculative
        c = self.collector
        if spec is None or c is None or lease.status != "success":
            return
        d = lease.decision
        spec.on_turn_finished(orjson.loads(self.ctx.out_body), c.text(), d.worker.id, d.dp_rank)


def _stop_reason(obj: Any) -> Any:
    """The engine's ``stop_reason`` of the finished choice (vLLM: the stop string or token id), if any."""
    if isinstance(obj, dict):
        for c in obj.get("choices") or ():
            if isinstance(c, dict) and c.get("finish_reason") is not None:
                return c.get("stop_reason")
    return None
