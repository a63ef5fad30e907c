"""From the raw measurements (one per round, system and load) to the tables people read.

A row's figure is the median over the interleaved rounds (robust to one round disturbed by the
shared machine); errors are summed. Ratios are conveyor / mosec within the same run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HTTP, API, MOSEC, REDIS = "conveyor-http", "conveyor-python", "mosec-http", "redis-set-get"
LABELS = {HTTP: "conveyor HTTP", API: "conveyor Python API", MOSEC: "mosec", REDIS: "Redis SET+GET"}
_FIGURES = ("rps", "p50_ms", "p99_ms", "p999_ms", "mb_s")


def _median(values: Iterable[float]) -> float:
    kept = [v for v in values if v == v]  # NaN (no answer at all) does not count
    return statistics.median(kept) if kept else float("nan")


def summarise(runs: Sequence[dict[str, Any]], key: str = "connections") -> list[dict[str, Any]]:
    """One entry per (load, system): median figures, summed errors, median CPU per process label."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((int(run[key]), str(run["system"])), []).append(run)
    rows = []
    for (load, system), group in sorted(groups.items()):
        row: dict[str, Any] = {key: load, "system": system, "rounds": len(group),
                               "errors": sum(int(r["errors"]) for r in group)}
        for fig in _FIGURES:
            if any(fig in r for r in group):
                row[fig] = _median(float(r[fig]) for r in group if fig in r)
        labels = sorted({label for r in group for label in r.get("cpu", {})})
        row["cpu"] = {label: _median(r["cpu"][label] for r in group if label in r.get("cpu", {}))
                      for label in labels}
        row["cpu_ms_per_request"] = _median(_cpu_ms(r) for r in group)
        commands = sorted({c for r in group for c in r.get("redis_usec", {})})
        row["redis_ms_per_request"] = {c: _median(_per_request(r["redis_usec"].get(c, 0) / 1000, r) for r in group)
                                       for c in commands}
        rows.append(row)
    return rows


def _cpu_ms(run: dict[str, Any]) -> float:
    """CPU ms all the system's processes spent per request (percent of a core x seconds x 10)."""
    return _per_request(sum(run.get("cpu", {}).values()) * 10 * run.get("duration_s", 0.0), run)


def _per_request(total: float, run: dict[str, Any]) -> float:
    return total / run["requests"] if run.get("requests") else float("nan")


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0 or a != a or b != b:
        return float("nan")
    return a / b


def rel(a: dict[str, Any] | None, b: dict[str, Any] | None, figure: str) -> float:
    """``a[figure] / b[figure]`` for two summary rows, NaN when either is missing."""
    return ratio(a[figure] if a else None, b[figure] if b else None)


def by_load(rows: Sequence[dict[str, Any]], key: str) -> dict[int, dict[str, dict[str, Any]]]:
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        table.setdefault(int(row[key]), {})[str(row["system"])] = row
    return table


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    errors = f", {row['errors']} err" if row["errors"] else ""
    return (f"{row['rps']:,.0f} ({row['p50_ms']:.2f} / {row['p99_ms']:.2f} / {row['p999_ms']:.2f}{errors})")


def _x(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def peers_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: req/s (p50 / p99 / p999 ms) per system, and the conveyor/mosec ratios per row."""
    lines = ["| connections | conveyor HTTP req/s (p50 / p99 / p999 ms) | mosec req/s (p50 / p99 / p999 ms) "
             "| conveyor Python API req/s (p50 / p99 / p999 ms) | HTTP / mosec req/s | HTTP / mosec p50 "
             "| Python API / mosec req/s |",
             "|---:|---|---|---|---:|---:|---:|"]
    for load, systems in sorted(by_load(rows, "connections").items()):
        h, m, a = systems.get(HTTP), systems.get(MOSEC), systems.get(API)
        lines.append(f"| {load} | {_cell(h)} | {_cell(m)} | {_cell(a)} "
                     f"| {_x(rel(h, m, 'rps'))} | {_x(rel(h, m, 'p50_ms'))} | {_x(rel(a, m, 'rps'))} |")
    return "\n".join(lines)


def cpu_table(rows: Sequence[dict[str, Any]], key: str = "connections") -> str:
    """Markdown: % of one core used by each process of each system, per load (medians), and the CPU
    time all of them spent per request (which starvation on a shared machine does not inflate)."""
    lines = [f"| {key} | system | CPU % of one core per process | CPU ms per request, all processes |",
             "|---:|---|---|---:|"]
    for row in rows:
        cpu = ", ".join(f"{label} {value:.0f}" for label, value in row["cpu"].items())
        lines.append(f"| {row[key]} | {LABELS.get(row['system'], row['system'])} | {cpu} "
                     f"| {row.get('cpu_ms_per_request', float('nan')):.2f} |")
    return "\n".join(lines)


def redis_table(rows: Sequence[dict[str, Any]], key: str = "payload_bytes", top: int = 4) -> str:
    """Markdown: where Redis spent its time per request (INFO commandstats), the largest first."""
    lines = [f"| {key} | system | Redis ms per request, by command (largest {top}) |", "|---:|---|---|"]
    for row in rows:
        spent = sorted(row.get("redis_ms_per_request", {}).items(), key=lambda kv: -kv[1])
        spent = [(c, ms) for c, ms in spent if not c.startswith("config")][:top]
        if spent:
            text = ", ".join(f"{c} {ms:.2f}" for c, ms in spent)
            load = size_label(row[key]) if key == "payload_bytes" else row[key]
            lines.append(f"| {load} | {LABELS.get(row['system'], row['system'])} | {text} |")
    return "\n".join(lines)


def size_label(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def payload_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: MB/s of input per system and size, each as a fraction of raw Redis SET+GET."""
    systems = [s for s in (REDIS, API, HTTP, MOSEC) if any(r["system"] == s for r in rows)]
    head = " | ".join(f"{LABELS[s]} MB/s (req/s, p50 ms)" for s in systems)
    rel_head = " | ".join(f"{LABELS[s]} / Redis" for s in systems if s != REDIS)
    lines = [f"| array | {head} | {rel_head} |", "|---:|" + "---|" * len(systems) + "---:|" * (len(systems) - 1)]
    for size, by_system in sorted(by_load(rows, "payload_bytes").items()):
        cells = []
        for s in systems:
            r = by_system.get(s)
            errors = f", {r['errors']} err" if r and r["errors"] else ""
            cells.append("-" if r is None else f"{r['mb_s']:,.1f} ({r['rps']:,.0f}, {r['p50_ms']:.2f}{errors})")
        base = by_system.get(REDIS)
        rels = [_x(rel(by_system.get(s), base, "mb_s")) for s in systems if s != REDIS]
        lines.append(f"| {size_label(size)} | {' | '.join(cells)} | {' | '.join(rels)} |")
    return "\n".join(lines)


def save(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, allow_nan=True))
    return path


def load_results(directory: Path, mode: str) -> dict[str, Any] | None:
    """The newest ``{mode}-*.json`` in ``directory`` (what bench.plot draws), or None."""
    files = sorted(directory.glob(f"{mode}-*.json"))
    return json.loads(files[-1].read_text()) if files else None
