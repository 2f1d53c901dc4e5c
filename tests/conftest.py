import os
import sys
import time
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


# ---- real engines shared across modules, started side by side -------------------------------------------

# Session fixtures whose engines the tests using them share, in the order those tests run. Their tests run one
# after another (from where the first of them was collected); the first of these fixtures a session sets up
# starts the engines of every one the session's tests use, side by side (an engine loading alone leaves one
# of two cores idle for 70-90 s); each fixture's engines stop once the last test using them is done (an idle
# engine takes ~3 % of a core and 1-1.5 GB).
SHARED_ENGINES = ("small_cache_vllm", "vllm_engines")
# a chat template other than the tiny model's (kvroute's built-in one): same tokenizer, other prompt text
OTHER_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
_needed: list[str] = []  # the shared fixtures the session's tests use
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it
_started: dict[str, list[vllm_cpu.VllmEngine]] = {}  # running shared engines, by fixture name
_launched: set[str] = set()  # the fixtures whose engines were started (once: stopped ones stay stopped)
_deadline = 0.0  # when the engines started side by side must be ready


def _uses(item: pytest.Item) -> list[str]:
    names = getattr(item, "fixturenames", ())
    return [name for name in SHARED_ENGINES if name in names]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of the shared engines moved together, to the place of the first of them, grouped in the
    order of ``SHARED_ENGINES`` (the others keep their order)."""
    uses = [_uses(item) for item in items]
    if any(uses):
        first = next(i for i, u in enumerate(uses) if u)
        users = sorted((item for item, u in zip(items, uses, strict=True) if u), key=lambda item: _order(item))
        others = [item for item, u in zip(items, uses, strict=True) if not u]
        items[:] = others[:first] + users + others[first:]


def _order(item: pytest.Item) -> int:
    return min(SHARED_ENGINES.index(name) for name in _uses(item))


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after deselection (-k, -m): the tests that will run
        for name in _uses(item):
            _last_user[name] = item.nodeid
    _needed[:] = [name for name in SHARED_ENGINES if name in _last_user]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    result = yield
    for name, nodeid in _last_user.items():
        if item.nodeid == nodeid:
            _stop(name)  # its fixture's own teardown, at the session's end, finds them stopped
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    for name in list(_started):  # started beside another fixture's engines, but never used (e.g. -x)
        _stop(name)


def _stop(name: str) -> None:
    for engine in _started.pop(name, []):
        engine.stop()


def _small_cache_engines(request: pytest.FixtureRequest) -> list[vllm_cpu.VllmEngine]:
    from support import FAST_EXPORT, SMALL_CACHE_BLOCKS, SMALL_CACHE_BUDGET

    receiver = request.getfixturevalue("otlp_receiver")
    engine = vllm_cpu.VllmEngine(
        python=request.getfixturevalue("vllm_python"),
        model_dir=request.getfixturevalue("tiny_model"),
        num_gpu_blocks=SMALL_CACHE_BLOCKS,
        eager=True,
        extra_args=["--max-num-batched-tokens", str(SMALL_CACHE_BUDGET), "--otlp-traces-endpoint", receiver.endpoint],
        env={"VLLM_SERVER_DEV_MODE": "1", **FAST_EXPORT},
    )
    return [engine]


def _e2e_engines(request: pytest.FixtureRequest) -> list[vllm_cpu.VllmEngine]:
    python, tiny_model = request.getfixturevalue("vllm_python"), request.getfixturevalue("tiny_model")
    loras = {name: os.path.join(tiny_model, "loras", name) for name in ("a1", "a2")}
    # the render routes, and tool calling (vLLM refuses requests with tools without a tool-call parser)
    scale_out = ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    one = vllm_cpu.VllmEngine(python, tiny_model, loras=loras, eager=True, extra_args=scale_out)
    two = vllm_cpu.VllmEngine(python, tiny_model, loras={"a1": loras["a1"]}, eager=True, extra_args=scale_out)
    dp2 = vllm_cpu.VllmEngine(python, tiny_model, dp_size=2, eager=True)
    other = vllm_cpu.VllmEngine(
        python,
        tiny_model,
        kv_events=False,
        eager=True,
        num_gpu_blocks=64,
        # a request's own chat_template is honoured (the template-argument test renders with one)
        extra_args=[*scale_out, "--chat-template", OTHER_TEMPLATE, "--trust-request-chat-template"],
    )
    return [one, two, dp2, other]


_BUILDERS = {"small_cache_vllm": _small_cache_engines, "vllm_engines": _e2e_engines}


def _ready(request: pytest.FixtureRequest, name: str) -> list[vllm_cpu.VllmEngine]:
    """The engines of shared fixture ``name``, ready; the first call starts those of every shared fixture
    the session needs (and not started yet) side by side."""
    global _deadline
    if name not in _launched:
        names = [n for n in _needed if n not in _launched]
        names += [] if name in names else [name]
        batch = {n: _BUILDERS[n](request) for n in names}
        count = sum(e.dp_size for engines in batch.values() for e in engines)
        try:
            for n, engines in batch.items():
                _started[n] = engines
                _launched.add(n)
                for engine in engines:
                    engine.start()
        except BaseException:
            for n in batch:
                _stop(n)
            raise
        _deadline = time.monotonic() + vllm_cpu.START_TIMEOUT * max(1.0, count / 4)
    engines = _started.get(name)
    if engines is None:
        raise RuntimeError(f"{name}'s engines were stopped after the last test collected as using them")
    try:
        for engine in engines:
            engine.wait_ready(max(1.0, _deadline - time.monotonic()))
    except BaseException:
        _stop(name)
        raise
    return engines


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[Any]:
    """A real OTLP trace receiver (gRPC and HTTP/protobuf) on loopback for the session: the small-cache engine
    exports its spans here. Tests read only the traces they started (by trace id, or the ones new since)."""
    from otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def small_cache_vllm(
    request: pytest.FixtureRequest, vllm_python: str, tiny_model: str, otlp_receiver: Any
) -> Iterator[vllm_cpu.VllmEngine]:
    """A real engine with a small KV cache (``SMALL_CACHE_BLOCKS``), a step budget of ``SMALL_CACHE_BUDGET``
    tokens, KV events with replay, ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE``) and its spans
    exported to ``otlp_receiver``, shared by the differential test against the mocker
    (tests/test_mocker_vs_vllm.py) and the trace test across kvroute and vLLM (tests/test_tracing.py).
    Neither depends on what the other left in it: the differential test resets the prefix cache and reads
    the event stream from its own first batch on, and counters as their change; the trace test reads its
    own trace ids."""
    (engine,) = _ready(request, "small_cache_vllm")
    try:
        yield engine
    finally:
        _stop("small_cache_vllm")


@pytest.fixture(scope="session")
def vllm_engines(request: pytest.FixtureRequest, vllm_python: str, tiny_model: str) -> Iterator[dict[str, Any]]:
    """tests/test_vllm_e2e.py's engines: worker 1 (adapters a1, a2), worker 2 (adapter a1), a DP-2 engine
    and an engine rendering chats with another chat template than the model's (``OTHER_TEMPLATE``); all
    but the DP-2 engine serve vLLM's render routes (``--enable-scale-out``)."""
    one, two, dp2, other = _ready(request, "vllm_engines")
    try:
        yield {
            "pair": [one, two],
            "dp2": dp2,
            "other_template": other,
            "model_dir": tiny_model,
            "all": [one, two, dp2, other],
        }
    finally:
        _stop("vllm_engines")
