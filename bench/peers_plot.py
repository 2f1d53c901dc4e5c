"""One PNG per workload of ``python -m bench peers``: hit rate against TTFT p90, a panel per load.

Up and to the left is better; each router is a point, kvroute's modes, the SGLang gateway and the vLLM
router in their own colours, so who wins a cell and by how much reads at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on servers / in tests
import matplotlib.pyplot as plt  # noqa: E402

KIND_COLOR = {"kvroute": "#2a9d8f", "smg": "#e76f51", "smg-1.13": "#f4a261", "vllm-router": "#264653"}
RECOMMENDED_COLOR = "#e9c46a"


def plot_workload(reports: Sequence[dict], path: str, recommended: str = "kvroute-latency") -> None:
    """``reports``: the same workload at each load (one panel each)."""
    fig, axes = plt.subplots(1, len(reports), figsize=(5.2 * len(reports), 4.2), dpi=80, squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        orc = report["oracle"]["token_share"] or 1.0
        for m in report["routers"]:
            p90 = m["ttft_ms"]["p90"]
            if m.get("hit_rate") is None or p90 is None:
                continue
            share = 100.0 * m["hit_rate"] / orc
            ours = m["router"] == recommended
            ax.scatter(p90, share, s=90 if ours else 45, zorder=3, edgecolors="black" if ours else "none",
                       color=RECOMMENDED_COLOR if ours else KIND_COLOR.get(m["kind"], "#8d99ae"))  # fmt: skip
            ax.annotate(m["router"], (p90, share), textcoords="offset points", xytext=(5, 4), fontsize=7)
        machine = report.get("machine", {})
        ax.set_title(
            f"load x{report['load']:g}: {report['trace']['requests']} requests "
            f"(machine load {machine.get('load_before', '?')})",
            fontsize=9,
        )
        ax.set_xlabel("TTFT p90 (ms)")
        ax.set_ylabel("prefix-cache hit rate, % of the oracle")
        ax.grid(alpha=0.3)
        ax.margins(0.15)
    first = reports[0]
    fig.suptitle(
        f"{first['workload']} on {first['testbed']}{' (quick)' if first.get('quick') else ''}: up and left is better",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
