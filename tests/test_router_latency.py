"""Latency cost model (router/latency.py): estimates, online learning, robustness, bounds, choice."""

import argparse
import random

import pytest

from router.config import RouterConfig, add_router_args
from router.latency import (
    MIN_OBSERVATIONS,
    NEW_PREFIX_SHARE,
    NEW_PREFIX_WEIGHT,
    SAME_SPEED_RATIO,
    LatencyModels,
    LatencyPrior,
    RankLatency,
    formula,
    score_latency,
    scoring_models,
)
from router.selection import CandidateLoad, choose


def _fit(model: RankLatency, base: float, s_tok: float, n: int = 400, seed: int = 0, noise: float = 0.0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        w = rng.uniform(0, 8000)
        d = rng.uniform(0, 3000)
        y = base + s_tok * (w + d)  # decode blocks weigh one prefill token each
        model.observe(w, d, y * (1 + rng.uniform(-noise, noise)))


def test_prior_decides_before_any_observation() -> None:
    m = RankLatency(LatencyPrior(tokens_per_s=10000, base_s=0.01))
    assert m.predict(1000, 0) == pytest.approx(0.01 + 0.1)
    assert m.predict(1000, 160) == pytest.approx(0.01 + 0.1 + 0.016)  # a decode block weighs one prefill token
    assert m.tokens_per_s == pytest.approx(10000)


def test_learns_a_rank_speed_and_base_from_ttfts() -> None:
    m = RankLatency(LatencyPrior(), block_size=16)
    _fit(m, base=0.030, s_tok=1 / 40000, noise=0.02)
    assert m.tokens_per_s == pytest.approx(40000, rel=0.05)
    assert m.base_s == pytest.approx(0.030, abs=0.004)
    assert m.s_per_block == pytest.approx(1 / 40000, rel=0.05)
    assert m.predict(4000, 1000) == pytest.approx(0.030 + 0.1 + 0.025, rel=0.03)


def test_forgetting_follows_a_rank_that_slows_down() -> None:
    m = RankLatency(LatencyPrior(window=50))
    _fit(m, 0.02, 1 / 40000, n=300)
    assert m.tokens_per_s == pytest.approx(40000, rel=0.05)
    _fit(m, 0.02, 1 / 10000, n=300, seed=1)  # e.g. a noisy neighbour on the GPU
    assert m.tokens_per_s == pytest.approx(10000, rel=0.05)


def test_outliers_move_the_fit_only_a_little() -> None:
    m = RankLatency(LatencyPrior())
    rng = random.Random(3)
    for i in range(600):
        w = rng.uniform(0, 8000)
        y = 0.02 + w / 30000
        if i % 25 == 0:
            y += 5.0  # a stalled request every now and then
        m.observe(w, 0, y)
    assert m.tokens_per_s == pytest.approx(30000, rel=0.15)


def test_bad_observations_are_refused_and_bounds_hold() -> None:
    m = RankLatency(LatencyPrior())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert not m.observe(100, 0, bad)
    assert not m.observe(-5, 0, 0.1)
    assert m.observations == 0
    # absurd data (time falls as work grows): speed and base stay within their bounds, decode cost >= 0
    for i in range(200):
        m.observe(i * 100, 10_000 - i * 50, max(1e-4, 2.0 - i * 0.01))
    assert 100 <= m.tokens_per_s <= 1e8
    assert 0.0 <= m.base_s <= 10.0


def test_prior_is_validated() -> None:
    with pytest.raises(ValueError):
        LatencyPrior(tokens_per_s=0)
    with pytest.raises(ValueError):
        LatencyPrior(window=0)


def test_cached_prefix_wins_when_the_holder_is_not_queued() -> None:
    models = LatencyModels(LatencyPrior(), block_size=16)
    loads = [CandidateLoad(1, 0, 0, 200, 1), CandidateLoad(2, 0, 0, 50, 0)]
    # worker 1 holds 100 of the 117 blocks and has a decoding request; kv (w=1) would pick 2 (cost 117+50 vs 17+200+...)
    costs = score_latency(loads, {(1, 0): 100}, 117 * 16, 16, models)
    by = {c.worker_id: c for c in costs}
    assert by[1].prefill_tokens == 17 * 16 and by[2].prefill_tokens == 117 * 16
    assert choose(costs).worker_id == 1


def test_queued_prefill_work_sends_the_request_elsewhere() -> None:
    models = LatencyModels(LatencyPrior(), block_size=16)
    # worker 1 holds half the prompt but has 8k tokens of prefill queued ahead
    loads = [CandidateLoad(1, 0, 8000, 0, 4), CandidateLoad(2, 0, 0, 0, 0)]
    costs = score_latency(loads, {(1, 0): 32}, 1024, 16, models)
    assert choose(costs).worker_id == 2
    by = {c.worker_id: c for c in costs}
    # worker 2 pays its own 1024 tokens plus the 512 it recomputes although worker 1 holds them
    assert by[2].cost == pytest.approx((0.02 + (1024 + 512) / 20000) * 1e3)
    assert by[1].cost == pytest.approx((0.02 + (8000 + 512) / 20000) * 1e3)
    greedy = score_latency(loads, {(1, 0): 32}, 1024, 16, models, recompute_weight=0.0)
    assert {c.worker_id: c.cost for c in greedy}[2] == pytest.approx((0.02 + 1024 / 20000) * 1e3)
    # a moderate queue on the holder: greedy TTFT leaves (700 queued + 512 uncached > 1024 on the idle
    # rank); the recompute charge (+512 there) keeps the prefix in one place
    moderate = [CandidateLoad(1, 0, 700, 0, 1), CandidateLoad(2, 0, 0, 0, 0)]
    assert choose(score_latency(moderate, {(1, 0): 32}, 1024, 16, models, recompute_weight=0.0)).worker_id == 2
    assert choose(score_latency(moderate, {(1, 0): 32}, 1024, 16, models)).worker_id == 1
    # without prefill tracking the queue is invisible and the cache wins
    costs = score_latency(loads, {(1, 0): 32}, 1024, 16, models, track_prefill_tokens=False)
    assert choose(costs).worker_id == 1


def test_a_slow_rank_is_avoided_once_learned() -> None:
    models = LatencyModels(LatencyPrior(), block_size=16)
    for i in range(200):
        w = 500 + (i % 10) * 500
        models.observe((1, 0), w, 0, 0.01 + w / 5000)  # 5k tokens/s
        models.observe((2, 0), w, 0, 0.01 + w / 50000)  # 50k tokens/s
    loads = [CandidateLoad(1, 0, 0, 0, 0), CandidateLoad(2, 0, 1000, 0, 1)]
    costs = score_latency(loads, {(1, 0): 20}, 1024, 16, models)  # rank 1 has most of the prompt cached
    assert choose(costs).worker_id == 2
    assert models.get((1, 0)).tokens_per_s == pytest.approx(5000, rel=0.05)
    assert "Latency for worker_1" in formula(costs[0], models.get((1, 0)))
    models.forget_worker(1)
    assert models.peek((1, 0)) is None and models.peek((2, 0)) is not None
    assert set(models.snapshot()) == {"2:0"}


def test_speeds_within_the_band_are_scored_alike() -> None:
    """A busy rank's fit looks faster (its queued prompts were partly computed already); believing it
    would send it still more work. Within the band the rank with less work wins."""
    models = LatencyModels(LatencyPrior(), block_size=16)
    _fit(models.get((1, 0)), base=0.02, s_tok=1 / 20000)
    _fit(models.get((2, 0)), base=0.02, s_tok=1 / 26000)  # 1.3x: inside the band
    _fit(models.get((3, 0)), base=0.02, s_tok=1 / 21000)
    loads = [CandidateLoad(1, 0, 1000, 0, 1), CandidateLoad(2, 0, 1200, 0, 1), CandidateLoad(3, 0, 1100, 0, 1)]
    assert choose(score_latency(loads, {}, 1024, 16, models)).worker_id == 1
    scored = scoring_models(models, [(1, 0), (2, 0), (3, 0)], 1024)
    assert scored[0] is scored[1] is scored[2] is models.get((3, 0))  # the median rank's model for all
    # outside the band the learned speed counts: a rank 3x slower is scored with its own model
    _fit(models.get((2, 0)), base=0.02, s_tok=3 / 20000, n=800)
    assert models.get((2, 0)).tokens_per_s < 20000 / SAME_SPEED_RATIO
    scored = scoring_models(models, [(1, 0), (2, 0), (3, 0)], 1024)
    assert scored[1] is models.get((2, 0)) and scored[0] is scored[2]
    loads = [CandidateLoad(1, 0, 3000, 0, 1), CandidateLoad(2, 0, 0, 0, 0), CandidateLoad(3, 0, 3000, 0, 1)]
    assert choose(score_latency(loads, {}, 1024, 16, models)).worker_id == 2  # idle, slow but not 3x: 1024 x 3 < 4024


def test_a_new_prefix_spreads_by_live_footprint() -> None:
    """A prompt no rank holds much of starts footprint that its later requests follow: it goes to the rank
    with fewer live blocks though another's queue is a little shorter now. A prompt a rank holds more of
    follows its cache, whatever the footprints."""
    models = LatencyModels(LatencyPrior(tokens_per_s=20000, base_s=0.01), block_size=16)
    loads = [CandidateLoad(1, 0, 0, 0, 0), CandidateLoad(2, 0, 256, 0, 1)]  # rank 2: 256 tokens queued
    live = {(1, 0): 300, (2, 0): 0}  # rank 1 already serves 300 live blocks (its sessions' next turns)
    assert choose(score_latency(loads, {}, 2048, 16, models)).worker_id == 1  # the queue alone decides
    costs = score_latency(loads, {}, 2048, 16, models, live=live)
    assert choose(costs).worker_id == 2
    plain = score_latency(loads, {}, 2048, 16, models)
    charge_ms = NEW_PREFIX_WEIGHT * 300 * 16 / 20000 * 1e3  # blocks' prefill at the prior's speed
    assert costs[0].cost - plain[0].cost == pytest.approx(charge_ms) and costs[1].cost == plain[1].cost
    # a prompt rank 1 holds more than the new-prefix share of: no footprint charge, its cache wins
    held = int(NEW_PREFIX_SHARE * 2048 / 16) + 1
    assert score_latency(loads, {(1, 0): held}, 2048, 16, models, live=live) == score_latency(
        loads, {(1, 0): held}, 2048, 16, models
    )
    assert choose(score_latency(loads, {(1, 0): held}, 2048, 16, models, live=live)).worker_id == 1
    # at the share exactly it is still a new prefix
    at = int(NEW_PREFIX_SHARE * 2048 / 16)
    assert choose(score_latency(loads, {(1, 0): at}, 2048, 16, models, live=live)).worker_id == 2


def test_latency_mode_and_flags_parse() -> None:
    p = argparse.ArgumentParser()
    add_router_args(p, {"DYN_ROUTER_MODE": "latency", "DYN_ROUTER_LATENCY_PREFILL_TOKENS_PER_S": "50000"})
    cfg = RouterConfig.from_args(p.parse_args([]))
    assert cfg.router_mode == "latency" and cfg.kv_aware and cfg.uses_indexer
    assert cfg.router_latency_prefill_tokens_per_s == 50000.0 and cfg.router_latency_window == 100.0
    cfg = RouterConfig.from_args(p.parse_args(["--router-latency-window", "20"]))
    assert cfg.router_latency_window == 20.0
    assert cfg.router_latency_live_horizon == 10.0
    cfg = RouterConfig.from_args(p.parse_args(["--router-latency-live-horizon", "0"]))
    assert cfg.router_latency_live_horizon == 0.0  # the cache terms off
    with pytest.raises(SystemExit):
        p.parse_args(["--router-latency-live-horizon", "-1"])
    with pytest.raises(SystemExit):
        p.parse_args(["--router-latency-prefill-tokens-per-s", "0"])
    assert not RouterConfig(router_mode="round_robin").kv_aware


def test_a_rank_never_chosen_is_scored_like_its_observed_peers() -> None:
    """An engine that has not had a request yet is judged by the model its peers learned, not by the
    prior: with the prior (20k tokens/s) next to peers learned at 160k tokens/s it looked 8x slower and
    never got its first request (the mockers' idle fourth engine)."""
    models = LatencyModels(LatencyPrior(), block_size=32)
    _fit(models.get((1, 0)), base=0.003, s_tok=1 / 160000)
    _fit(models.get((2, 0)), base=0.003, s_tok=1 / 160000, seed=1)
    scored = scoring_models(models, [(1, 0), (2, 0), (3, 0)], 2048)
    assert scored[2] is scored[0] is scored[1]  # the observed median rank's model for all three
    assert any(scored[0] is models.get(k) for k in ((1, 0), (2, 0)))
    # a new session: its 2k-token system prompt is cached on busy rank 1, rank 3 is empty; rank 1 has
    # 12k tokens of prefill queued, so the empty rank's first request is this one
    loads = [CandidateLoad(1, 0, 12000, 0, 4), CandidateLoad(2, 0, 12000, 0, 4), CandidateLoad(3, 0, 0, 0, 0)]
    assert choose(score_latency(loads, {(1, 0): 64}, 2304, 32, models)).worker_id == 3
    # one observed peer is enough: the empty rank's estimate is at the learned speed (base + its whole
    # prompt + the recompute charge for the 64 blocks rank 1 holds), not the prior's 20k tokens/s
    one_peer = LatencyModels(LatencyPrior(), block_size=32)
    _fit(one_peer.get((1, 0)), base=0.003, s_tok=1 / 160000)
    est = {c.worker_id: c.cost for c in score_latency(loads[::2], {(1, 0): 64}, 2304, 32, one_peer)}
    assert est[3] == pytest.approx((0.003 + (2304 + 2048) / 160000) * 1e3, rel=0.1)
    assert est[3] < (2304 + 2048) / 20000 * 1e3 / 4
    # no rank observed yet: the prior decides for all
    fresh = LatencyModels(LatencyPrior(), block_size=32)
    assert scoring_models(fresh, [(1, 0), (2, 0)], 2048) == [fresh.unobserved] * 2


def test_ranks_are_scored_alike_until_one_is_observed_enough() -> None:
    """Right after start-up two ranks have seen two fast first tokens each and two have seen none. A
    fit from two observations beside the prior made the ranks without one look over twice as slow, and
    a fourth system prompt went to a rank serving another's sessions, charged for its footprint, rather
    than to the empty rank, which then got no request for the whole run (the mockers' idle engine)."""
    models = LatencyModels(LatencyPrior(), block_size=32)
    for key in ((1, 0), (3, 0)):
        assert models.observe(key, 2688, 0, 0.007) and models.observe(key, 1949, 0, 0.0065)
    busy = models.get((3, 0))
    prior = RankLatency(LatencyPrior(), block_size=32)
    assert busy.observations == 2 < MIN_OBSERVATIONS
    assert busy.predict(2784, 0) < prior.predict(2784, 0) / 2  # what its own model would claim
    # a new prefix of 2,784 tokens: ranks 1 and 3 serve a system prompt's sessions each (84 live blocks and
    # their decode), ranks 2 and 4 are empty
    loads = [CandidateLoad(w, 0, 0, 87 + (84 if w in (1, 3) else 0), 1 if w in (1, 3) else 0) for w in (1, 2, 3, 4)]
    live = {(1, 0): 84, (2, 0): 0, (3, 0): 84, (4, 0): 0}
    costs = score_latency(loads, {}, 2784, 32, models, live=live)
    assert {c.worker_id for c in costs if c.cost == min(x.cost for x in costs)} == {2, 4}
    keys = [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert scoring_models(models, keys, 2784) == [models.unobserved] * 4
    # once a rank is observed enough, the unobserved ones are scored with the observed median's model
    for w, t in ((2688, 0.007), (1949, 0.0065)):
        models.observe((3, 0), w, 0, t)
    assert scoring_models(models, keys, 2784) == [busy] * 4
    assert choose(score_latency(loads, {}, 2784, 32, models, live=live)).worker_id in (2, 4)


def test_evicting_live_blocks_is_charged_as_their_recompute() -> None:
    """Taking a prompt onto a rank whose recently used blocks fill its cache evicts some of them; each
    is charged as computing it again, so a rank with room wins once the charge exceeds the prefix it
    would reuse."""
    models = LatencyModels(LatencyPrior(), block_size=32)
    loads = [CandidateLoad(1, 0, 0, 0, 1), CandidateLoad(2, 0, 0, 0, 0)]
    overlaps = {(1, 0): 60}  # rank 1 holds 60 of the prompt's 80 blocks
    assert choose(score_latency(loads, overlaps, 80 * 32, 32, models)).worker_id == 1
    # rank 1's cache is full of live blocks: its 20 new blocks evict 20 live ones (20 x 32 tokens more)
    costs = {c.worker_id: c.cost for c in score_latency(loads, overlaps, 80 * 32, 32, models, overflow={(1, 0): 20})}
    plain = {c.worker_id: c.cost for c in score_latency(loads, overlaps, 80 * 32, 32, models)}
    assert costs[1] - plain[1] == pytest.approx(20 * 32 / 20000 * 1e3)
    assert costs[2] == plain[2]
    # a deeper overflow (its live set far over capacity: every block it takes pushes a live one out)
    # makes the empty rank the better place despite the 60 cached blocks (80 x 32 + 60 x 32 there)
    assert choose(score_latency(loads, overlaps, 80 * 32, 32, models, overflow={(1, 0): 130})).worker_id == 2


def test_a_new_session_goes_where_the_cache_has_room() -> None:
    """The room term: a new session whose system prompt (32 blocks) sits on a rank whose live set fills
    its cache goes to the empty rank, where its later turns will not push the others' history out; with
    room on the holder it stays with its prefix."""
    models = LatencyModels(LatencyPrior(), block_size=32)
    loads = [CandidateLoad(1, 0, 0, 0, 1), CandidateLoad(2, 0, 0, 0, 0)]
    overlaps, isl = {(1, 0): 32}, 40 * 32
    full = {(1, 0): 300.0, (2, 0): 0.0}  # rank 1: 300 live blocks in a 300-block cache
    costs = {c.worker_id: c.cost for c in score_latency(loads, overlaps, isl, 32, models, pressure=full)}
    # rank 1: 8 new blocks + a quarter block per live block; rank 2: the whole prompt + the 32 blocks again
    assert costs[1] - costs[2] == pytest.approx((8 * 32 + 300 * 32 / 4 - 40 * 32 - 32 * 32) / 20000 * 1e3)
    assert choose(score_latency(loads, overlaps, isl, 32, models, pressure=full)).worker_id == 2
    half = {(1, 0): 150 * 0.5, (2, 0): 0.0}  # 150 live blocks in the same cache: weighs a quarter as much
    assert choose(score_latency(loads, overlaps, isl, 32, models, pressure=half)).worker_id == 1
    assert choose(score_latency(loads, overlaps, isl, 32, models)).worker_id == 1  # no cache terms: sticky
    # a fresh prompt (cached nowhere) goes to the rank with less live data, all else equal
    fresh = score_latency(loads, {}, isl, 32, models, pressure={(1, 0): 10.0, (2, 0): 40.0})
    assert choose(fresh).worker_id == 1
