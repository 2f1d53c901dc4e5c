"""``python -m frontend``: flags, workers, and the uvicorn server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from frontend.routing.media_policy import DEFAULT_MAX_FETCH_BYTES, DEFAULT_MAX_IMAGES, MediaPolicy
from kvroute_common.drain import add_drain_arg
from kvroute_common.gc_policy import tune_gc
from kvroute_common.multimodal import DEFAULT_MAX_IMAGE_BYTES, HASH_ALGORITHMS, ImageOptions
from kvroute_common.security import add_security_args
from kvroute_common.tokenize_offload import LOOP_SWITCH_INTERVAL_MS, bound_encoder_threads
from router.config import JETSTREAM_FLAGS, RouterConfig, add_router_args

log = logging.getLogger("frontend")

# flags of later features: accepted now, but say so instead of silently doing nothing
_NOT_YET: dict[str, str] = {}


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not an integer") from None


def _env_flag(name: str) -> bool:
    """An on/off setting from the environment: anything but unset, empty, 0 or false is on."""
    return os.environ.get(name, "") not in ("", "0", "false")


SEND_IDS_MODES = ("auto", "always", "never")  # --send-token-ids (frontend.routing.prompt.takes_prompt_ids)


def _send_ids_mode(value: str) -> str:
    """``KVROUTE_SEND_TOKEN_IDS``: auto (unset or empty), always (also 1, true) or never (also 0, false)."""
    mode = {"": "auto", "1": "always", "true": "always", "0": "never", "false": "never"}.get(value.lower(), value)
    if mode not in SEND_IDS_MODES:
        raise SystemExit(f"KVROUTE_SEND_TOKEN_IDS={value!r}: expected one of {', '.join(SEND_IDS_MODES)}")
    return mode


def media_policy_from_args(ns: argparse.Namespace) -> MediaPolicy:
    """The media fetch policy of the ``--mm-*`` flags; a bad value is a start-up error."""
    raw = ns.mm_allowed_media_domains
    domains = [d for item in ([raw] if isinstance(raw, str) else raw) for d in item.split(",")]
    try:
        return MediaPolicy.from_flags(
            domains, ns.mm_allow_private_media_hosts, ns.mm_max_images_per_request, ns.mm_max_fetch_bytes_per_request
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m frontend",
        description="kvroute: KV-cache-aware OpenAI-compatible frontend in front of vLLM / SGLang / mocker workers.",
    )
    g = p.add_argument_group("frontend")
    g.add_argument(
        "--http-host",
        default=os.environ.get("DYN_HTTP_HOST", "0.0.0.0"),
        help="listen address [env DYN_HTTP_HOST; default 0.0.0.0]",
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=int(os.environ.get("DYN_HTTP_PORT", "8000")),
        help="listen port [env DYN_HTTP_PORT; default 8000]",
    )
    g.add_argument(
        "--epp-port",
        type=int,
        default=_env_int("KVROUTE_EPP_PORT"),
        metavar="PORT",
        help="also serve as the endpoint picker of a Gateway API inference gateway: Envoy's ext_proc gRPC "
        "service on this port (plaintext HTTP/2, on --http-host), making the proxy's routing decision and "
        "answering the chosen engine's ip:port; 0 = a free port (docs/deploy.md) [env KVROUTE_EPP_PORT; "
        "default: off]",
    )
    g.add_argument(
        "--epp-fallbacks",
        type=int,
        default=_env_int("KVROUTE_EPP_FALLBACKS") or 0,
        metavar="N",
        help="endpoint picker: follow the chosen endpoint with up to N next-best candidates in "
        "x-gateway-destination-endpoint (comma-separated, for gateways that retry down the list: Envoy's "
        "override_host policy; an original-destination cluster refuses a list) [env KVROUTE_EPP_FALLBACKS; "
        "default 0]",
    )
    g.add_argument(
        "--epp-conformance-hooks",
        action="store_true",
        default=_env_flag("KVROUTE_EPP_CONFORMANCE_HOOKS"),
        help="endpoint picker: the Inference Extension conformance suite's hooks (the test-epp-endpoint-selection "
        "header restricts the candidates to the endpoints it names; the served endpoint is echoed in "
        "x-conformance-test-served-endpoint). Any client could steer its requests within the pool: for "
        "conformance runs only [env KVROUTE_EPP_CONFORMANCE_HOOKS; default off]",
    )
    g.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="SPEC",
        help="a worker: its URL (http://gpu1:8001: the id is derived from the URL, the rest read from the engine), "
        "or id=1,url=http://127.0.0.1:8001[,dp_size=2][,dp_start=0][,kv_events_endpoint=tcp://127.0.0.1:5557]"
        "[,replay_endpoint=tcp://127.0.0.1:5567][,model=NAME][,model_path=DIR][,block_size=N][,num_gpu_blocks=N]"
        "[,max_num_batched_tokens=N][,role=prefill|decode|both][,engine=vllm|sglang] (repeatable; rank r uses the "
        "endpoints' port + r; role=prefill workers only take the prefill phase of disaggregated requests; "
        "engine overrides the detected engine, which sets the sign of the forwarded priority)",
    )
    g.add_argument(
        "--workers-file",
        default=os.environ.get("KVROUTE_WORKERS_FILE"),
        metavar="FILE",
        help='JSON or YAML {"workers": ["http://gpu1:8001", {"id": 1, "url": ...}], '
        '"models": {"name": {"model_path": DIR}}}; re-read when it changes [env KVROUTE_WORKERS_FILE]',
    )
    g.add_argument(
        "--model-path",
        default=os.environ.get("KVROUTE_MODEL_PATH"),
        help="local HF tokenizer directory for every model; one that does not load is a start-up error "
        "[env KVROUTE_MODEL_PATH; default: the built-in offline tokenizer]",
    )
    g.add_argument(
        "--log-loop-stalls",
        type=float,
        default=os.environ.get("KVROUTE_LOG_LOOP_STALLS_MS", "0"),  # a string default goes through type=float
        metavar="MS",
        help="log where the event loop was whenever a callback due on it waited MS milliseconds or more "
        "(what every request on the process waited for); 0 = off [env KVROUTE_LOG_LOOP_STALLS_MS; default 0]",
    )
    g.add_argument(
        "--switch-interval-ms",
        type=float,
        default=os.environ.get("KVROUTE_SWITCH_INTERVAL_MS", str(LOOP_SWITCH_INTERVAL_MS)),
        metavar="MS",
        help="the GIL switch interval: how long the event loop waits for the GIL while a tokenizer thread runs "
        "Python code (a long prompt's hashes); CPython's default is 5 "
        f"[env KVROUTE_SWITCH_INTERVAL_MS; default {LOOP_SWITCH_INTERVAL_MS}]",
    )
    g.add_argument(
        "--mm-model-id",
        default=os.environ.get("KVROUTE_MM_MODEL_ID"),
        metavar="ID",
        help="the model id vLLM hashes images with (the path or name its engines were started with) "
        "[env KVROUTE_MM_MODEL_ID; default: the engines' root in /v1/models]",
    )
    g.add_argument(
        "--mm-hash-algorithm",
        choices=HASH_ALGORITHMS,
        default=os.environ.get("KVROUTE_MM_HASH_ALGORITHM", "blake3"),
        help="the engines' --mm-hasher-algorithm [env KVROUTE_MM_HASH_ALGORITHM; default blake3]",
    )
    g.add_argument(
        "--mm-max-image-bytes",
        type=int,
        default=_env_int("KVROUTE_MM_MAX_IMAGE_BYTES") or DEFAULT_MAX_IMAGE_BYTES,
        metavar="N",
        help="a larger image (data URL or fetched) is refused with 400 "
        f"[env KVROUTE_MM_MAX_IMAGE_BYTES; default {DEFAULT_MAX_IMAGE_BYTES}]",
    )
    g.add_argument(
        "--mm-fetch-timeout",
        type=float,
        default=float(os.environ.get("KVROUTE_MM_FETCH_TIMEOUT", "10")),
        metavar="SECONDS",
        help="an http(s) image not fetched in this time is refused with 400 [env KVROUTE_MM_FETCH_TIMEOUT; default 10]",
    )
    g.add_argument(
        "--mm-allowed-media-domains",
        nargs="+",
        default=os.environ.get("KVROUTE_MM_ALLOWED_MEDIA_DOMAINS", ""),
        metavar="DOMAIN",
        help="fetch image URLs only from these hosts (space- or comma-separated): example.com allows it and its "
        "subdomains, .example.com only its subdomains, an IP address only itself; the address checks still apply "
        "[env KVROUTE_MM_ALLOWED_MEDIA_DOMAINS; default: any host with public addresses]",
    )
    g.add_argument(
        "--mm-allow-private-media-hosts",
        action="store_true",
        default=_truthy_env("KVROUTE_MM_ALLOW_PRIVATE_MEDIA_HOSTS"),
        help="let image URLs reach loopback, private (RFC 1918, fc00::/7) and shared (100.64.0.0/10) addresses, for "
        "an internal media origin; link-local, cloud metadata, multicast, unspecified and reserved addresses stay "
        "refused [env KVROUTE_MM_ALLOW_PRIVATE_MEDIA_HOSTS; default: refused]",
    )
    g.add_argument(
        "--mm-max-images-per-request",
        type=int,
        default=_env_int("KVROUTE_MM_MAX_IMAGES_PER_REQUEST") or DEFAULT_MAX_IMAGES,
        metavar="N",
        help="a request with more image parts is refused with 400 before any is fetched "
        f"[env KVROUTE_MM_MAX_IMAGES_PER_REQUEST; default {DEFAULT_MAX_IMAGES}]",
    )
    g.add_argument(
        "--mm-max-fetch-bytes-per-request",
        type=int,
        default=_env_int("KVROUTE_MM_MAX_FETCH_BYTES_PER_REQUEST") or DEFAULT_MAX_FETCH_BYTES,
        metavar="N",
        help="a request whose image URLs bring more bytes than this in all is refused with 400 (cached images "
        f"are not fetched again) [env KVROUTE_MM_MAX_FETCH_BYTES_PER_REQUEST; default {DEFAULT_MAX_FETCH_BYTES}]",
    )
    g.add_argument(
        "--tokenizer-offload-chars",
        type=int,
        default=_env_int("DYN_TOKENIZER_OFFLOAD_CHARS"),
        metavar="N",
        help="a prompt with more than N characters of text the tokenizer's caches do not hold (a chat-shaped "
        "request's rendered prompt; past 4N characters its whole text) is tokenized on a worker thread, never "
        "blocking the event loop; 0 = always inline [env DYN_TOKENIZER_OFFLOAD_CHARS; default 4096]",
    )
    g.add_argument(
        "--send-token-ids",
        nargs="?",
        const="always",
        choices=SEND_IDS_MODES,
        default=_send_ids_mode(os.environ.get("KVROUTE_SEND_TOKEN_IDS", "")),
        help="send a /v1/completions text prompt to the engine as the token ids the router computed for it, so the "
        "engine does not tokenize it again: auto = to each worker whose engine turned a probe text into the router's "
        "ids when it joined (its render route or /tokenize; until then, and where it did not, the text goes); "
        "always (the flag alone) = to every worker (their engines must use the frontend's tokenizer); never. Requests "
        "with echo, prompt_logprobs, suffix, add_special_tokens or a speculative prefill, and disaggregated requests "
        "keep their text "
        "[env KVROUTE_SEND_TOKEN_IDS: auto, always (or 1), never (or 0); default auto]",
    )
    sample_every = _env_int("KVROUTE_PARITY_SAMPLE_EVERY")
    g.add_argument(
        "--parity-sample-every",
        type=int,
        default=8 if sample_every is None else sample_every,
        metavar="N",
        help="after the first 64 requests, one request in N collects the engine's usage for the hash-parity alarm "
        "and the hit-rate decomposition (a stream's usage asked of the engine, and stripped when the client did not "
        "ask for it); the others are relayed untouched; 1 = every request "
        "[env KVROUTE_PARITY_SAMPLE_EVERY; default 8]",
    )
    g.add_argument(
        "--use-remote-indexer",
        default=os.environ.get("DYN_USE_REMOTE_INDEXER", ""),
        metavar="URL[,URL...]",
        help="route on overlaps from these indexers (http:// URLs of python -m indexer, or of frontends with "
        "--serve-indexer; several URLs = shards partitioned by worker) instead of ingesting KV events here; a "
        "shard that does not answer makes that decision load-only [env DYN_USE_REMOTE_INDEXER]",
    )
    g.add_argument(
        "--remote-indexer-timeout",
        type=float,
        default=0.25,
        metavar="SECONDS",
        help="how long a decision waits for the slowest remote indexer [default 0.25]",
    )
    g.add_argument(
        "--remote-indexer-register",
        action="store_true",
        help="register every discovered worker (its KV-event endpoints) on remote indexer shard worker_id %% "
        "shards, re-asserted every few seconds: the frontends assign the shards their workers",
    )
    g.add_argument(
        "--serve-indexer",
        action="store_true",
        default=_truthy_env("DYN_SERVE_INDEXER"),
        help="serve this frontend's embedded index to others with the standalone indexer's query API "
        "(POST /query, /query_by_hash) [env DYN_SERVE_INDEXER]",
    )
    g.add_argument(
        "--health-check-interval", type=float, default=2.0, help="seconds between worker health checks [default 2]"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds to wait for a worker's response (streaming: its headers) before answering 504 [default: no "
        "limit]",
    )
    g.add_argument(
        "--replica-sync-bind",
        default=os.environ.get("KVROUTE_REPLICA_SYNC_BIND"),
        metavar="ENDPOINT",
        help="--router-replica-sync transport: ZMQ PUB endpoint to bind (e.g. tcp://*:8092); other replicas list it "
        "as a peer [env KVROUTE_REPLICA_SYNC_BIND]",
    )
    g.add_argument(
        "--replica-sync-advertise",
        default=None,
        metavar="ENDPOINT",
        help="externally reachable form of the bind endpoint",
    )
    g.add_argument(
        "--replica-sync-peers",
        default=os.environ.get("KVROUTE_REPLICA_SYNC_PEERS", ""),
        metavar="LIST",
        help="comma-separated PUB endpoints of the other frontend replicas (also POST /register_peer at runtime) "
        "[env KVROUTE_REPLICA_SYNC_PEERS]",
    )
    g.add_argument(
        "--workers",
        type=_processes,
        default=_processes(os.environ.get("DYN_FRONTEND_WORKERS", "1")),
        metavar="N",
        help="frontend processes behind the one port (SO_REUSEPORT), sharing active load through replica sync "
        "on private ipc:// sockets; a supervisor restarts them and forwards SIGTERM/SIGINT "
        "(frontend/supervisor.py) [env DYN_FRONTEND_WORKERS; default 1]",
    )
    g.add_argument(
        "--log-level",
        default=os.environ.get("DYN_LOG", "info"),
        help="debug shows one cost line per candidate per decision [env DYN_LOG; default info]",
    )
    add_drain_arg(g)
    add_security_args(
        p
    )  # --api-key: /v1/*; --admin-token: /admin/*, POST /busy_threshold, tracker routes (frontend/api/access.py)
    from frontend.observability.tracing import add_tracing_args
    from frontend.routing.rate_limits import add_rate_limit_args

    add_rate_limit_args(p)
    add_tracing_args(p)
    add_router_args(p)
    from frontend.pool.discovery import add_discovery_args

    add_discovery_args(p)
    return p


def check_epp_installed() -> None:
    """Fail fast: ``--epp-port`` without the ``epp`` extra is an exit with the install line, not a
    traceback from the server's start-up."""
    import importlib.util

    missing = [m for m in ("grpc", "grpc_health", "envoy.service") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"--epp-port needs the endpoint picker's packages ({', '.join(missing)} missing): "
            "pip install 'kvroute[epp]' (grpcio, grpcio-health-checking, xds-protos)"
        )


