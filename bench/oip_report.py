"""bench.oip's rows to figures: medians over interleaved rounds, ratios paired within a round, tables.

A row is one measurement: ``config``, ``connections``, ``round``, ``rps``, ``p50_ms``, ``p99_ms``,
``errors`` and ``cpu_us`` (CPU microseconds per request, per process group). On a shared machine
a ratio is taken within each round (both sides saw the same minutes) and its median reported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import ROOT, machine

RESULTS = ROOT / "bench" / "results"
Row = dict[str, Any]


def median(values: Iterable[float]) -> float:
    """Median, NaN (a window with no answer) left out; NaN when nothing is left."""
    kept = [v for v in values if v == v]
    return statistics.median(kept) if kept else float("nan")


def summarise(rows: Sequence[Row], key: str = "connections") -> dict[tuple[str, int], Row]:
    """(config, key) -> median rps/p50/p99 and CPU per group, summed errors, rounds."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row["config"], int(row[key])), []).append(row)
    out = {}
    for k, group in groups.items():
        labels = sorted({label for r in group for label in r["cpu_us"]})
        out[k] = {"rounds": len(group), "errors": sum(int(r["errors"]) for r in group),
                  **{fig: median(float(r[fig]) for r in group) for fig in ("rps", "p50_ms", "p99_ms")},
                  "cpu_us": {label: median(r["cpu_us"].get(label, float("nan")) for r in group) for label in labels}}
    return out


def paired_ratio(rows: Sequence[Row], num: str, den: str, load: int, fig: str = "rps",
                 key: str = "connections") -> tuple[float, list[float]]:
    """``num``'s figure over ``den``'s within each round at ``load``: (median, per round)."""
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        if int(row[key]) == load and row["config"] in (num, den):
            by_round.setdefault(int(row["round"]), {})[row["config"]] = float(row[fig])
    ratios = [r[num] / r[den] for _, r in sorted(by_round.items()) if num in r and den in r and r[den] > 0]
    return median(ratios), ratios


def cpu_text(cpu_us: dict[str, float]) -> str:
    """``group N`` per process group (us per request) and their total, the load generator apart."""
    served = {k: v for k, v in cpu_us.items() if k != "wrk" and k != "client"}
    parts = [f"{k} {v:.0f}" for k, v in served.items()]
    total = sum(v for v in served.values() if v == v)
    rest = [f"{k} {v:.0f}" for k, v in cpu_us.items() if k not in served]
    return f"{', '.join(parts)}; **served {total:.0f}**" + (f"; load generator: {', '.join(rest)}" if rest else "")


def head(command: str) -> str:
    """What a reader needs to place the figures: when (UTC), where, which commit, what ran."""
    described = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {machine()}; conveyor {described}; "
            f"load average at start {load}\ncommand: {command}")


def tail() -> str:
    """The end time and load average: a shared machine's other jobs show in the load."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"ended {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; load average at end {load}"


def save(name: str, document: dict[str, Any], directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(document, indent=1, allow_nan=True))
    return path


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def command_line() -> str:
    return "python -m " + " ".join([sys.argv[0].removeprefix(str(ROOT) + "/").removesuffix(".py").replace("/", "."),
                                    *sys.argv[1:]])
