"""The real-engine benchmark's set-up, without engines: what it would run, and how it hands engines to the frontend."""

from __future__ import annotations

import subprocess
import sys

from bench.real_engines import DEFAULT_MODES, engine_workers, parser
from bench.replay import build_trace, gpu_blocks_for, mode_rows
from bench.traces import distinct_blocks
from kvroute_common.real_engines.vllm_cpu import BLOCK_SIZE, VllmEngine


def test_default_run_is_the_three_modes_with_caches_that_never_evict():
    args = parser().parse_args([])
    assert [m.label for m in mode_rows(args.modes, args.variant, default_variants=())] == list(DEFAULT_MODES)
    assert args.block_size == BLOCK_SIZE
    trace = build_trace("synthetic", args)
    assert len(trace.requests) == args.sessions * args.turns
    # the help text's promise: every engine could hold the whole schedule, so hit rates differ by routing only
    assert distinct_blocks([r.tokens for r in trace.requests], args.block_size) <= gpu_blocks_for(trace, args)


def test_engines_become_frontend_workers_with_their_event_endpoints():
    engines = [VllmEngine("python", "model"), VllmEngine("python", "model")]
    for e in engines:
        e.proc = subprocess.Popen([sys.executable, "-c", "pass"])
        e.proc.wait()
    workers = engine_workers(engines)
    assert [w.frontend_spec() for w in workers] == [e.worker_spec(i) for i, e in enumerate(engines, 1)]
