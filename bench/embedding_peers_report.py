"""The table, the goals and the plots of ``python -m bench.embeddings --peers`` (from its summary).

The goals are issue 20's: at 8, 64 and 256 in flight conveyor at least 1.5x infinity's texts/s
with the same or better p99; at 1 in flight conveyor's p50 no more than infinity's; and, run with
``--systems conveyor,conveyor-torch``, the default engine at least 1.5x torch's texts/s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONVEYOR, PEER, TORCH, BASE = "conveyor", "infinity", "conveyor-torch", "conveyor-base"
COLORS = {"conveyor": "tab:blue", "conveyor-onnx": "tab:purple", "conveyor-torch": "tab:cyan",
          "conveyor-torch-bf16": "tab:green", "conveyor-base": "tab:gray", "infinity": "tab:orange"}


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    errors = f", {row['errors']:.0f} errors" if row["errors"] else ""
    return f"{row['rate']:.1f} ({row['p50']:.1f} / {row['p99']:.1f}){errors}"


def _systems(summary: dict[str, Any]) -> list[str]:
    return sorted({s for level in summary["levels"].values() for s in level}, key=lambda s: (s != CONVEYOR, s))


def _compared(systems: list[str]) -> str:
    """What conveyor's ratios are against: infinity when it ran, else the torch engine, else the
    other checkout (``--base``)."""
    for other in (PEER, TORCH, BASE):
        if other in systems:
            return other
    return PEER


def table(summary: dict[str, Any]) -> str:
    """Markdown: texts/s (p50 / p99 ms) per system and level, and conveyor's ratios to infinity
    (or, without it, to conveyor on the torch engine)."""
    systems = _systems(summary)
    other = _compared(systems)
    head = "| in flight | " + " | ".join(f"{s} texts/s (p50 / p99 ms)" for s in systems)
    head += f" | conveyor / {other} texts/s | conveyor / {other} p99 |"
    lines = [head, "|" + " ---: |" * (len(systems) + 3)]
    for level in sorted(summary["levels"]):
        rows = summary["levels"][level]
        c, p = rows.get(CONVEYOR), rows.get(other)
        rate = f"{c['rate'] / p['rate']:.2f}x" if c and p else "-"
        p99 = f"{c['p99'] / p['p99']:.2f}x" if c and p else "-"
        lines.append(f"| {level} | " + " | ".join(_cell(rows.get(s)) for s in systems) + f" | {rate} | {p99} |")
    if summary.get("direct"):
        lines.append(f"\nThe model called directly (ceiling, median of the rounds): {summary['direct']:.1f} texts/s.")
    return "\n".join(lines)


def goals(summary: dict[str, Any]) -> str:
    """One line per goal of the issue: met or not, with the figures."""
    out = []
    if _compared(_systems(summary)) == BASE:
        return "(a paired run against another checkout: no goal of the issue applies)"
    if _compared(_systems(summary)) == TORCH:
        for level, rows in sorted(summary["levels"].items()):
            c, t = rows.get(CONVEYOR), rows.get(TORCH)
            if c and t:
                ok = c["rate"] >= 1.5 * t["rate"]
                out.append(f"goal at {level} in flight, the default engine >= 1.5x torch's texts/s: "
                           f"{'met' if ok else 'NOT met'} ({c['rate'] / t['rate']:.2f}x)")
        return "\n".join(out)
    for level, rows in sorted(summary["levels"].items()):
        c, p = rows.get(CONVEYOR), rows.get(PEER)
        if not (c and p):
            continue
        if level == 1:
            ok = c["p50"] <= p["p50"]
            out.append(f"goal at 1 in flight, p50 <= infinity's: {'met' if ok else 'NOT met'} "
                       f"({c['p50']:.1f} against {p['p50']:.1f} ms)")
        else:
            ok = c["rate"] >= 1.5 * p["rate"] and c["p99"] <= p["p99"]
            out.append(f"goal at {level} in flight, >= 1.5x texts/s and p99 <= infinity's: "
                       f"{'met' if ok else 'NOT met'} "
                       f"({c['rate'] / p['rate']:.2f}x, p99 {c['p99']:.0f} against {p['p99']:.0f} ms)")
    return "\n".join(out)


def plot(document: dict[str, Any], out: Path) -> list[Path]:
    """``embedding-peers-throughput.png`` (texts/s per level, the ceiling as a line) and
    ``embedding-peers-latency.png`` (p50 and p99 against texts/s, a point per level)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    summary = document["summary"]
    levels = sorted(summary["levels"], key=int)
    systems = sorted({s for lv in summary["levels"].values() for s in lv}, key=lambda s: (s != CONVEYOR, s))
    title = (f"all-MiniLM-L6-v2 over HTTP, {document['machine']}\n"
             f"median of {document['settings']['rounds']} rounds, {document['started'][:16]} UTC")
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(levels))]
        ys = [summary["levels"][lv].get(system, {}).get("rate", 0.0) for lv in levels]
        ax.bar(xs, ys, width, color=COLORS.get(system), label=system)
    if summary.get("direct"):
        ax.axhline(summary["direct"], color="gray", linestyle="--", label="model called directly")
    ax.set_xticks(range(len(levels)), [f"{lv} in flight" for lv in levels])
    ax.set_ylabel("texts/s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    throughput = out / "embedding-peers-throughput.png"
    fig.savefig(throughput, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, figure in zip(axes, ("p50", "p99"), strict=True):
        for system in systems:
            points = [(lv, summary["levels"][lv][system]) for lv in levels if system in summary["levels"][lv]]
            xs, ys = [r["rate"] for _, r in points], [r[figure] for _, r in points]
            ax.plot(xs, ys, marker="o", color=COLORS.get(system), label=system)
            for (lv, _), x, y in zip(points, xs, ys, strict=True):
                ax.annotate(str(lv), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("texts/s")
        ax.set_ylabel(f"{figure} latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{figure} (labels: in flight)", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    latency = out / "embedding-peers-latency.png"
    fig.savefig(latency, dpi=110)
    plt.close(fig)
    return [throughput, latency]
