"""The mocker timed by a GPU's measured tables (``--perf-profile``): the tables reproduce their own points,
mixed steps stay near the measured ones, every chunk of a batch is priced, and a real mocker process's lone
request has the profile's time to first token."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mocker.config import parse_args
from mocker.engine import RankScheduler, Sequence, sequence_rng
from mocker.gpu_profile import GpuProfile, shipped
from mocker.kv_cache import KvCache
from mocker.perf_model import PerfModel
from support import free_port, service

PROFILES = ("h200-llama-3.1-8b", "h200-qwen2.5-32b")


def test_both_h200_profiles_ship_with_their_provenance():
    assert set(PROFILES) <= set(shipped())
    for name in PROFILES:
        p = GpuProfile.load(name)
        assert p.gpu == "NVIDIA H200" and "Measured on one NVIDIA H200" in p.provenance
        assert len(p._prefill) == 4 and all(len(r.xs) == 7 for r in p._prefill)


@pytest.mark.parametrize("name", PROFILES)
def test_the_tables_reproduce_their_own_points(name):
    p = GpuProfile.load(name)
    with open(f"mocker/profiles/{name}.json", encoding="utf-8") as f:
        data = json.load(f)
    for cached, new, ms in data["prefill"]:
        assert p.prefill_ms(new, cached) == pytest.approx(ms, rel=1e-9)
        assert p.step_ms([(new, cached)], []) == pytest.approx(ms, rel=1e-9)
    for batch, context, ms in data["decode"]:
        assert p.decode_ms(batch, context) == pytest.approx(ms, rel=1e-9)
        assert p.step_ms([], [context] * batch) == pytest.approx(ms, rel=1e-9)


@pytest.mark.parametrize("name", PROFILES)
def test_mixed_steps_are_the_sum_of_their_parts_less_one_weight_read(name):
    """Against the measured mixed steps (a prefill chunk beside 32 or 128 decodes): within 8 %."""
    p = GpuProfile.load(name)
    assert p.mixed
    for new, cached, decodes, context, ms in p.mixed:
        model = p.step_ms([(new, cached)], [context] * decodes)
        assert model == pytest.approx(ms, rel=0.08), (new, cached, decodes, context)
        parts = p.prefill_ms(new, cached) + p.decode_ms(decodes, context)
        assert model == pytest.approx(parts - p.weight_read_ms)


def test_between_and_beyond_the_points():
    """Monotone in new tokens, cached tokens, batch and context, including outside the measured range."""
    p = GpuProfile.load("h200-qwen2.5-32b")
    for cached in (0, 1000, 2048, 20000, 65536):
        times = [p.prefill_ms(n, cached) for n in (1, 16, 128, 300, 1024, 10000, 16384, 40000)]
        assert times == sorted(times) and times[0] > 0
    for new in (1, 128, 3000, 16384):
        times = [p.prefill_ms(new, c) for c in (0, 1000, 2048, 9000, 32768, 100000)]
        assert times == sorted(times)
    for context in (100, 1024, 3000, 16384, 40000):
        times = [p.decode_ms(b, context) for b in (1, 2, 8, 33, 128, 300)]
        assert times == sorted(times)
    # a batch beyond the measured ones costs at least each extra sequence's KV read at the HBM rate
    extra = p.decode_ms(40, 16384) - p.decode_ms(8, 16384)
    assert extra >= 0.999 * 32 * 16384 * p.kv_bytes_per_token / p.hbm_bytes_per_ms


def test_kv_capacity_is_the_gpu_memory_less_the_weights():
    p = GpuProfile.load("h200-qwen2.5-32b")
    assert p.kv_capacity_tokens() == int((139.8 - 61.0) * 1024**3 // 262144)
    cfg = parse_args(["--perf-profile", "h200-qwen2.5-32b", "--block-size", "32"])
    assert cfg.num_gpu_blocks == p.kv_capacity_tokens() // 32 + 1
    assert parse_args(["--perf-profile", "h200-qwen2.5-32b", "--num-gpu-blocks", "100"]).num_gpu_blocks == 100
    assert parse_args([]).num_gpu_blocks == 4096 and parse_args([]).perf_profile is None


def test_a_bad_profile_is_refused_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--perf-profile", "no-such-profile"])
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="not a GPU profile"):
        GpuProfile.load(str(bad))


def test_every_chunk_of_a_batch_is_priced_with_its_cached_context():
    """Two prompts admitted in one step, the second behind the first's cached blocks, then decodes: each
    step costs what the profile says for its parts."""
    profile = GpuProfile.load("h200-llama-3.1-8b")
    kv = KvCache(4096, 16, ext_seed=1)
    s = RankScheduler(kv, PerfModel(1.0, profile), 8, 65536, None, output_vocab=list(range(100, 200)))
    shared = list(range(1000, 3048))  # 2,048 tokens, 128 full blocks

    def add(rid, prompt):
        s.add(Sequence(rid, prompt, 4, lambda t, r: None, sequence_rng(0, None, prompt), ignore_eos=True))

    add("a", shared + [7] * 100)
    step = s.schedule()
    assert step.seconds == pytest.approx(profile.prefill_ms(2148, 0) / 1000)
    s.commit(step)
    add("b", shared + [9] * 1000)  # 2,048 cached, 1,000 new
    add("c", [5] * 512)
    step = s.schedule()
    expected = profile.step_ms([(1000, 2048), (512, 0)], [2149])
    assert step.seconds == pytest.approx(expected / 1000)
    s.commit(step)
    step = s.schedule()  # three decodes
    assert step.seconds == pytest.approx(profile.decode_ms(3, (2150 + 3049 + 513) / 3) / 1000)


def _ttft_sum(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:time_to_first_token_seconds":
            total = sum(x.value for x in family.samples if x.name.endswith("_sum"))
            count = sum(x.value for x in family.samples if x.name.endswith("_count"))
            return total, count
    raise AssertionError("no TTFT histogram")


@pytest.mark.parametrize(
    ("name", "speedup", "points"),
    [
        # (cached, new): a short prompt, a hit on 2k, a long prefill after 8k, the 32k-history turn
        ("h200-llama-3.1-8b", 0.25, [(0, 128), (2048, 1024), (8192, 4096), (0, 2048)]),
        ("h200-qwen2.5-32b", 1.0, [(0, 128), (2048, 1024), (32768, 128), (8192, 512)]),
    ],
)
def test_a_lone_requests_ttft_on_a_mocker_is_the_profiles_point(name, speedup, points):
    """A real mocker process: each prompt's prefix first cached by a request of its own, then the prompt
    alone (three times, fresh new tokens behind the same prefix); the engine's TTFT (its histogram, times the
    speedup ratio: simulated ms) within 10 % of the profile's measured point. The speedup ratio keeps every
    measured time at 30 ms or more."""
    profile = GpuProfile.load(name)
    with open(f"mocker/profiles/{name}.json", encoding="utf-8") as f:
        measured = {(c, n): ms for c, n, ms in json.load(f)["prefill"]}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "mocker", "--host", "127.0.0.1", "--port", str(port), "--perf-profile", name,
            "--speedup-ratio", str(speedup), "--max-num-batched-tokens", "65536", "--max-model-len", "65536",
            "--no-kv-events", "--replay-endpoint", ""]  # fmt: skip
    rng = random.Random(7)
    with service(args, ready_url=f"{url}/v1/models", timeout=90), httpx.Client(base_url=url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for cached, new in points:
            prefix = [rng.randrange(1000, 16000) for _ in range(cached)]
            if prefix:
                r = c.post("/v1/completions", json={"model": model, "prompt": prefix, "max_tokens": 1})
                assert r.status_code == 200, r.text
            times = []
            for _ in range(3):  # a busy machine only delays a step: the least of three
                prompt = prefix + [rng.randrange(1000, 16000) for _ in range(new)]
                before = _ttft_sum(url)
                r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
                after = _ttft_sum(url)
                assert after[1] == before[1] + 1
                times.append((after[0] - before[0]) * 1000 * speedup)
            assert min(times) == pytest.approx(measured[(cached, new)], rel=0.10), (cached, new, times)
            assert profile.prefill_ms(new, cached) == pytest.approx(measured[(cached, new)])
