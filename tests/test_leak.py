"""The leak test's CI version: 300 requests through a real frontend to 4 real mockers, with client
cancellations before the first byte and mid-stream and mockers killed and restarted on their ports.

Afterwards no load is left in ``/loads``, no request queued or in flight, and the embedded index
equals the mockers' caches exactly (``bench.leak.check``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from bench.leak import Gate, index_blocks
from tests.support import REPO_ROOT


def test_index_blocks_reads_device_stored_events_per_worker_rank():
    dump = {
        "m:default": {
            "block_size": 16,
            "events": [
                {
                    "worker_id": 3,
                    "storage_tier": "device",
                    "event": {
                        "dp_rank": 1,
                        "data": {
                            "stored": {
                                "blocks": [{"block_hash": 10, "tokens_hash": 11}, {"block_hash": 12, "tokens_hash": 13}]
                            }
                        },
                    },
                },
                {
                    "worker_id": 3,
                    "storage_tier": "host_pinned",
                    "event": {"dp_rank": 1, "data": {"stored": {"blocks": [{"block_hash": 20, "tokens_hash": 21}]}}},
                },
            ],
        }
    }
    assert index_blocks(dump) == {(3, 1): {(10, 11), (12, 13)}}


def test_gate_waits_for_the_requests_under_way_and_holds_back_the_next_until_opened():
    """``EngineRestarts`` closes the conversations' gate so that its witness is the only request in flight."""

    async def main() -> list[str]:
        gate = Gate()
        started, release = asyncio.Event(), asyncio.Event()
        entered: list[str] = []

        async def request(name: str, hold: bool = False) -> None:
            async with gate.request():
                entered.append(name)
                if hold:
                    started.set()
                    await release.wait()

        first = asyncio.create_task(request("first", hold=True))
        await started.wait()
        closing = asyncio.create_task(gate.close(10.0))
        second = asyncio.create_task(request("second"))
        for _ in range(20):  # let both tasks run as far as they can (yields to the loop, no timed wait)
            await asyncio.sleep(0)
        assert not closing.done() and not second.done() and entered == ["first"]  # both wait while "first" runs
        release.set()
        await asyncio.wait_for(closing, 10.0)  # closed once "first" ended
        assert entered == ["first"] and not second.done()  # "second" held back
        gate.open()
        await asyncio.wait_for(asyncio.gather(first, second), 10.0)
        return entered

    assert asyncio.run(main()) == ["first", "second"]


def test_leak_short(tmp_path):
    out = tmp_path / "leak"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "leak", "--requests", "300", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads((out / "leak.json").read_text())
    assert report["ok"] and sum(report["outcomes"].values()) == 300
    assert report["faults_injected"] >= 1
    assert (
        report["outcomes"].get("cancelled_before_first_byte", 0) + report["outcomes"].get("cancelled_mid_stream", 0) > 0
    )
    assert report["loads_nonzero"] == [] and not any(report["gauges"].values())
    assert report["index_diff"] == {} and report["index_blocks"] == report["engine_blocks"] > 0