def check_model_path(path: str | None) -> None:
    """Fail fast: a ``--model-path`` that does not load is an exit with the reason, not a frontend
    that starts and answers 404 later. Loading here also warms the tokenizer cache."""
    if not path:
        return
    from kvroute_common.tokenizer import load_tokenizer

    if not os.path.isdir(path) and (os.path.exists(path) or path.startswith((".", "/", "~"))):
        raise SystemExit(f"--model-path {path!r}: not a directory (expected a local Hugging Face tokenizer directory)")
    try:
        load_tokenizer(path)
    except Exception as exc:  # OSError, ValueError, PromptError from transformers / tokenizers
        raise SystemExit(
            f"--model-path {path!r}: cannot load a tokenizer from it: {type(exc).__name__}: {exc}"
        ) from None


def _import_before_serving(state) -> None:
    """Modules the first worker's attachment (30-45 ms each) and the first request (anyio's asyncio
    backend, 13 ms: starlette's first request) would import on the event loop."""
    import importlib

    modules = ["h11", "httpcore._async.http11", "httpcore._sync.http11"]  # the control-plane client's
    modules.append("anyio._backends._asyncio")
    if state.remote_index is None and state.config.kv_aware and state.config.uses_indexer:
        modules.append("indexer.registry")  # the embedded index and its KV-event listeners
    for name in modules:
        importlib.import_module(name)


