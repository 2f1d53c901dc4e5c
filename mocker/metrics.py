"""Prometheus metrics with vLLM's names and labels (``model_name``, ``engine`` = DP rank).

Gauges and counters are read from the schedulers when scraped (nothing to update on the hot
path); latency histograms are observed once per request. ``vllm:cache_config_info`` carries only
what vLLM's carries (its CacheConfig: block size, KV blocks, ...): the scheduler's budget
(``max_num_batched_tokens``, ``max_num_seqs``) is on ``/server_info`` as in vLLM, so a frontend
tested against the mocker reads real vLLM the same way. ``kvroute_mocker_info`` (not a vLLM name)
tells a frontend it talks to the mocker, and which tokenizer the mocker uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mocker.config import MockerConfig
from mocker.engine import RankScheduler, Sequence

LABELS = ["model_name", "engine"]
# vLLM's buckets for request-level latencies
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
REQUEST_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


class _EngineState(Collector):
    def __init__(self, cfg: MockerConfig, schedulers: Seq[RankScheduler]) -> None:
        self.cfg = cfg
        self.schedulers = schedulers

    def collect(self) -> Iterable:
        name = self.cfg.served_model_name
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labels=LABELS
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels=LABELS
        )
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Number of prefill tokens processed.", labels=LABELS)
        gen = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.", labels=LABELS)
        preempt = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=LABELS
        )
        info_labels = [
            "block_size",
            "num_gpu_blocks",
            "num_gpu_blocks_override",
            "enable_prefix_caching",
            "cache_dtype",
            "gpu_memory_utilization",
            "engine",
        ]
        mocker = GaugeMetricFamily(
            "kvroute_mocker_info",
            "The kvroute simulated engine (not a vLLM metric)",
            labels=["model_name", "tokenizer"],
        )
        mocker.add_metric([name, self.cfg.model_path or "builtin"], 1.0)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
        )
        cfg = self.cfg
        for rank, s in enumerate(self.schedulers):
            lv = [name, str(rank)]
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting)
            usage.add_metric(lv, s.kv.usage)
            queries.add_metric(lv, s.stats.prefix_cache_queries)
            hits.add_metric(lv, s.stats.prefix_cache_hits)
            prompt.add_metric(lv, s.stats.prompt_tokens)
            gen.add_metric(lv, s.stats.generation_tokens)
            preempt.add_metric(lv, s.stats.preemptions)
            info.add_metric(
                [
                    str(cfg.block_size),
                    str(cfg.num_gpu_blocks),
                    str(cfg.num_gpu_blocks),
                    "True",
                    "auto",
                    "0.9",
                    str(rank),
                ],
                1.0,
            )
        yield from (running, waiting, usage, queries, hits, prompt, gen, preempt, info, mocker)


class MockerMetrics:
    def __init__(self, cfg: MockerConfig, schedulers: Seq[RankScheduler]) -> None:
        self.model_name = cfg.served_model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineState(cfg, schedulers))
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ["finished_reason"],
            registry=r,
        )
        self.prompt_hist = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            LABELS,
            buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000],
            registry=r,
        )

    def first_token(self, rank: int, seq: Sequence, ttft: float) -> None:
        self.ttft.labels(self.model_name, str(rank)).observe(ttft)

    def finished(self, rank: int, seq: Sequence, reason: str, e2e: float) -> None:
        labels = (self.model_name, str(rank))
        self.success.labels(*labels, reason).inc()  # vLLM counts every finish reason, abort included
        self.e2e.labels(*labels).observe(e2e)
        self.prompt_hist.labels(*labels).observe(seq.prompt_len)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_sglang(cfg: MockerConfig, schedulers: Seq[RankScheduler]) -> bytes:
    """``/metrics`` as SGLang names its scheduler gauges (``--impersonate sglang``): no vLLM or
    mocker names, so the frontend detects an SGLang engine exactly as it would a real one."""
    name = cfg.served_model_name
    lines = []
    for metric, help_text, value in (
        ("sglang:num_running_reqs", "The number of running requests.", lambda s: s.num_running),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lambda s: s.num_waiting),
        ("sglang:token_usage", "The token usage.", lambda s: s.kv.usage),
    ):
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} gauge")
        for rank, s in enumerate(schedulers):
            lines.append(f'{metric}{{model_name="{name}",dp_rank="{rank}"}} {float(value(s))}')
    return ("\n".join(lines) + "\n").encode()
