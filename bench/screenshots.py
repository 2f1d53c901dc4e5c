"""Routing quality on a screenshot-heavy agentic workload: kvroute's modes vs round robin, same schedule.

A computer-use or browser agent sends, every turn, its whole history (the system prompt, each earlier
user turn with its screenshot, the assistant's replies) plus a new screenshot; harnesses often keep
only the last K screenshots (``--keep-screenshots``), so the oldest drops out of the history and the
prompt changes from that turn on. What a router can reuse is the history's blocks, and the blocks that
hold a screenshot match only when the router keys them with the image's identity, as the engine does
(kvroute_common/multimodal.py).

Each screenshot is a fresh PNG (seeded random rectangles and a patch of noise standing in for detail;
every screenshot distinct), sent as a data URL in an OpenAI ``image_url`` part. The engines are mockers
serving the tiny Idefics3-shaped model's files (kvroute_common/real_engines/tiny_vlm.py
``--no-weights``), fresh per mode, with caches that evict; the frontend tokenizes with the same files
(``--model-path``). Per mode: the engines' own prefix-cache hit rate (``vllm:prefix_cache_hits /
queries`` deltas), the oracle (one infinite shared cache, its blocks keyed with the image identities
as the engines key them: with plain token ids every screenshot of one size is the same run of
placeholder tokens, so a token-only oracle counts other screenshots as hits; it is reported beside),
TTFT p50/p90, the router's predicted cached tokens against the engines' delivered ones, the hash-parity
alarm, and the frontend's CPU per request. The replay and counters are bench/replay.py's, the router
start-up and CPU measurement bench/peers.py's.
"""

from __future__ import annotations

import argparse
import base64
import io
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
import numpy as np
from PIL import Image, ImageDraw

from bench.peers import READY_TIMEOUT, ROUTERS, RouterSpec, Testbed, busiest_share, failed, run_router
from bench.replay import RunOptions, fmt, load_avg, read_counter, write_report
from bench.sessions import Words
from bench.traces import Oracle, Trace, TraceRequest, oracle, oracle_of_keys
from kvroute_common.hashing import local_block_hashes, sequence_hashes
from kvroute_common.local_cluster import Cluster, MockerOptions
from kvroute_common.multimodal import ImageContext, Placeholder, block_mm_hashes, load_layout
from kvroute_common.tokenizer import chat_prompt, load_tokenizer

BLOCK_SIZE = 32
MODEL = "tiny-vlm"
TINY_VLM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kvroute_common",
                        "real_engines", "tiny_vlm.py")  # fmt: skip
