"""PNG comparison of router modes for one replay report (small: a few tens of kB)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers / in tests
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"latency": "#e9c46a", "kv": "#2a9d8f", "round_robin": "#e76f51", "random": "#8d99ae"}
VARIANT_COLOR = "#264653"  # tuned kv rows


def plot_report(report: dict, path: str) -> None:
    """Three panels: TTFT p50/p90, end-to-end p50/p90, cache hit rate against the oracle."""
    modes = report["modes"]
    names = [m["mode"] for m in modes]
    colors = [COLORS.get(n, VARIANT_COLOR) for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5), dpi=80)

    def latency_panel(ax, key: str, title: str) -> None:
        x = range(len(names))
        p50 = [(m[key]["p50"] or 0) for m in modes]
        p90 = [(m[key]["p90"] or 0) for m in modes]
        ax.bar([i - 0.2 for i in x], p50, width=0.4, color=colors, label="p50")
        ax.bar([i + 0.2 for i in x], p90, width=0.4, color=colors, alpha=0.45, label="p90")
        ax.set_xticks(list(x), names, fontsize=8, rotation=15)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)

    latency_panel(axes[0], "ttft_ms", "time to first token")
    latency_panel(axes[1], "e2e_ms", "end-to-end latency")
    ax = axes[2]
    hits = [(m.get("hit_rate") or 0.0) * 100 for m in modes]
    ax.bar(range(len(names)), hits, color=colors)
    ax.set_xticks(list(range(len(names))), names, fontsize=8, rotation=15)
    oracle = report["oracle"]["token_share"] * 100
    ax.axhline(oracle, color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, oracle, f"oracle {oracle:.0f} %", ha="right", va="bottom", fontsize=8)
    ax.set_ylim(0, max(100.0, oracle + 5))
    ax.set_ylabel("% of prompt tokens")
    ax.set_title("prefix cache hit rate")
    fig.suptitle(f"trace {report['trace']['name']}: {report['trace']['requests']} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_summary(reports: list[dict], path: str) -> None:
    """Side by side over runs (trace x load): TTFT p50 and p90 relative to round_robin, hit rate as a share of
    the oracle."""
    labels: list[str] = []
    for r in reports:
        for m in r["modes"]:
            if m["mode"] not in labels:
                labels.append(m["mode"])
    runs = [f"{r['trace']['name']}\nspeedup {r.get('speedup_ratio')}" for r in reports]
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.6 * len(runs) * len(labels) / 2), 9), dpi=80, sharex=True)
    width = 0.8 / max(1, len(labels))

    def values(r: dict, label: str, what: str) -> float:
        m = next((m for m in r["modes"] if m["mode"] == label), None)
        rr = next((m for m in r["modes"] if m.get("router_mode") == "round_robin"), None)
        if m is None:
            return 0.0
        if what == "hit":
            orc = r["oracle"]["token_share"]
            return (m.get("hit_rate") or 0.0) / orc * 100 if orc else 0.0
        key = "p50" if what == "p50" else "p90"
        base = rr["ttft_ms"][key] if rr else None
        return (m["ttft_ms"][key] or 0.0) / base if base else 0.0

    panels = [
        ("p50", "TTFT p50 / round_robin's", 0.45),
        ("p90", "TTFT p90 / round_robin's", None),
        ("hit", "hit rate, % of the oracle", 95.0),
    ]
    for ax, (what, title, goal) in zip(axes, panels, strict=True):
        for j, label in enumerate(labels):
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(runs))]
            ax.bar(
                xs,
                [values(r, label, what) for r in reports],
                width=width,
                color=COLORS.get(label, VARIANT_COLOR),
                label=label,
            )
        if goal is not None:
            ax.axhline(goal, color="black", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=9)
        if what == "hit":
            ax.set_ylim(0, 105)
    axes[0].legend(fontsize=8, ncol=len(labels))
    axes[-1].set_xticks(list(range(len(runs))), runs, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
