"""Indexer benchmark: ours (``python -m indexer``) against the reference (``python -m dynamo.indexer``).

One run measures, for each service in turn:
  * POST /query_by_hash with 64 hashes and POST /query with 1024 tokens (block size 16), driven by
    Debian ``wrk`` with a Lua script, over an index populated through real ZMQ events;
  * ZMQ ingest: blocks applied per second, from the first published batch until a final marker block
    is queryable (each service measured alone, with its own fresh partition and publisher);
  * memory: the service's RSS growth per million stored blocks during that ingest, and our KvIndex's
    own footprint per million blocks measured in-process.

    python bench/indexer_bench.py [--duration 10] [--connections 16] [--ingest-blocks 200000] [--rounds 3]
                                  [--shape default|branching|both|small-chain|small-suffix|small|all]

Shapes (``--shape``, see its help): ``default`` and ``branching`` (``both``), and the 4-worker
``small-chain`` / ``small-suffix`` (``small``): many short shared system prompts, the first with
every event carrying the whole chain, the second only the blocks below a cached prompt.

Services are measured alternately, round after round, and medians are reported (the machine is
shared, load drifts).

Needs ``wrk`` (apt-get install wrk) and ai-dynamo-runtime (the reference).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack

import httpx
import zmq

from indexer.wire import BlockStored, encode_batch, seq_frame  # noqa: E402
from kvroute_common.hashing import list_to_i64, local_block_hashes, sequence_hashes  # noqa: E402
from kvroute_common.ports import free_port, free_ports
from kvroute_common.processes import service, wait_until

BS = 16
MODEL = "bench"


def toks_for(prompt_id: int, n_blocks: int, shared: int = 0) -> list[int]:
    """Deterministic tokens: the first ``shared`` blocks common to every prompt, the rest unique."""
    rng = random.Random(prompt_id)
    common = random.Random(0)
    head = [common.randrange(1, 50000) for _ in range(shared * BS)]
    return head + [rng.randrange(1, 50000) for _ in range((n_blocks - shared) * BS)]


def ext_hashes(tokens: list[int]) -> list[int]:
    """Content-derived external hashes (like seeded vLLM engines)."""
    return [(h ^ 0x5DEECE66D) & ((1 << 64) - 1) for h in sequence_hashes(local_block_hashes(tokens, BS))]


class Publisher:
    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the subscriber's pace is what we measure
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send_payload(self, payload: bytes) -> None:
        self.sock.send_multipart([b"", seq_frame(self.seq), payload])
        self.seq += 1

    def store_chain(self, tokens: list[int], chunk: int = 32, dp: int = 0) -> list[bytes]:
        """Payloads storing ``tokens`` in chunks of ``chunk`` blocks, each below the previous one."""
        exts = ext_hashes(tokens)
        out = []
        for start in range(0, len(exts), chunk):
            parent = exts[start - 1] if start else None
            ev = BlockStored(
                exts[start : start + chunk], parent, tokens[start * BS : (start + chunk) * BS], BS, None, None, None
            )
            out.append(encode_batch([ev], dp))
        return out

    def store_suffix(self, tokens: list[int], start: int, chunk: int = 32, dp: int = 0) -> list[bytes]:
        """Payloads storing blocks ``start``.. of ``tokens`` below block ``start - 1`` (a cached prefix)."""
        exts = ext_hashes(tokens)
        out = []
        for s in range(start, len(exts), chunk):
            ev = BlockStored(
                exts[s : s + chunk], exts[s - 1] if s else None, tokens[s * BS : (s + chunk) * BS], BS, None, None, None
            )
            out.append(encode_batch([ev], dp))
        return out


# ---- the branching-prefix shape: many workers, different continuations of a few shared system prompts
BRANCH_MODEL = "bench-branch"
BRANCH_SYSTEMS = 4  # shared system prompts
BRANCH_SYSTEM_BLOCKS = 32  # 512 tokens each
BRANCH_FIRST_INSTANCE = 1001  # instance ids are global: not the default shape's 1-4
BRANCH_CONT_BLOCKS = 32  # each request's own continuation (one event, parent = the system prompt's last block)


def branch_tokens(system: int, cont_id: int) -> list[int]:
    """System prompt ``system`` (shared by every worker) followed by a continuation of its own."""
    return toks_for(7 * 10**6 + system, BRANCH_SYSTEM_BLOCKS) + toks_for(8 * 10**6 + cont_id, BRANCH_CONT_BLOCKS)


def branch_payloads(pub: Publisher, worker: int, n_conts: int, first_cont: int) -> list[bytes]:
    """One worker's events, as an engine publishes them: its first request on each system prompt stores
    the whole prompt (parent None: the shared blocks and its own continuation in 32-block events); every
    later request stores only its continuation, below the cached system prompt's last block."""
    out = []
    for k in range(n_conts):
        cont = first_cont + k
        tokens = branch_tokens(cont % BRANCH_SYSTEMS, cont)
        out.extend(pub.store_chain(tokens) if k < BRANCH_SYSTEMS else pub.store_suffix(tokens, BRANCH_SYSTEM_BLOCKS))
    return out