MODES = ("kvroute-kv", "kvroute-latency", "round_robin")
# what the frontend says about its own keys after a run: predicted vs delivered cached tokens, parity alarm
FRONTEND_COUNTERS = ("kvroute_router_captured_cached_tokens", "kvroute_router_delivered_cached_tokens",
                     "kvroute_router_prompt_tokens", "kvroute_hash_parity_mismatch")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ScreenshotWorkload:
    """Agent sessions on a few shared system prompts, a new screenshot every turn."""

    sessions: int = 24
    turns: int = 6
    prefixes: int = 4  # shared system prompts
    prefix_tokens: tuple[int, int] = (1536, 2560)
    user_tokens: int = 96  # the turn's text beside its screenshot (instruction, tool result), mean
    reply_tokens: int = 128  # the assistant's action as it appears in the next turn's history
    output_tokens: int = 8
    keep_screenshots: int = 0  # the history keeps only the last K screenshots (0 = all of them)
    screen: tuple[int, int] = (1280, 800)
    noise: tuple[int, int] = (160, 120)  # a patch of random pixels per screenshot: detail PNG cannot compress
    start_window_s: float = 40.0
    think_s: float = 3.0
    think_min_s: float = 1.0

    def describe(self) -> str:
        lo, hi = self.prefix_tokens
        keep = f"the last {self.keep_screenshots}" if self.keep_screenshots else "all"
        return (
            f"{self.sessions} sessions x {self.turns} turns (chat) over {self.prefixes} shared system prompts of "
            f"~{lo}-{hi} tokens; each turn a new {self.screen[0]}x{self.screen[1]} PNG screenshot (data URL) and "
            f"~{self.user_tokens} tokens of text, replies ~{self.reply_tokens} tokens in the history, history keeps "
            f"{keep} screenshots; {self.output_tokens} generated tokens; sessions start over "
            f"{self.start_window_s:g} s, think {self.think_min_s:g} s + Exp({self.think_s:g} s)"
        )

    def quick(self) -> ScreenshotWorkload:
        """The same shape, shorter: a third of the sessions (at least 6), 4 turns, quicker turns."""
        return replace(self, sessions=max(6, self.sessions // 3), turns=min(4, self.turns),
                       start_window_s=min(self.start_window_s, 8.0), think_s=min(self.think_s, 1.0),
                       think_min_s=min(self.think_min_s, 0.5))  # fmt: skip


def screenshot(seed: int, session: int, turn: int, screen: tuple[int, int], noise: tuple[int, int]) -> bytes:
    """A distinct PNG per (seed, session, turn): a light background, random windows and a noise patch."""
    rng = np.random.default_rng([seed, session, turn, 23])
    w, h = screen
    img = Image.new("RGB", screen, (236, 236, 236))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(20, 40))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 10))
        x1, y1 = x0 + int(rng.integers(20, w // 3)), y0 + int(rng.integers(10, h // 4))
        draw.rectangle((x0, y0, x1, y1), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    nw, nh = min(noise[0], w), min(noise[1], h)
    if nw > 0 and nh > 0:
        patch = Image.fromarray(rng.integers(0, 256, (nh, nw, 3), dtype=np.uint8), "RGB")
        img.paste(patch, (int(rng.integers(0, w - nw + 1)), int(rng.integers(0, h - nh + 1))))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


@dataclass(slots=True)
class ScreenshotTrace:
    """The schedule, and per request its block keys as the engines compute them (image-aware) and as
    plain tokens would give them."""

    trace: Trace
    keyed: list[tuple[int, list[int]]]
    image_bytes: int  # mean PNG size
    image_tokens: int  # placeholder tokens per screenshot


def build_trace(workload: ScreenshotWorkload, model_dir: str, seed: int = 0) -> ScreenshotTrace:
    """Every turn of every session at its arrival time: the chat messages with their screenshots, the
    tokens the engine runs (images expanded) and the image-aware sequence hashes of its full blocks."""
    tok = load_tokenizer(model_dir)
    layout = load_layout(model_dir)
    if layout is None:
        raise SystemExit(f"{model_dir} has no image layout kvroute knows (expected the tiny VLM's files)")
    ctx = ImageContext(layout, model_dir)  # the mockers' model id: their --model-path
    words = Words(tok, seed)
    prng = np.random.default_rng([seed, 31])
    lo, hi = workload.prefix_tokens
    prompts = [words.about(prng, int(prng.integers(lo, hi + 1))) for _ in range(workload.prefixes)]
    rng = np.random.default_rng([seed, 37])
    lo_u, hi_u = max(1, workload.user_tokens // 2), max(2, (3 * workload.user_tokens) // 2 + 1)
    pending: list[tuple[float, int, list[dict[str, Any]]]] = []
    sizes: list[int] = []
    for s in range(workload.sessions):
        system = prompts[int(rng.integers(len(prompts)))]
        turns: list[tuple[str, str, str]] = []  # (user text, screenshot URL, reply)
        t = float(rng.uniform(0.0, workload.start_window_s))
        for k in range(workload.turns):
            png = screenshot(seed, s, k, workload.screen, workload.noise)
            sizes.append(len(png))
            turns.append((words.about(rng, int(rng.integers(lo_u, hi_u))), data_url(png), ""))
            pending.append((t, s, history(system, turns, workload.keep_screenshots)))
            turns[-1] = (turns[-1][0], turns[-1][1], words.about(rng, workload.reply_tokens))
            t += workload.think_min_s + float(rng.exponential(workload.think_s))
    pending.sort(key=lambda p: (p[0], p[1]))
    requests: list[TraceRequest] = []
    keyed: list[tuple[int, list[int]]] = []
    image_tokens = 0
    for i, (t, s, messages) in enumerate(pending):
        tokens, images = chat_prompt(tok, messages, ctx)
        image_tokens = image_tokens or (images[0].length if images else 0)
        keyed.append((len(tokens), image_keys(tokens, images)))
        requests.append(TraceRequest(i, round(t, 6), tokens, workload.output_tokens, session=s, messages=messages))
    scaling = {"kind": "screenshots", "workload": asdict(workload), "seed": seed, "description": workload.describe()}
    return ScreenshotTrace(Trace("screenshots", requests, scaling), keyed, sum(sizes) // max(1, len(sizes)),
                           image_tokens)  # fmt: skip


def history(system: str, turns: Sequence[tuple[str, str, str]], keep: int) -> list[dict[str, Any]]:
    """The chat messages of a turn: every earlier turn with its reply, the screenshots of all but the
    last ``keep`` turns dropped (``keep`` 0 keeps them all), the last turn awaiting its reply."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    first_kept = max(0, len(turns) - keep) if keep else 0
    for k, (text, url, reply) in enumerate(turns):
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        if k >= first_kept:  # the screenshot first, as a tool result carries it, then the turn's text
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        messages.append({"role": "user", "content": content})
        if reply:
            messages.append({"role": "assistant", "content": reply})
    return messages


def image_keys(tokens: Sequence[int], images: Sequence[Placeholder]) -> list[int]:
    """Sequence hashes of the full blocks as the engine keys them (image identities in the blocks they span)."""
    mm = block_mm_hashes(images, len(tokens), BLOCK_SIZE) if images else None
    return sequence_hashes(local_block_hashes(tokens, BLOCK_SIZE, mm_hashes=mm))


# -- running -------------------------------------------------------------------------------------------
def write_model(out_dir: str) -> str:
    """The tiny VLM's tokenizer and processor files (no weights): what the mockers and the frontend read."""
    subprocess.run([sys.executable, TINY_VLM, "--out", out_dir, "--no-weights"], check=True, capture_output=True,
                   timeout=120)  # fmt: skip
    return out_dir


def frontend_counters(url: str) -> dict[str, float | None]:
    """The frontend's own view after the run: predicted (captured) and engine-reported cached tokens,
    prompt tokens of those requests, and the parity alarm (any worker)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    return {name: read_counter(text, name) for name in FRONTEND_COUNTERS}


def run_modes(
    st: ScreenshotTrace, specs: Sequence[RouterSpec], args: argparse.Namespace, model_dir: str, blocks: int
) -> list[dict]:
    """Fresh (cold) mockers and frontend per mode, the same schedule through each."""
    bed = Testbed(MODEL, model_dir, model_dir, BLOCK_SIZE)
    mocker = MockerOptions(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, speedup_ratio=args.speedup_ratio,
                           seed=args.seed, model_name=MODEL, model_path=model_dir)  # fmt: skip
    opts = RunOptions(workers=args.workers, max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
                      request_timeout_s=args.request_timeout, model=MODEL)  # fmt: skip
    rows = []
    for spec in specs:
        cluster = Cluster(log_dir=os.path.join(args.out_dir, "logs", f"screenshots-{spec.label}"))
        try:
            for _ in range(args.workers):
                cluster.start_mocker(mocker)
            cluster.wait_workers_ready(READY_TIMEOUT)
            row = run_router(st.trace, spec, cluster, bed, opts, None, cluster.check_alive)
            assert cluster.frontend_url is not None
            row["frontend"] = frontend_counters(cluster.frontend_url)
            row["load_after"] = load_avg()
            rows.append(row)
        except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
            rows.append(failed(st.trace, spec, exc))
        finally:
            cluster.stop()
    return rows


def blocks_per_engine(st: ScreenshotTrace, args: argparse.Namespace) -> int:
    """As given, or all engines together hold ``--cache-fraction`` of the schedule's distinct (image-aware)
    blocks, and never less than twice the longest request."""
    if args.num_gpu_blocks:
        return int(args.num_gpu_blocks)
    distinct = len({h for _, seq in st.keyed for h in seq})
    longest = max(math.ceil((len(r.tokens) + r.max_tokens) / BLOCK_SIZE) for r in st.trace.requests)
    return max(math.ceil(args.cache_fraction * distinct / args.workers), 2 * longest + 1)


# -- report --------------------------------------------------------------------------------------------
def table(report: dict) -> str:
    orc = report["oracle"]["token_share"]
    lines = [
        "| mode | hit rate (engines) | of oracle | TTFT p50 / p90 / p99 ms | e2e p50 ms | errors "
        "| router predicted / engines' cached tokens | frontend CPU ms / request | busiest engine's share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in report["routers"]:
        hit = m.get("hit_rate")
        t = m["ttft_ms"]
        fe = m.get("frontend") or {}
        captured, delivered = (
            fe.get("kvroute_router_captured_cached_tokens"),
            fe.get("kvroute_router_delivered_cached_tokens"),
        )
        predicted = f"{captured:,.0f} / {delivered:,.0f}" if captured is not None and delivered is not None else "n/a"
        if fe.get("kvroute_hash_parity_mismatch"):
            predicted += " (parity ALARM)"
        lines.append(
            f"| {m['router']} | {fmt(hit, '%')} | {f'{hit / orc:.1%}' if hit is not None and orc else 'n/a'} "
            f"| {fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | {fmt(m['e2e_ms']['p50'])} "
            f"| {m['requests'] - m['completed']} | {predicted} | {fmt(m.get('router_cpu_ms_per_request'))} "
            f"| {fmt(busiest_share(m.get('cache')))} |"
        )
    lines.append(f"| oracle (one infinite shared cache, image-aware keys) | {fmt(orc, '%')} | 100% | | | | | | |")
    token_only = fmt(report["token_oracle"]["token_share"], "%")
    lines.append(f"| (token-only keys: every screenshot's placeholder run alike) | {token_only} | | | | | | | |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    s = report["trace"]
    lines = [
        f"### `screenshots` on {report['setup']}",
        "",
        f"- Workload: {report['description']}",
        f"- Schedule: {s['requests']} requests over {s['span_s']} s, mean prompt {s['mean_prompt_tokens']} tokens "
        f"(max {s['max_prompt_tokens']}); {report['images']}",
        f"- Command: `{report['command']}`; {report['total_s']:.0f} s; {report['machine']['load_before']} "
        f"before, {report['machine']['load_after']} after",
        "",
        table(report),
        "",
    ]
    lines += [
        f"- `{m['router']}` = `{m['command']}` (load after: {m.get('load_after', 'n/a')})" for m in report["routers"]
    ]
    for m in report["routers"]:
        if m["completed"] < m["requests"]:
            example = next(iter(m.get("error_examples", {}).values()), "")[:200]
            lines.append(f"- {m['router']}: {m['requests'] - m['completed']} failed, e.g. {example}")
    return "\n".join(lines) + "\n"


# -- CLI -----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    d = ScreenshotWorkload()
    p = argparse.ArgumentParser(prog="python -m bench screenshots", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a short run: a third of the sessions, 4 turns")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--keep-screenshots", type=int, default=d.keep_screenshots,
                   help="the history keeps only the last K screenshots (0 = all)")  # fmt: skip
    p.add_argument("--workers", type=int, default=4, help="engines (mockers)")
    p.add_argument("--num-gpu-blocks", type=int, default=0, help="KV blocks per engine (0 = from --cache-fraction)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="all engines' caches together hold this share of the schedule's distinct blocks")  # fmt: skip
    p.add_argument("--speedup-ratio", type=float, default=4.0, help="mocker engine speed")
    p.add_argument("--max-concurrency", type=int, default=12, help="client requests in flight at most")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per mode before cancelling")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--model-dir", default=None, help="the tiny VLM's files (default: written to a temporary dir)")
    p.add_argument("--out-dir", default="bench/out/screenshots")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in labels if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: engines stop
    load_before = load_avg()
    workload = replace(ScreenshotWorkload(), sessions=args.sessions, turns=args.turns,
                       keep_screenshots=args.keep_screenshots)  # fmt: skip
    if args.quick:
        workload = workload.quick()
    with tempfile.TemporaryDirectory(prefix="kvroute-vlm-") as tmp:
        model_dir = args.model_dir or write_model(tmp)
        t0 = time.perf_counter()
        st = build_trace(workload, model_dir, args.seed)
        built_s = time.perf_counter() - t0
        orc: Oracle = oracle_of_keys(st.keyed, BLOCK_SIZE)
        token_orc: Oracle = oracle([r.tokens for r in st.trace.requests], BLOCK_SIZE)
        blocks = blocks_per_engine(st, args)
        images = (f"{len(st.trace.requests)} new screenshots, mean PNG {st.image_bytes / 1024:.0f} KiB, "
                  f"{st.image_tokens} placeholder tokens each")  # fmt: skip
        print(f"== screenshots: {st.trace.summary()} (built in {built_s:.1f} s)")
        print(f"   {workload.describe()}; {images}")
        print(f"   oracle {orc.token_share:.1%} (token-only keys {token_orc.token_share:.1%}); "
              f"{blocks} blocks of {BLOCK_SIZE} per engine x {args.workers}; {load_before}", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        rows = run_modes(st, [ROUTERS[m] for m in labels], args, model_dir, blocks)
    report = {
        "workload": "screenshots",
        "description": workload.describe(),
        "images": images,
        "trace": st.trace.summary(),
        "oracle": orc.as_dict(),
        "token_oracle": token_orc.as_dict(),
        "setup": f"{args.workers} mockers (tiny VLM files, speedup ratio {args.speedup_ratio:g}, fresh per mode), "
        f"block size {BLOCK_SIZE}, {blocks} KV blocks each, client max {args.max_concurrency} in flight, "
        f"seed {args.seed}",
        "command": "python -m bench screenshots " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load_avg()},
        "total_s": round(time.perf_counter() - t0, 1),
        "routers": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    keep = f"-keep{workload.keep_screenshots}" if workload.keep_screenshots else ""
    stem = os.path.join(args.out_dir, f"screenshots{keep}{'-quick' if args.quick else ''}")
    write_report(stem, report, markdown(report))
    return 0 if all(m["completed"] == m["requests"] for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
