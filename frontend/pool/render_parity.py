"""Tokenizer parity proven before traffic: a worker's own rendering of a few probe requests against
the router's token ids, checked when the worker (re)joins.

An engine that exposes its renderer (vLLM with ``--enable-scale-out``: ``/v1/chat/completions/render``,
``/v1/completions/render``, ``/v1/messages/render``) answers the token ids it would compute for a
request without running it. The router renders the same probes with its own tokenizer and chat
template; the first differing position, with both sides' text around it, names the mismatch at once
(the hash-parity alarm rises before a single request was routed on wrong hashes). Probes cover a
chat with a system prompt, the same chat offering tools (an engine without a tool-call parser refuses
it: ``error``, not evidence), a completion, a LoRA adapter (when the worker serves one) and an
Anthropic Messages request with tool use in its history. An engine without the render routes
(403/404/405/501) leaves the check ``unavailable``: the request-time evidence of ``frontend/observability/parity.py``
still applies.

``prompt_ids`` says whether the engine turns a completions prompt into the router's ids: the completion
probe's rendering, else the same text through the engine's ``/tokenize`` (vLLM, SGLang and the mocker
serve it without ``--enable-scale-out``). Where it matched, completions prompts go to the worker as the
router's ids (``--send-token-ids auto``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from frontend.pool.workers import Worker
    from frontend.routing.models import ModelEntry

log = logging.getLogger("frontend.pool.render_parity")

CONTEXT = 8  # tokens shown on each side of the first difference
# the engine does not serve the route: vLLM answers 403 on its render routes without --enable-scale-out
_NO_ROUTE = (403, 404, 405, 501)

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {"type": "function", "function": {"name": "ls"}},  # no description or parameters: nulls in vLLM's dump
]
_CHAT = [
    {"role": "system", "content": "You are a coding agent. Answer briefly; cite the files you read."},
    {"role": "user", "content": "Which module computes the routing cost? Use the tool if you must."},
]
_COMPLETION = "The quick brown fox jumps over the lazy dog. 0123456789 -- naïve café, 漢字, emoji 🙂\n\ttabs"
_MESSAGES = {  # tool use and results in the history; no tools offered (vLLM wants a tool parser for those)
    "max_tokens": 1,
    "system": "You are a coding agent working in a repository.",
    "messages": [
        {"role": "user", "content": "List the repository."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Listing it."},
                {"type": "tool_use", "id": "toolu_01", "name": "ls", "input": {"path": "."}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "router/ frontend/ README.md"}],
        },
    ],
}


@dataclass
class Probe:
    name: str
    kind: str  # chat | completions | messages
    path: str
    body: dict[str, Any]


def probes(entry: ModelEntry, adapter: str | None) -> list[Probe]:
    """The probe requests for a worker serving ``entry`` (and the LoRA ``adapter``, if any)."""
    model = entry.name
    chat_path = "/v1/chat/completions/render"
    out = [
        Probe("chat_with_system", "chat", chat_path, {"model": model, "messages": _CHAT}),
        # an engine without a tool-call parser refuses requests with tools: this probe is then "error"
        Probe("chat_with_tools", "chat", chat_path, {"model": model, "messages": _CHAT, "tools": _TOOLS}),
        # vLLM keeps the tools for the template unless it runs with --exclude-tools-when-tool-choice-none
        Probe(
            "chat_tool_choice_none",
            "chat",
            chat_path,
            {"model": model, "messages": _CHAT, "tools": _TOOLS, "tool_choice": "none"},
        ),
        Probe("completion", "completions", "/v1/completions/render", {"model": model, "prompt": _COMPLETION}),
    ]
    if adapter is not None:
        out.append(Probe(f"lora_{adapter}", "chat", chat_path, {"model": adapter, "messages": _CHAT}))
    out.append(Probe("anthropic_messages", "messages", "/v1/messages/render", {"model": model, **_MESSAGES}))
    return out


@dataclass
class RenderCheck:
    """The outcome for one worker: ``match``, ``mismatch``, ``unavailable`` or ``error``."""

    status: str = "unavailable"
    probes: dict[str, str] = field(default_factory=dict)  # probe -> match | mismatch | unavailable | error
    difference: dict[str, Any] | None = None  # the first mismatching probe's first difference
    errors: dict[str, str] = field(default_factory=dict)  # probe -> why the engine did not render it
    # the engine's ids for the completion probe (rendered, else /tokenize) against the router's
    prompt_ids: str = "unavailable"

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "probes": dict(self.probes), "prompt_ids": self.prompt_ids}
        if self.difference is not None:
            out["first_difference"] = self.difference
        if self.errors:
            out["errors"] = dict(self.errors)
        return out

    def cause(self) -> str:
        d = self.difference or {}
        return (
            f"tokenizer or chat template mismatch proven by the engine's rendering: probe {d.get('probe')} differs "
            f"at token {d.get('position')} (router {d.get('router_text')!r}, engine {d.get('engine_text')!r}; "
            "give --model-path the engine's model directory and chat template)"
        )


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the two token lists differ (the shorter one's end if one is a prefix)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def describe_difference(entry: ModelEntry, name: str, ours: list[int], theirs: list[int], pos: int) -> dict[str, Any]:
    lo = max(0, pos - CONTEXT)

    def text(ids: list[int]) -> str:
        return str(entry.tokenizer.decode(ids[lo : pos + CONTEXT]))

    return {
        "probe": name,
        "position": pos,
        "router_tokens": len(ours),
        "engine_tokens": len(theirs),
        "router_text": text(ours),
        "engine_text": text(theirs),
    }


def _engine_ids(data: Any) -> list[int] | None:
    """``token_ids`` of a render answer (the completions route answers a list of one)."""
    if isinstance(data, list) and data:
        data = data[0]
    ids = data.get("token_ids") if isinstance(data, dict) else None
    return ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None


async def check(worker: Worker, entry: ModelEntry, adapter_entry: ModelEntry | None, timeout: float) -> RenderCheck:
    """Render every probe on the worker and here; the first mismatch is described."""
    from frontend.routing.prompt import tokenize_request_sync

    result = RenderCheck()
    adapter = adapter_entry.name if adapter_entry is not None else None
    for probe in probes(entry, adapter):
        mine = adapter_entry if probe.body["model"] == adapter and adapter_entry is not None else entry
        try:
            resp = await worker.client.post(probe.path, json=probe.body, timeout=timeout)
        except httpx.HTTPError as exc:
            result.probes[probe.name] = "error"
            result.errors[probe.name] = f"{type(exc).__name__}: {exc}"
            continue
        if resp.status_code in _NO_ROUTE:
            result.probes[probe.name] = "unavailable"
            continue
        try:
            theirs = _engine_ids(resp.json()) if resp.status_code == 200 else None
        except ValueError:
            theirs = None
        if theirs is None:
            result.probes[probe.name] = "error"
            result.errors[probe.name] = f"{resp.status_code}: {resp.text[:300]}"
            continue
        try:
            ours = tokenize_request_sync(mine, probe.body, probe.kind)
        except Exception as exc:  # the router cannot render what the engine can: a mismatch too
            log.warning("render probe %s: the router cannot render it: %s", probe.name, exc)
            ours = []
        pos = first_difference(ours, theirs)
        if pos is None:
            result.probes[probe.name] = "match"
            continue
        result.probes[probe.name] = "mismatch"
        if result.difference is None:
            result.difference = describe_difference(mine, probe.name, ours, theirs, pos)
    values = set(result.probes.values())
    result.status = next((s for s in ("mismatch", "match", "error") if s in values), "unavailable")
    result.prompt_ids = result.probes.get("completion", "unavailable")
    if result.prompt_ids not in ("match", "mismatch"):
        result.prompt_ids = await _tokenize_probe(worker, entry, timeout)
    return result


async def _tokenize_probe(worker: Worker, entry: ModelEntry, timeout: float) -> str:
    """The completion probe through the engine's ``/tokenize``: match, mismatch, unavailable or error."""
    from frontend.routing.prompt import tokenize_request_sync

    body = {"model": entry.name, "prompt": _COMPLETION}
    try:
        resp = await worker.client.post("/tokenize", json=body, timeout=timeout)
        data = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        log.info("worker %s: /tokenize probe failed: %s", worker.id, exc)
        return "error"
    if resp.status_code in _NO_ROUTE:
        return "unavailable"
    theirs = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(theirs, list) or not all(type(t) is int for t in theirs):
        return "error"
    return "match" if tokenize_request_sync(entry, body, "completions") == theirs else "mismatch"