def connect_publishers(ctx: zmq.Context, urls: list[str], n: int, model: str, first_instance: int) -> list[Publisher]:
    pubs = [Publisher(ctx, p) for p in free_ports(n)]
    for url in urls:
        for i, pub in enumerate(pubs):
            r = httpx.post(
                f"{url}/register",
                json={
                    "instance_id": first_instance + i,
                    "endpoint": pub.endpoint,
                    "model_name": model,
                    "block_size": BS,
                },
            )
            assert r.status_code == 201, r.text
    hello = toks_for(9 * 10**6 + first_instance, 1)
    for i, pub in enumerate(pubs):
        wait_until(
            functools.partial(_resend_until, pub, hello, urls, first_instance + i, model),
            timeout=60,
            interval=0.1,
            what="publishers connected",
        )
    return pubs


def send_interleaved(pubs: list[Publisher], per_pub: list[list[bytes]]) -> None:
    """Round-robin over the publishers, as concurrent engines would publish."""
    longest = max(len(p) for p in per_pub)
    for j in range(longest):
        for pub, payloads in zip(pubs, per_pub, strict=True):
            if j < len(payloads):
                pub.send_payload(payloads[j])


def timed_interleaved_ingest(
    pubs: list[Publisher], per_pub: list[list[bytes]], url: str, pid: int, final: list[int], base: int, model: str
) -> tuple[float, int, int]:
    """Send every publisher's payloads interleaved (each list ending with the ``final`` marker) and wait
    until each publisher's marker is queryable: (seconds, RSS KiB before, RSS KiB after)."""
    for pub, payloads in zip(pubs, per_pub, strict=True):
        payloads.extend(pub.store_chain(final))
    gc.collect()
    rss0 = rss_kib(pid)
    t0 = time.perf_counter()
    send_interleaved(pubs, per_pub)
    for i in range(len(pubs)):
        wait_until(
            functools.partial(marker_seen, url, final, base + i, model),
            timeout=600,
            interval=0.005,
            what=f"{model} ingest marker",
        )
    elapsed = time.perf_counter() - t0
    return elapsed, rss0, rss_kib(pid)


def populate_branching(ctx: zmq.Context, urls: list[str], n_workers: int = 32, conts_per_worker: int = 50) -> list[int]:
    """32 workers each hold the 4 system prompts and 50 continuations; returns the 1024-token query:
    system prompt 0 + a continuation one worker holds (every worker matches 32 blocks, one 64)."""
    pubs = connect_publishers(ctx, urls, n_workers, BRANCH_MODEL, BRANCH_FIRST_INSTANCE)
    send_interleaved(pubs, [branch_payloads(pub, i, conts_per_worker, 1000 * (i + 1)) for i, pub in enumerate(pubs)])
    final = toks_for(9 * 10**6 + 999, 1)
    for pub in pubs:
        for p in pub.store_chain(final):
            pub.send_payload(p)
    for i in range(n_workers):
        wait_until(
            functools.partial(_seen_everywhere, urls, final, BRANCH_FIRST_INSTANCE + i, BRANCH_MODEL),
            timeout=120,
            what="branching population applied",
        )
    for pub in pubs:
        pub.sock.close(linger=0)
    return branch_tokens(0, 1000 * 3 + 4)  # worker 3's 5th continuation: 4 % 4 == 0 -> system prompt 0


