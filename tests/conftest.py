import os
import sys

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
