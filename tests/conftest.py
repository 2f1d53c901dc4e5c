import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvroute_common.real_engines import vllm_cpu

# make `tests.support` importable as `support` too, whatever the rootdir
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# ---- real vLLM engines (vLLM's CPU build, KVROUTE_VLLM_PYTHON), shared by every real-engine test ----


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of vLLM's environment; skips (fails under KVROUTE_REQUIRE_VLLM, as in CI) without it."""
    python = vllm_cpu.vllm_python()
    if python is None:
        if os.environ.get(vllm_cpu.REQUIRE_ENV):
            pytest.fail(vllm_cpu.missing_reason())
        pytest.skip(vllm_cpu.missing_reason())
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight Llama with kvroute's tokenizer, and LoRA adapters a1 and a2 in loras/."""
    out = str(tmp_path_factory.mktemp("tiny-model"))
    return vllm_cpu.write_tiny_model(vllm_python, out, loras=("a1", "a2"))


# ---- one small-cache vLLM engine shared by tests/test_mocker_vs_vllm.py and tests/test_tracing.py ----

# Session engines that the tests using them share: those tests run one after another (from where the first
# of them was collected), and the engine stops when the last of them is done, so an idle engine (~3 % of a
# core, 1-1.5 GB) is not left beside the rest of the suite.
SHARED_ENGINES = ("small_cache_vllm",)
_running: dict[str, vllm_cpu.VllmEngine] = {}  # started shared engines, by fixture name
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each shared engine's tests moved together, to the place of the first of them (the others keep their
    order): pytest's own ordering would leave the engine idle between two modules far apart."""
    for name in SHARED_ENGINES:
        uses = [name in getattr(item, "fixturenames", ()) for item in items]
        if any(uses):
            first = uses.index(True)
            users = [item for item, use in zip(items, uses, strict=True) if use]
            others = [item for item, use in zip(items, uses, strict=True) if not use]
            items[:] = others[:first] + users + others[first:]


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after deselection (-k, -m): the tests that will run
        for name in SHARED_ENGINES:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    result = yield
    for name, nodeid in _last_user.items():
        if item.nodeid == nodeid and name in _running:
            _running.pop(name).stop()  # its fixture's own teardown, at the session's end, finds it stopped
    return result


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[Any]:
    """A real OTLP trace receiver (gRPC and HTTP/protobuf) on loopback for the session: the shared engine
    exports its spans here. Tests read only the traces they started (by trace id, or the ones new since)."""
    from otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def small_cache_vllm(vllm_python: str, tiny_model: str, otlp_receiver: Any) -> Iterator[vllm_cpu.VllmEngine]:
    """A real engine with a small KV cache (``SMALL_CACHE_BLOCKS``), a step budget of ``SMALL_CACHE_BUDGET``
    tokens, KV events with replay, ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE``) and its spans
    exported to ``otlp_receiver``: started once for the session (70-90 s on 2 cores) and shared by the
    differential test against the mocker and the trace test across kvroute and vLLM. Neither depends on
    what the other left in it: the differential test resets the prefix cache and reads the event stream
    from its own first batch on, and counters as their change; the trace test reads its own trace ids."""
    from support import FAST_EXPORT, SMALL_CACHE_BLOCKS, SMALL_CACHE_BUDGET

    engine = vllm_cpu.VllmEngine(
        python=vllm_python,
        model_dir=tiny_model,
        num_gpu_blocks=SMALL_CACHE_BLOCKS,
        extra_args=[
            "--max-num-batched-tokens",
            str(SMALL_CACHE_BUDGET),
            "--otlp-traces-endpoint",
            otlp_receiver.endpoint,
        ],
        env={"VLLM_SERVER_DEV_MODE": "1", **FAST_EXPORT},
    )
    _running["small_cache_vllm"] = engine.start()
    try:
        engine.wait_ready()
        yield engine
    finally:
        _running.pop("small_cache_vllm", None)
        engine.stop()
