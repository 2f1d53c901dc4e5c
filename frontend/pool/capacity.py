"""What a worker can hold and batch, read from what real engines expose (never a silent default).

Sources, in order; a value given in the worker spec always wins:

* ``GET /v1/models``: ``max_model_len`` (vLLM and SGLang both report it per model).
* ``GET /metrics``: vLLM's ``vllm:cache_config_info`` gauge, whose labels are vLLM's CacheConfig
  (``block_size``, ``num_gpu_blocks``, ...). vLLM exports no scheduler config there: no
  ``max_num_batched_tokens``, no ``max_num_seqs``.
* vLLM ``GET /server_info?config_format=json`` (served when vLLM runs with
  ``VLLM_SERVER_DEV_MODE=1``): ``vllm_config.scheduler_config.max_num_batched_tokens`` /
  ``max_num_seqs``, ``cache_config.block_size`` / ``num_gpu_blocks``, ``model_config.max_model_len``.
* SGLang ``GET /get_server_info`` (its server args plus scheduler info): ``page_size`` (block size),
  ``max_total_num_tokens`` (KV capacity in tokens, so blocks = tokens / page_size),
  ``chunked_prefill_size`` (tokens prefilled per step: the batch budget; ``max_prefill_tokens``
  when chunking is off), ``max_running_requests``, ``context_length``.

What is still unknown after that is listed (``unknown``): the frontend warns once and shows it in
``/admin/workers``, because thresholds that need it (``--active-prefill-tokens-threshold-frac``,
``--router-queue-threshold``, ``--active-decode-blocks-threshold``) fall back to the reference's
stand-ins for that worker.

The engine kind is told apart the same way: the mocker exports ``kvroute_mocker_info``, vLLM
``vllm:*`` metrics, SGLang ``sglang:*`` metrics or a ``/get_server_info`` answer.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("frontend.pool.capacity")

# the values the router uses; max_model_len and max_num_seqs are informative
CAPACITY_FIELDS = ("block_size", "num_gpu_blocks", "max_num_batched_tokens")
ALL_FIELDS = CAPACITY_FIELDS + ("max_num_seqs", "max_model_len")

_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

MOCKER_METRIC = "kvroute_mocker_info"


@dataclass(slots=True)
class EngineCapacity:
    """What one worker told us (``None`` = not exposed), with where each value came from."""

    engine: str = "unknown"  # mocker | vllm | sglang | unknown
    # SGLang's --schedule-low-priority-values-first as its /get_server_info reports it (None = not told)
    low_priority_first: bool | None = None
    values: dict[str, int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, source: str) -> None:
        if name in self.values or value is None or isinstance(value, bool):
            return
        try:
            v = int(float(value))
        except (TypeError, ValueError):
            return
        if v > 0:
            self.values[name] = v
            self.sources[name] = source

    def get(self, name: str) -> int | None:
        return self.values.get(name)

    @property
    def unknown(self) -> list[str]:
        return [f for f in CAPACITY_FIELDS if f not in self.values]


def metric_labels(metrics_text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of ``name`` in Prometheus text, or None."""
    prefix = name + "{"
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            return dict(_LABEL_RE.findall(line[line.index("{") : line.rindex("}") + 1]))
    return None


def engine_kind(metrics_text: str) -> str:
    if MOCKER_METRIC in metrics_text:
        return "mocker"
    if "\nvllm:" in metrics_text or metrics_text.startswith("vllm:") or "# HELP vllm:" in metrics_text:
        return "vllm"
    if "sglang:" in metrics_text:
        return "sglang"
    return "unknown"


def apply_models(cap: EngineCapacity, models_json: Any) -> None:
    data = models_json.get("data") if isinstance(models_json, dict) else None
    lens: list[int] = [
        m["max_model_len"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)
    ]
    if lens:
        cap.set("max_model_len", min(lens), "/v1/models")
    owners = {m.get("owned_by") for m in data or [] if isinstance(m, dict)}
    if cap.engine == "unknown" and "sglang" in owners:
        cap.engine = "sglang"


def apply_metrics(cap: EngineCapacity, text: str) -> None:
    kind = engine_kind(text)
    if kind != "unknown":
        cap.engine = kind
    labels = metric_labels(text, "vllm:cache_config_info")
    if labels:
        cap.set("block_size", labels.get("block_size"), "vllm:cache_config_info")
        blocks = labels.get("num_gpu_blocks")
        if blocks in (None, "None", ""):
            blocks = labels.get("num_gpu_blocks_override")
        cap.set("num_gpu_blocks", blocks, "vllm:cache_config_info")


