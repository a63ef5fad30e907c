"""PNG plots from bench.peers' own JSON results (matplotlib, from the ``bench`` extra).

    python -m bench.plot RESULTS_DIR --out docs/img --name NAME

Reads the newest ``peers-*.json`` and ``payloads-*.json`` in RESULTS_DIR (or the JSON files
given instead of a directory) and writes, for what it found:

- ``NAME-latency.png``: p50 and p99 latency against throughput, one line per system, a point
  per connection count (the usual way to compare servers: further right and lower is better);
- ``NAME-throughput.png``: req/s per connection count, grouped by system;
- ``NAME-payloads.png``: MB/s per array size, with raw Redis SET+GET as the floor to compare with.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.peers.report import API, HTTP, LABELS, MOSEC, REDIS, by_load, load_results, size_label

COLORS = {HTTP: "tab:blue", API: "tab:green", MOSEC: "tab:orange", REDIS: "tab:gray"}
MISSING = "matplotlib is not installed: pip install -e '.[bench]'"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _title(doc: dict[str, Any], what: str) -> str:
    m = doc["machine"]
    s = doc["settings"]
    return (f"{what}\n{m['cores']} cores (shared), {doc['loadgen']} for HTTP, "
            f"median of {s['rounds']} rounds x {s['duration_s']:g} s, {doc['started'][:10]}")


def plot_latency(doc: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    table = by_load(doc["summary"], "connections")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
    for ax, figure in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        for system in (HTTP, MOSEC, API):
            points = [(load, row[system]) for load, row in sorted(table.items()) if system in row]
            if not points:
                continue
            xs = [r["rps"] for _, r in points]
            ys = [r[figure] for _, r in points]
            ax.plot(xs, ys, marker="o", color=COLORS[system], label=LABELS[system])
            for (load, _), x, y in zip(points, xs, ys, strict=True):
                ax.annotate(str(load), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel(f"{figure.split('_')[0]} latency (ms)")
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{figure.split('_')[0]} (labels: connections)")
        ax.legend(fontsize=8)
    fig.suptitle(_title(doc, "latency against throughput, same 2-stage pipeline"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(doc: dict[str, Any], key: str, figure: str, systems: tuple[str, ...], ylabel: str, what: str,
          path: Path, fmt: Any = str) -> Path:
    plt = _pyplot()
    table = by_load(doc["summary"], key)
    loads = sorted(table)
    present = [s for s in systems if any(s in table[load] for load in loads)]
    width = 0.8 / max(1, len(present))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, system in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(loads))]
        ys = [table[load][system][figure] if system in table[load] else 0.0 for load in loads]
        ax.bar(xs, ys, width, color=COLORS[system], label=LABELS[system])
    ax.set_xticks(range(len(loads)), [fmt(load) for load in loads])
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(doc, what), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(doc: dict[str, Any], path: Path) -> Path:
    return _bars(doc, "connections", "rps", (HTTP, MOSEC, API), "req/s", "throughput per connection count", path,
                 lambda c: f"{c} conn")


def plot_payloads(doc: dict[str, Any], path: Path) -> Path:
    s = doc["settings"]
    return _bars(doc, "payload_bytes", "mb_s", (REDIS, API, HTTP, MOSEC), "MB/s of input (10^6 B/s)",
                 f"numpy float32 arrays as input, {s['in_flight']} in flight", path, size_label)


def _documents(sources: list[Path]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for source in sources:
        if source.is_dir():
            for mode in ("peers", "payloads"):
                doc = load_results(source, mode)
                if doc is not None:
                    found[mode] = doc
        else:
            doc = json.loads(source.read_text())
            found[str(doc["mode"])] = doc
    return found


def render(sources: list[Path], out: Path, name: str) -> list[Path]:
    """Every plot the results allow; returns the files written."""
    docs = _documents(sources)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "peers" in docs:
        written.append(plot_latency(docs["peers"], out / f"{name}-latency.png"))
        written.append(plot_throughput(docs["peers"], out / f"{name}-throughput.png"))
    if "payloads" in docs:
        written.append(plot_payloads(docs["payloads"], out / f"{name}-payloads.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", type=Path, help="results directory, or peers-/payloads-*.json files")
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    p.add_argument("--name", default="peers")
    args = p.parse_args(argv)
    try:
        _pyplot()
    except ImportError:
        print(MISSING, file=sys.stderr)
        return 2
    written = render(args.sources, args.out, args.name)
    if not written:
        print(f"no peers-*.json or payloads-*.json in {', '.join(map(str, args.sources))}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
