"""Cost and choice: the guide's worked example, ties, temperature, and flag/env parsing."""

import argparse
import collections
import math
import random

import pytest

from router.config import RouterConfig, add_router_args
from router.selection import CandidateLoad, WorkerCost, choose, formula, score_candidates, softmax_weights


def _cost(w: int, c: float) -> WorkerCost:
    return WorkerCost(w, 0, 0, 0, 0.0, 0.0, 0, c)


def test_guide_example_picks_worker_2() -> None:
    # guide: W1 prefill 8 + decode 10 = 18; W2 5 + 5 = 10 (chosen); W3 2 + 9 = 11  (block size 1 keeps blocks == tokens)
    loads = [CandidateLoad(1, 0, 8, 10), CandidateLoad(2, 0, 5, 5), CandidateLoad(3, 0, 2, 9)]
    costs = score_candidates(loads, {}, isl_tokens=0, block_size=1)
    assert [c.cost for c in costs] == [18.0, 10.0, 11.0]
    assert choose(costs, 0.0).worker_id == 2


def test_overlap_reduces_prefill_and_weight_scales_it() -> None:
    loads = [CandidateLoad(1, 0, 0, 4), CandidateLoad(2, 0, 0, 4)]
    costs = score_candidates(loads, {(1, 0): 3}, isl_tokens=64, block_size=16, overlap_score_weight=2.0)
    by = {c.worker_id: c for c in costs}
    assert by[1].prefill_tokens == 16 and by[1].prefill_blocks == 1.0 and by[1].cost == 2.0 * 1.0 + 4
    assert by[2].prefill_tokens == 64 and by[2].cost == 2.0 * 4.0 + 4
    assert choose(costs).worker_id == 1


def test_prefill_blocks_is_a_float_and_includes_in_flight_tokens() -> None:
    costs = score_candidates([CandidateLoad(1, 0, 10, 0)], {}, isl_tokens=30, block_size=16)
    assert costs[0].prefill_blocks == pytest.approx(40 / 16)


def test_overlap_beyond_prompt_never_negative() -> None:
    costs = score_candidates([CandidateLoad(1, 0, 0, 0)], {(1, 0): 10}, isl_tokens=20, block_size=16)
    assert costs[0].prefill_tokens == 0


def test_untracked_decode_falls_back_to_floor_of_prefill_blocks() -> None:
    costs = score_candidates([CandidateLoad(1, 0, 0, None)], {}, isl_tokens=40, block_size=16)
    assert costs[0].decode_blocks == 2.0


def test_ties_at_zero_temperature_are_broken_uniformly() -> None:
    costs = [_cost(1, 5.0), _cost(2, 5.0), _cost(3, 9.0)]
    rng = random.Random(7)
    counts = collections.Counter(choose(costs, 0.0, rng).worker_id for _ in range(2000))
    assert set(counts) == {1, 2}
    assert 800 < counts[1] < 1200


def test_softmax_is_relative_to_cost_range() -> None:
    w = softmax_weights([0.0, 10.0], 1.0)
    assert w[1] / w[0] == pytest.approx(math.exp(-1))
    # scaling all costs leaves probabilities unchanged
    assert softmax_weights([0.0, 1000.0], 1.0) == pytest.approx(w)


def test_temperature_samples_follow_softmax() -> None:
    costs = [_cost(1, 0.0), _cost(2, 10.0)]
    rng = random.Random(1)
    n = 4000
    counts = collections.Counter(choose(costs, 1.0, rng).worker_id for _ in range(n))
    expected = 1 / (1 + math.exp(-1))
    assert abs(counts[1] / n - expected) < 0.04


def test_equal_costs_with_temperature_are_uniform() -> None:
    costs = [_cost(1, 3.0), _cost(2, 3.0)]
    rng = random.Random(3)
    counts = collections.Counter(choose(costs, 0.5, rng).worker_id for _ in range(2000))
    assert 800 < counts[1] < 1200


def test_formula_line() -> None:
    c = WorkerCost(1, 0, 15, 0, 100.5, 25.0, 0, 125.5)
    assert formula(c, 1.0) == "Formula for worker_1: 125.5 = 1.0 * 100.5 + 25.0 (cached_blocks: 15)"


def _parse(argv: list[str], env: dict[str, str]) -> RouterConfig:
    p = argparse.ArgumentParser()
    add_router_args(p, environ=env)
    return RouterConfig.from_args(p.parse_args(argv))


def test_defaults_match_the_guide() -> None:
    cfg = _parse([], {})
    assert cfg.router_mode == "round_robin" and cfg.router_temperature == 0.0
    assert cfg.router_kv_events and cfg.router_kv_overlap_score_weight == 1.0
    assert cfg.router_ttl_secs == 120.0 and cfg.router_max_tree_size == 1048576 and cfg.router_prune_target_ratio == 0.8
    assert cfg.router_track_active_blocks and not cfg.router_track_output_blocks and cfg.router_assume_kv_reuse
    assert cfg.router_queue_threshold is None and cfg.router_queue_policy == "fcfs"


def test_env_then_flag_precedence() -> None:
    env = {"DYN_ROUTER_MODE": "kv", "DYN_ROUTER_TEMPERATURE": "0.5", "DYN_ROUTER_USE_KV_EVENTS": "false"}
    cfg = _parse([], env)
    assert cfg.router_mode == "kv" and cfg.router_temperature == 0.5 and not cfg.router_kv_events
    cfg = _parse(["--router-temperature", "0.1", "--router-kv-events", "--router-mode", "round-robin"], env)
    assert cfg.router_temperature == 0.1 and cfg.router_kv_events and cfg.router_mode == "round_robin"


def test_negated_flags_and_legacy_names() -> None:
    cfg = _parse(
        ["--no-router-track-active-blocks", "--no-router-assume-kv-reuse", "--kv-overlap-score-weight", "2"], {}
    )
    assert not cfg.router_track_active_blocks and not cfg.router_assume_kv_reuse
    assert cfg.router_kv_overlap_score_weight == 2.0


def test_invalid_values_are_rejected() -> None:
    with pytest.raises(SystemExit):
        _parse(["--router-mode", "sideways"], {})
    with pytest.raises(SystemExit):
        _parse(["--active-decode-blocks-threshold", "1.5"], {})
    with pytest.raises(SystemExit):
        _parse([], {"DYN_ROUTER_TEMPERATURE": "warm"})
    # the router guide: "Must be > 0" (0, "hold on any prefill", is refused)
    with pytest.raises(SystemExit):
        _parse(["--router-queue-threshold", "0"], {})
    assert _parse(["--router-queue-threshold", "0.5"], {}).router_queue_threshold == 0.5