def apply_vllm_server_info(cap: EngineCapacity, info: Any) -> None:
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        return
    src = "/server_info"
    sched = cfg.get("scheduler_config") or {}
    cache = cfg.get("cache_config") or {}
    model = cfg.get("model_config") or {}
    if isinstance(sched, dict):
        cap.set("max_num_batched_tokens", sched.get("max_num_batched_tokens"), src)
        cap.set("max_num_seqs", sched.get("max_num_seqs"), src)
    if isinstance(cache, dict):
        cap.set("block_size", cache.get("block_size"), src)
        cap.set("num_gpu_blocks", cache.get("num_gpu_blocks") or cache.get("num_gpu_blocks_override"), src)
    if isinstance(model, dict):
        cap.set("max_model_len", model.get("max_model_len"), src)
    if cap.engine == "unknown":
        cap.engine = "vllm"


def apply_sglang_server_info(cap: EngineCapacity, info: Any) -> None:
    if not isinstance(info, dict):
        return
    src = "/get_server_info"
    states = info.get("internal_states")
    inner = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}

    def pick(key: str) -> Any:
        v = info.get(key)
        return inner.get(key) if v is None else v

    page = pick("page_size")
    cap.set("block_size", page, src)
    total = pick("max_total_num_tokens")
    if isinstance(total, (int, float)) and not isinstance(total, bool):
        cap.set("num_gpu_blocks", int(total) // int(page or 1), src)
    chunk = pick("chunked_prefill_size")
    if not isinstance(chunk, int) or chunk <= 0:
        chunk = pick("max_prefill_tokens")
    cap.set("max_num_batched_tokens", chunk, src)
    cap.set("max_num_seqs", pick("max_running_requests"), src)
    cap.set("max_model_len", pick("context_length"), src)
    low_first = info.get("schedule_low_priority_values_first")
    if isinstance(low_first, bool):
        cap.low_priority_first = low_first
    if "max_total_num_tokens" in info or "page_size" in info or inner:
        cap.engine = "sglang" if cap.engine in ("unknown", "sglang") else cap.engine


async def read_capacity(
    client: httpx.AsyncClient, spec_values: dict[str, int | None], models_json: Any, timeout: float
) -> EngineCapacity:
    """Everything the worker exposes, spec values first; HTTP failures just leave values unknown."""
    cap = EngineCapacity()
    for name in ALL_FIELDS:
        cap.set(name, spec_values.get(name), "config")
    apply_models(cap, models_json)
    try:
        resp = await client.get("/metrics", timeout=timeout)
        if resp.status_code == 200:
            apply_metrics(cap, resp.text)
    except httpx.HTTPError:
        pass
    if cap.engine in ("vllm", "mocker", "unknown") and any(f not in cap.values for f in ALL_FIELDS):
        await _try_json(
            client, "/server_info", {"config_format": "json"}, timeout, lambda j: apply_vllm_server_info(cap, j)
        )
    if cap.engine in ("sglang", "unknown") and cap.unknown:
        await _try_json(client, "/get_server_info", None, timeout, lambda j: apply_sglang_server_info(cap, j))
    return cap


async def _try_json(client: httpx.AsyncClient, path: str, params: dict | None, timeout: float, apply: Any) -> None:
    try:
        resp = await client.get(path, params=params, timeout=timeout)
        if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("application/json"):
            apply(resp.json())
    except (httpx.HTTPError, ValueError):
        pass


def unknown_capacity_message(worker_id: int, cap: EngineCapacity) -> str:
    """The one-line startup warning for a worker whose capacity is not (fully) exposed."""
    missing = cap.unknown
    hints = []
    if "max_num_batched_tokens" in missing:
        hints.append(
            "max_num_batched_tokens: --active-prefill-tokens-threshold-frac and --router-queue-threshold use "
            "10000000 for it (vLLM exports it only on /server_info with VLLM_SERVER_DEV_MODE=1)"
        )
    if "num_gpu_blocks" in missing:
        hints.append("num_gpu_blocks: --active-decode-blocks-threshold cannot apply")
    if "block_size" in missing:
        hints.append("block_size: the frontend uses --kv-cache-block-size or 16")
    return (
        f"worker {worker_id} ({cap.engine}) does not expose {', '.join(missing)}; give them in the worker spec "
        f"(e.g. {','.join(f'{m}=N' for m in missing)}). Meanwhile: " + "; ".join(hints)
    )
