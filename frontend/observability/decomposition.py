"""Hit-rate decomposition: where prompt-cache reuse is lost, as three token counters per model.

    available  best overlap among the eligible candidates (what any choice could have reused)
    captured   the chosen worker's predicted overlap (what the router's choice reused)
    delivered  the engine's ``usage.prompt_tokens_details.cached_tokens`` (what really was reused)

All three (and the prompt tokens) are counted together when the engine's usage arrives, over the
same requests, so ``captured/available`` (choice quality: load balancing traded reuse away) and
``delivered/captured`` (prediction quality: stale index, evictions, hash mismatch) are one PromQL
ratio each. Requests whose engine reports no cached tokens are not counted, nor requests outside the parity
monitor's sample (``ParityMonitor.sample``: ratios over a sample are the fleet's ratios).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from frontend.observability.loop_metrics import LoopCounter


class HitRateDecomposition:
    """The four counters; ``observe`` is called once per request with the engine's usage."""

    def __init__(self, registry: CollectorRegistry) -> None:
        m = ("model",)
        self.prompt = LoopCounter(
            "kvroute_router_prompt_tokens",
            "Prompt tokens of requests with engine-reported cached tokens",
            m,
            registry=registry,
        )
        self.available = LoopCounter(
            "kvroute_router_available_cached_tokens", "Best eligible predicted overlap (tokens)", m, registry=registry
        )
        self.captured = LoopCounter(
            "kvroute_router_captured_cached_tokens", "Chosen worker's predicted overlap (tokens)", m, registry=registry
        )
        self.delivered = LoopCounter(
            "kvroute_router_delivered_cached_tokens", "Engine-reported cached prompt tokens", m, registry=registry
        )
        self.requests = LoopCounter(
            "kvroute_router_decomposed_requests", "Requests counted in the hit-rate decomposition", m, registry=registry
        )
        self._children: dict[str, tuple[Any, ...]] = {}
        self._totals = [0, 0, 0, 0, 0]  # prompt, available, captured, delivered, requests over all models

    def totals(self) -> dict[str, int]:
        """Token sums over all models since start (the dashboard's decomposition series)."""
        return dict(zip(("prompt", "available", "captured", "delivered", "requests"), self._totals, strict=True))

    def observe(self, model: str, isl: int, available: int, captured: int, delivered: int) -> None:
        """One request's tokens: ``available >= captured`` by construction; delivered is the engine's."""
        c = self._children.get(model)
        if c is None:
            c = self._children[model] = (
                self.prompt.labels(model),
                self.available.labels(model),
                self.captured.labels(model),
                self.delivered.labels(model),
                self.requests.labels(model),
            )
        c[0].inc(isl)
        c[1].inc(available)
        c[2].inc(captured)
        c[3].inc(delivered)
        c[4].inc()
        t = self._totals
        t[0] += isl
        t[1] += available
        t[2] += captured
        t[3] += delivered
        t[4] += 1