def startup_line(url: str, state) -> str:
    """The one line that says the frontend is up and how it is configured."""
    cfg = state.config
    workers = sorted(state.pool.workers.values(), key=lambda w: w.id)
    wdesc = ", ".join(f"{w.id}={w.spec.url}" for w in workers) or "none yet"
    if state.file_watcher is not None:
        wdesc += f" (+ {state.file_watcher.path})"
    tok = state.model_path or "built-in offline tokenizer (kvroute-demo; give --model-path for real engines)"
    return f"kvroute frontend listening on {url} | router mode {cfg.router_mode} | workers: {wdesc} | tokenizer: {tok}"


def _processes(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers must be an integer, got {value!r}") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"--workers must be between 1 and 64, got {n}")
    return n


def make_state(ns: argparse.Namespace):
    from frontend.pool.discovery import build_backends, replica_advertise
    from frontend.pool.workers import parse_worker_arg
    from frontend.state import FrontendState

    check_model_path(ns.model_path)
    config = RouterConfig.from_args(ns)
    for dest, flag in _NOT_YET.items():
        if getattr(config, dest, None) not in (None, False):
            log.warning("%s is accepted but not implemented yet in this frontend: it has no effect", flag)
    for dest, why in JETSTREAM_FLAGS.items():
        if getattr(config, dest) != getattr(RouterConfig(), dest):
            log.warning("%s", why)
    if config.router_event_threads > 1:
        log.warning(
            "--router-event-threads %s has no effect: KV events are decoded and applied on the asyncio loop in one "
            "thread (Python's GIL would serialise index updates from a thread pool); TTL and pruning stay on",
            config.router_event_threads,
        )
    if not config.kv_aware and not config.router_kv_events:
        log.info("--no-router-kv-events only matters with --router-mode kv or latency")
    if ns.tokenizer_offload_chars is not None and ns.tokenizer_offload_chars < 0:
        raise SystemExit("--tokenizer-offload-chars must be >= 0 (0 = tokenize every prompt inline)")
    if ns.epp_fallbacks < 0:
        raise SystemExit("--epp-fallbacks must be >= 0 (0 = the chosen endpoint alone)")
    state = FrontendState(
        config,
        model_path=ns.model_path,
        health_interval=ns.health_check_interval,
        request_timeout=ns.request_timeout,
        tokenize_offload_chars=ns.tokenizer_offload_chars,
        image_options=ImageOptions(ns.mm_model_id, ns.mm_hash_algorithm, ns.mm_max_image_bytes, ns.mm_fetch_timeout),
        media_policy=media_policy_from_args(ns),
    )
    remote = [u.strip() for u in ns.use_remote_indexer.split(",") if u.strip()]
    if remote:
        if not config.kv_aware:
            raise SystemExit("--use-remote-indexer needs --router-mode kv or latency")
        if ns.serve_indexer:
            raise SystemExit("--serve-indexer serves an embedded index; with --use-remote-indexer there is none")
        if ns.remote_indexer_timeout <= 0:
            raise SystemExit("--remote-indexer-timeout must be > 0")
        from frontend.api.access import access_level
        from frontend.routing.remote_index import RemoteIndexers
        from kvroute_common.security import outgoing_token, policy_from_args

        token = outgoing_token(policy_from_args(ns, access_level), ns)
        try:
            state.remote_index = RemoteIndexers(
                remote, state.metrics.registry, ns.remote_indexer_timeout, ns.remote_indexer_register, token
            )
        except ValueError as exc:
            raise SystemExit(f"--use-remote-indexer: {exc}") from None
    elif ns.remote_indexer_register:
        raise SystemExit("--remote-indexer-register needs --use-remote-indexer")
    state.serve_indexer = ns.serve_indexer
    state.send_token_ids = ns.send_token_ids
    if ns.parity_sample_every < 1:
        raise SystemExit("--parity-sample-every must be >= 1")
    state.parity.sample_every = ns.parity_sample_every
    state.rate_limits = _rate_limits(ns, state)
    from frontend.observability.tracing import tracing_from_args

    state.tracing = tracing_from_args(ns)
    if ns.log_loop_stalls < 0:
        raise SystemExit("--log-loop-stalls must be >= 0 (0 = off)")
    state.loop_stall_threshold = ns.log_loop_stalls / 1000
    if ns.switch_interval_ms <= 0:
        raise SystemExit("--switch-interval-ms must be > 0")
    if config.router_replica_sync or ns.replica_sync_bind:
        if not ns.replica_sync_bind:
            raise SystemExit(
                "--router-replica-sync needs --replica-sync-bind (replicas share active load over ZMQ, not NATS)"
            )
        from slot_tracker.replica_sync import ReplicaSync

        peers = [p.strip() for p in ns.replica_sync_peers.split(",") if p.strip()]
        from frontend.supervisor import child_index

        # the --workers N siblings: private endpoints, so events may travel in batches (cheaper per request)
        batch = child_index() is not None
        state.replica_sync = ReplicaSync(
            state.slots, ns.replica_sync_bind, ns.replica_sync_advertise, peers, batch=batch
        )
    specs = []
    for text in ns.worker:
        try:
            specs.append(parse_worker_arg(text))
        except ValueError as exc:
            raise SystemExit(f"--worker {text!r}: {exc}") from None
    # peers through discovery: the endpoint this replica advertises to the others
    replica_endpoint = (
        replica_advertise(ns.replica_sync_bind, ns.replica_sync_advertise) if state.replica_sync is not None else None
    )
    try:
        state.discovery = build_backends(ns, specs, replica_endpoint)
        for backend in state.discovery:
            backend.prepare()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    for backend in state.discovery:
        watcher = getattr(backend, "watcher", None)
        if watcher is not None:  # the file backend: GET /admin/workers shows its state
            state.file_watcher = watcher
    return state


def _rate_limits(ns: argparse.Namespace, state):
    """--rate-limit-*: the per-key buckets; keys are told apart only when --api-key is set."""
    from frontend.api.access import access_level
    from frontend.routing.rate_limits import rate_limits_from_args
    from kvroute_common.security import policy_from_args

    policy = policy_from_args(ns, access_level)
    digests = (*policy.api_keys.digests, *policy.admin_tokens.digests) if policy and policy.api_keys else ()
    return rate_limits_from_args(ns, digests, state.metrics.registry)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from frontend import demo

        return demo.main(argv[1:]) or 0
    if argv and argv[0] == "register":
        from frontend.pool.discovery import register

        return register.main(argv[1:]) or 0
    if argv and argv[0] == "flags":
        from frontend import flag_reference

        return flag_reference.main(argv[1:], build_parser)
    ns = build_parser().parse_args(argv)
    bound_encoder_threads()  # before any encode (--workers N: the children inherit it)
    from frontend.supervisor import ENV_REUSE_PORT, child_index, reuse_port_socket, supervise

    index = child_index()
    tag = f"[p{index}] " if index is not None else ""
    logging.basicConfig(level=ns.log_level.upper(), format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
    if ns.workers > 1 and index is None:  # --workers N: this process only supervises N frontends
        if ns.replica_sync_bind or ns.replica_sync_peers.strip():
            raise SystemExit(
                "--workers N > 1 shares load among its own processes (private replica-sync endpoints): "
                "drop --replica-sync-bind / --replica-sync-peers (replica sync with other hosts and --workers is not "
                "supported yet)"
            )
        return supervise(argv, ns.workers, ns.http_host, ns.http_port, ns.drain_timeout, [])
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from kvroute_common.drain import Drain, DrainingServer
    from kvroute_common.security import ssl_options

    tls = ssl_options(ns)
    drain = Drain(ns.drain_timeout)
    state = make_state(ns)
    state.busy_probes.append(lambda: drain.inflight > 0)
    import uvicorn

    from frontend.api.access import guard_app
    from frontend.app import FrontendHttpProtocol, build_app

    epp = (ns.http_host, ns.epp_port) if ns.epp_port is not None else None
    if epp is not None:
        check_epp_installed()
    app = guard_app(
        build_app(state, epp, epp_fallbacks=ns.epp_fallbacks, epp_conformance_hooks=ns.epp_conformance_hooks),
        ns,
        drain,
    )
    config = uvicorn.Config(
        app,
        host=ns.http_host,
        port=ns.http_port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http=FrontendHttpProtocol,
        lifespan="on",
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
        server_header=False,
        proxy_headers=False,
        **tls,
    )
    scheme = "https" if tls else "http"
    scheme_host = ns.http_host if ns.http_host not in ("0.0.0.0", "::", "") else "127.0.0.1"

    class _Server(DrainingServer):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # bound and serving: say so once, whatever the log level
                print(startup_line(f"{scheme}://{scheme_host}:{ns.http_port}", state), flush=True)

    server = _Server(config, drain)  # SIGTERM: 503 on /health and new /v1 requests, streams finish, exit 0
    sockets = (
        [reuse_port_socket(ns.http_host, ns.http_port)] if os.environ.get(ENV_REUSE_PORT) else None
    )  # --workers N child
    _import_before_serving(state)
    state.tokenize.start()  # the tokenizer threads: started here, not by the first long prompts on the loop
    tune_gc()  # the embedded index and the tokenizers are large, long-lived heaps: rare full collections
    sys.setswitchinterval(ns.switch_interval_ms / 1000)  # the loop's wait for the GIL (tokenize_offload)
    server.run(sockets=sockets)
    return 0 if server.started else 1