def ingest_branching(
    ctx: zmq.Context, url: str, pid: int, n_blocks: int, instance: int, n_workers: int = 16
) -> tuple[float, float, int]:
    """(blocks/s, RSS KiB per million blocks, blocks): ``n_workers`` publishers, continuations of 32
    blocks extending 4 shared system prompts, sent interleaved; until every worker's marker is queryable."""
    model = f"ingest-branch-{instance}"
    base = instance * 100
    pubs = connect_publishers(ctx, [url], n_workers, model, base)
    per_worker = max(
        BRANCH_SYSTEMS, (n_blocks // n_workers - BRANCH_SYSTEMS * BRANCH_SYSTEM_BLOCKS) // BRANCH_CONT_BLOCKS
    )
    per_pub = [branch_payloads(pub, i, per_worker, 10**5 * (instance % 50) + 1000 * i) for i, pub in enumerate(pubs)]
    final = toks_for(6 * 10**6 + instance, 1)
    total = n_workers * (BRANCH_SYSTEMS * BRANCH_SYSTEM_BLOCKS + per_worker * BRANCH_CONT_BLOCKS + 1)
    elapsed, rss0, rss1 = timed_interleaved_ingest(pubs, per_pub, url, pid, final, base, model)
    last = branch_tokens(
        (per_worker - 1) % BRANCH_SYSTEMS, 10**5 * (instance % 50) + 1000 * (n_workers - 1) + per_worker - 1
    )
    got = query(url, last, model)["scores"].get(str(base + n_workers - 1), {}).get("0")
    assert got == len(last), f"branching ingest lost blocks: {got}"
    for pub in pubs:
        pub.sock.close(linger=0)
    return total / elapsed, (rss1 - rss0) / total * 1e6, total


# ---- the small-cluster shapes: 4 workers, many short shared system prompts, short requests
SMALL_WORKERS = 4
SMALL_SYSTEMS = 64  # shared system prompts
SMALL_SYSTEM_BLOCKS = 4  # 64 tokens each
SMALL_CONT_BLOCKS = 12  # each request's own blocks after its system prompt
SMALL_FIRST_INSTANCE = 2001  # instance ids are global: not the other shapes' ones
SMALL_STYLES = ("small-chain", "small-suffix")


def small_tokens(system: int, cont_id: int) -> list[int]:
    """System prompt ``system`` (shared by every worker) followed by a 12-block request of its own."""
    return toks_for(13 * 10**6 + system, SMALL_SYSTEM_BLOCKS) + toks_for(14 * 10**6 + cont_id, SMALL_CONT_BLOCKS)


def small_payloads(pub: Publisher, style: str, n_reqs: int, first_cont: int) -> list[bytes]:
    """One worker's events, one 16-block request each on system prompt ``request % 64``.

    small-chain: every event carries the whole chain (parent None, 16 blocks), as engines that do
    not link to cached blocks publish. small-suffix: the worker's first request on a system prompt
    stores the whole chain, every later one only its 12 new blocks below the prompt's last block."""
    out = []
    for k in range(n_reqs):
        cont = first_cont + k
        tokens = small_tokens(cont % SMALL_SYSTEMS, cont)
        if style == "small-chain" or k < SMALL_SYSTEMS:
            out.extend(pub.store_chain(tokens))
        else:
            out.extend(pub.store_suffix(tokens, SMALL_SYSTEM_BLOCKS))
    return out


def small_blocks(style: str, n_reqs: int) -> int:
    """Blocks one worker's ``small_payloads`` carry (what the services apply)."""
    per_req = SMALL_SYSTEM_BLOCKS + SMALL_CONT_BLOCKS
    if style == "small-chain":
        return n_reqs * per_req
    chains = min(n_reqs, SMALL_SYSTEMS)
    return chains * per_req + (n_reqs - chains) * SMALL_CONT_BLOCKS


def small_model(style: str) -> str:
    return f"bench-{style}"


def small_query(first_cont: int, k: int) -> list[int]:
    """1024 tokens: worker request ``first_cont + k`` (its system prompt and 12 blocks) followed by 48
    blocks nobody holds, as a new turn of that conversation."""
    cont = first_cont + k
    tokens = small_tokens(cont % SMALL_SYSTEMS, cont) + toks_for(15 * 10**6 + cont, 48)
    assert len(tokens) == 1024
    return tokens


def populate_small(ctx: zmq.Context, urls: list[str], style: str, reqs_per_worker: int = 500) -> list[int]:
    """4 workers each hold the 64 system prompts and ``reqs_per_worker`` requests; returns the 1024-token
    query: worker 2's 70th request + 48 new blocks (every worker matches 4 blocks, one 16)."""
    model = small_model(style)
    first = SMALL_FIRST_INSTANCE + (0 if style == "small-chain" else 100)
    pubs = connect_publishers(ctx, urls, SMALL_WORKERS, model, first)
    send_interleaved(pubs, [small_payloads(pub, style, reqs_per_worker, 10**4 * (i + 1)) for i, pub in enumerate(pubs)])
    final = toks_for(16 * 10**6 + first, 1)
    for pub in pubs:
        for p in pub.store_chain(final):
            pub.send_payload(p)
    for i in range(SMALL_WORKERS):
        wait_until(
            functools.partial(_seen_everywhere, urls, final, first + i, model),
            timeout=120,
            what=f"{style} population applied",
        )
    for pub in pubs:
        pub.sock.close(linger=0)
    return small_query(10**4 * 3, 69)


def ingest_small(
    ctx: zmq.Context, url: str, pid: int, n_blocks: int, instance: int, style: str
) -> tuple[float, float, int]:
    """(blocks/s, RSS KiB per million blocks, blocks): 4 publishers sending ``style`` events interleaved,
    until every publisher's marker is queryable. Blocks are those the events carry (a small-chain
    event's 4 system-prompt blocks count: the service applies them again)."""
    model = f"ingest-{style}-{instance}"
    base = instance * 100 + (20 if style == "small-chain" else 40)  # clear of ingest_branching's ids
    pubs = connect_publishers(ctx, [url], SMALL_WORKERS, model, base)
    per_req = SMALL_CONT_BLOCKS if style == "small-suffix" else SMALL_SYSTEM_BLOCKS + SMALL_CONT_BLOCKS
    n_reqs = max(SMALL_SYSTEMS, n_blocks // SMALL_WORKERS // per_req)
    firsts = [10**5 * (instance % 50) + 10**4 * i for i in range(SMALL_WORKERS)]
    per_pub = [small_payloads(pub, style, n_reqs, firsts[i]) for i, pub in enumerate(pubs)]
    final = toks_for(17 * 10**6 + base, 1)
    total = SMALL_WORKERS * (small_blocks(style, n_reqs) + 1)
    elapsed, rss0, rss1 = timed_interleaved_ingest(pubs, per_pub, url, pid, final, base, model)
    last = small_query(firsts[-1], n_reqs - 1)
    got = query(url, last, model)["scores"].get(str(base + SMALL_WORKERS - 1), {}).get("0")
    assert got == (SMALL_SYSTEM_BLOCKS + SMALL_CONT_BLOCKS) * BS, f"{style} ingest lost blocks: {got}"
    for pub in pubs:
        pub.sock.close(linger=0)
    return total / elapsed, (rss1 - rss0) / total * 1e6, total


def query(url: str, tokens: list[int], model: str = MODEL) -> dict:
    return httpx.post(f"{url}/query", json={"token_ids": tokens, "model_name": model}, timeout=30).json()


def _seen_everywhere(urls: list[str], marker: list[int], instance: int, model: str) -> bool:
    return all(marker_seen(u, marker, instance, model) for u in urls)


def _resend_until(pub: Publisher, marker: list[int], urls: list[str], instance: int, model: str) -> bool:
    """Publish the marker again and tell whether every indexer holds it (a SUB that joins late misses
    what was sent before: resend until it arrives)."""
    for p in pub.store_chain(marker):
        pub.send_payload(p)
    return _seen_everywhere(urls, marker, instance, model)


def marker_seen(url: str, marker: list[int], instance: int, model: str = MODEL) -> bool:
    return str(instance) in query(url, marker, model).get("scores", {})


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_pid(proc: subprocess.Popen) -> int:
    """The python process serving (the launcher may be a wrapper)."""
    return proc.pid


def run_wrk(url: str, path: str, body: dict, duration: int, connections: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\n')
        f.write('wrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(json.dumps(body))}\n")
        script = f.name
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "-s", script, f"{url}{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(script)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        raise RuntimeError(f"wrk saw errors on {path}: {out}")
    return float(m.group(1)) if m else 0.0


def populate(ctx: zmq.Context, urls: list[str], n_workers: int = 4, prompts_per_worker: int = 100) -> list[int]:
    """Register publishers on every service, store prompts with shared prefixes; returns the query prompt."""
    pubs = [Publisher(ctx, p) for p in free_ports(n_workers)]
    for url in urls:
        for i, pub in enumerate(pubs):
            r = httpx.post(
                f"{url}/register",
                json={"instance_id": i + 1, "endpoint": pub.endpoint, "model_name": MODEL, "block_size": BS},
            )
            assert r.status_code == 201, r.text
    marker = toks_for(10**6, 1)
    for i, pub in enumerate(pubs):
        wait_until(
            functools.partial(_resend_until, pub, marker, urls, i + 1, MODEL),
            timeout=30,
            interval=0.1,
            what="publishers connected",
        )
    hot = toks_for(1, 64, shared=16)
    for i, pub in enumerate(pubs):
        # every worker holds a different-length prefix of the hot prompt, plus its own prompts
        for p in pub.store_chain(hot[: BS * (16 + 12 * i)]):
            pub.send_payload(p)
        for k in range(prompts_per_worker):
            for p in pub.store_chain(toks_for(1000 * (i + 1) + k, 64, shared=16)):
                pub.send_payload(p)
    final = toks_for(10**6 + 1, 1)
    for pub in pubs:
        for p in pub.store_chain(final):
            pub.send_payload(p)
    for i in range(n_workers):
        wait_until(
            functools.partial(_seen_everywhere, urls, final, i + 1, MODEL), timeout=120, what="population applied"
        )
    for pub in pubs:
        pub.sock.close(linger=0)
    return hot


def ingest(ctx: zmq.Context, url: str, pid: int, n_blocks: int, instance: int) -> tuple[float, float, int]:
    """(blocks/s, RSS KiB per million blocks, blocks) for one service alone."""
    model = f"ingest-{instance}"
    pub = Publisher(ctx, free_port())
    r = httpx.post(
        f"{url}/register",
        json={"instance_id": instance, "endpoint": pub.endpoint, "model_name": model, "block_size": BS},
    )
    assert r.status_code == 201, r.text
    hello = toks_for(2 * 10**6, 1)
    wait_until(
        functools.partial(_resend_until, pub, hello, [url], instance, model),
        timeout=30,
        interval=0.1,
        what="ingest publisher connected",
    )
    payloads = []
    per_prompt = 128
    n_prompts = max(1, n_blocks // per_prompt)
    for k in range(n_prompts):
        payloads.extend(pub.store_chain(toks_for(5 * 10**6 + instance * 10**5 + k, per_prompt, shared=8)))
    final = toks_for(3 * 10**6 + instance, 1)
    payloads.extend(pub.store_chain(final))
    total = n_prompts * per_prompt + 1
    gc.collect()
    rss0 = rss_kib(pid)
    t0 = time.perf_counter()
    for p in payloads:
        pub.send_payload(p)
    wait_until(lambda: marker_seen(url, final, instance, model), timeout=600, interval=0.005, what="ingest marker")
    elapsed = time.perf_counter() - t0
    rss1 = rss_kib(pid)
    check = toks_for(5 * 10**6 + instance * 10**5 + n_prompts - 1, per_prompt, shared=8)
    got = query(url, check, model)["scores"].get(str(instance), {}).get("0")
    assert got == per_prompt * BS, f"ingest lost blocks: {got}"
    pub.sock.close(linger=0)
    return total / elapsed, (rss1 - rss0) / total * 1e6, total


def kvindex_memory(n_blocks: int = 1_000_000) -> float:
    """Bytes per stored block of our KvIndex (tracemalloc), 64-block prompts on 4 workers."""
    import tracemalloc

    from indexer.core import KvIndex

    ix = KvIndex(BS)
    prompts = n_blocks // 64
    rng = random.Random(7)
    data = []
    for k in range(prompts):
        base = k * 1000
        data.append([(base + j + 1, rng.getrandbits(64)) for j in range(64)])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k, blocks in enumerate(data):
        ix.apply_stored(k % 4 + 1, 0, None, blocks)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / (prompts * 64)


SHAPE_GROUPS = {
    "both": ["default", "branching"],
    "small": list(SMALL_STYLES),
    "all": ["default", "branching", *SMALL_STYLES],
}
SHAPE_PREFIX = {"default": "", "branching": "branch_", "small-chain": "small_chain_", "small-suffix": "small_suffix_"}
"""Metric name prefix per shape."""

IngestRun = Callable[[zmq.Context, str, int, int, int], tuple[float, float, int]]


def shape_model(shape: str) -> str:
    return {"default": MODEL, "branching": BRANCH_MODEL}.get(shape) or small_model(shape)


def shape_ingest(shape: str) -> IngestRun:
    """The ingest measurement of ``shape``: (ctx, url, pid, n_blocks, instance) -> (blocks/s, RSS, blocks)."""
    if shape == "default":
        return ingest
    if shape == "branching":
        return ingest_branching
    return functools.partial(ingest_small, style=shape)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=10, help="wrk seconds per endpoint and service")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--ingest-blocks", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per measurement (medians reported)")
    ap.add_argument("--reference-threads", type=int, default=None, help="pass --threads to the reference")
    ap.add_argument(
        "--shape",
        choices=["default", "branching", "both", *SMALL_STYLES, "small", "all"],
        default="both",
        help="default: 400 prompts with one short shared prefix (4 workers); branching: 32 workers caching "
        "different continuations of 4 shared system prompts (events extend shared prefixes); both: those two; "
        "small-chain / small-suffix: 4 workers, 64 system prompts of 4 blocks, 12 blocks per request, every "
        "event carrying the whole chain / only the request's blocks below the cached prompt; small: those two; "
        "all: the four [both]",
    )
    args = ap.parse_args()
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    ref_port, our_port = free_ports(2)
    ref_url, our_url = f"http://127.0.0.1:{ref_port}", f"http://127.0.0.1:{our_port}"
    ref_cmd = ["-m", "dynamo.indexer", "--port", str(ref_port)]
    if args.reference_threads:
        ref_cmd += ["--threads", str(args.reference_threads)]
    env = {"KVROUTE_TEST_QUIET": "1", "RUST_LOG": "error", "DYN_LOG": "error"}
    ctx = zmq.Context()
    results: dict[str, dict[str, float]] = {"reference": {}, "ours": {}}
    with ExitStack() as stack:
        ref = stack.enter_context(service(ref_cmd, ready_url=f"{ref_url}/health", env=env))
        ours = stack.enter_context(
            service(
                ["-m", "indexer", "--host", "127.0.0.1", "--port", str(our_port), "--log-level", "warning"],
                ready_url=f"{our_url}/health",
                env=env,
            )
        )
        shapes = SHAPE_GROUPS.get(args.shape, [args.shape])
        queries = []  # (metric prefix, path, body)
        for shape in shapes:
            model = shape_model(shape)
            if shape == "default":
                hot = populate(ctx, [ref_url, our_url])
            elif shape == "branching":
                hot = populate_branching(ctx, [ref_url, our_url])
            else:
                hot = populate_small(ctx, [ref_url, our_url], shape)
            local = local_block_hashes(hot, BS)
            assert query(ref_url, hot, model) == query(our_url, hot, model), f"services disagree on the {shape} query"
            assert len(local) == 64 and len(hot) == 1024
            prefix = SHAPE_PREFIX[shape]
            queries.append(
                (f"{prefix}query_by_hash", "/query_by_hash", {"block_hashes": list_to_i64(local), "model_name": model})
            )
            queries.append((f"{prefix}query", "/query", {"token_ids": hot, "model_name": model}))
        # Alternate the services round by round: the machine is shared, so load drifts between runs.
        # Per CPU-second figures (work done / CPU time the service process used) are much less
        # sensitive to other load than per wall-second ones: a busy machine starves our single
        # thread more than the reference's thread pool.
        samples: dict[str, dict[str, list[float]]] = {"reference": {}, "ours": {}}
        procs = {"reference": ref, "ours": ours}
        for _ in range(args.rounds):
            for name, url in (("reference", ref_url), ("ours", our_url)):
                pid = service_pid(procs[name])
                for metric, path, body in queries:
                    c0 = cpu_seconds(pid)
                    rps = run_wrk(url, path, body, args.duration, args.connections)
                    used = cpu_seconds(pid) - c0
                    samples[name].setdefault(f"{metric}_rps", []).append(rps)
                    samples[name].setdefault(f"{metric}_per_cpu_s", []).append(
                        rps * args.duration / used if used else 0.0
                    )
        for k in range(args.rounds):
            for shape in shapes:
                prefix, run = SHAPE_PREFIX[shape], shape_ingest(shape)
                for j, (name, url, proc) in enumerate((("reference", ref_url, ref), ("ours", our_url, ours))):
                    c0 = cpu_seconds(service_pid(proc))
                    rate, mem, blocks = run(ctx, url, service_pid(proc), args.ingest_blocks, 100 + 2 * k + j)
                    used = cpu_seconds(service_pid(proc)) - c0
                    samples[name].setdefault(f"{prefix}ingest_blocks_per_s", []).append(rate)
                    samples[name].setdefault(f"{prefix}ingest_blocks_per_cpu_s", []).append(
                        blocks / used if used else 0.0
                    )
                    samples[name].setdefault(f"{prefix}rss_mib_per_million_blocks", []).append(mem / 1024)
        for name in samples:
            for metric, values in samples[name].items():
                results[name][metric] = statistics.median(values)
        print("samples:", json.dumps(samples))
    ctx.term()
    mem = kvindex_memory()
    print(f"{'metric':28} {'reference':>11} {'ours':>11} {'ours/ref':>9} {'paired':>7}")
    per_shape = (
        "query_by_hash_rps",
        "query_by_hash_per_cpu_s",
        "query_rps",
        "query_per_cpu_s",
        "ingest_blocks_per_s",
        "ingest_blocks_per_cpu_s",
        "rss_mib_per_million_blocks",
    )
    prefixes = tuple(SHAPE_PREFIX.values())  # default, branching, small-chain, small-suffix
    for metric in [m for m in (prefix + name for prefix in prefixes for name in per_shape) if m in results["ours"]]:
        r, o = results["reference"][metric], results["ours"][metric]
        # each round measures the two services back to back: the median of those ratios cancels drift best
        paired = statistics.median(
            b / a for a, b in zip(samples["reference"][metric], samples["ours"][metric], strict=True) if a
        )
        results["ours"][f"{metric}_paired_ratio"] = paired
        print(f"{metric:28} {r:11.1f} {o:11.1f} {o / r if r else float('nan'):9.2f} {paired:7.2f}")
    print(f"KvIndex tracemalloc: {mem:.0f} bytes per stored block = {mem * 1e6 / 2**20:.0f} MiB per million blocks")
    print(json.dumps({"results": results, "kvindex_bytes_per_block": mem}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
