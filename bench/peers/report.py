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
# The benchmark's own commands (resetting and reading the stats), not the system's.
_NOT_SERVED = ("config|resetstat", "info", "config")


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
        row["cpu_us_per_request"] = {label: _median(_cpu_us(r, label) for r in group if label in r.get("cpu", {}))
                                     for label in labels}
        commands = sorted({c for r in group for c in r.get("redis_usec", {})})
        row["redis_ms_per_request"] = {c: _median(_per_request(r["redis_usec"].get(c, 0) / 1000, r) for r in group)
                                       for c in commands}
        called = sorted({c for r in group for c in r.get("redis_calls", {}) if c not in _NOT_SERVED})
        row["redis_calls_per_request"] = {c: _median(_per_request(r["redis_calls"].get(c, 0), r) for r in group)
                                          for c in called}
        if called:
            row["redis_commands_per_request"] = _median(
                _per_request(sum(n for c, n in r.get("redis_calls", {}).items() if c not in _NOT_SERVED), r)
                for r in group)
        rows.append(row)
    return rows


def _cpu_ms(run: dict[str, Any]) -> float:
    """CPU ms all the system's processes spent per request (percent of a core x seconds x 10)."""
    return _per_request(sum(run.get("cpu", {}).values()) * 10 * run.get("duration_s", 0.0), run)


def _cpu_us(run: dict[str, Any], label: str) -> float:
    """CPU microseconds one process group spent per request (percent of a core x seconds x 10^4)."""
    return _per_request(run["cpu"][label] * 1e4 * run.get("duration_s", 0.0), run)


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
    """Markdown: the CPU time each process group spent per request (microseconds, medians over the
    rounds; in brackets its % of one core), beside req/s. Per request, starvation on a shared
    machine does not inflate it: a starved process does less and spends less."""
    lines = [f"| {key} | system | req/s | CPU us per request, by process group (% of one core) "
             "| all processes, us per request |", "|---:|---|---:|---|---:|"]
    for row in rows:
        us = row.get("cpu_us_per_request", {})
        groups = ", ".join(f"{label} {us.get(label, float('nan')):.1f} ({pct:.0f}%)"
                           for label, pct in row["cpu"].items())
        load = size_label(row[key]) if key == "payload_bytes" else row[key]
        lines.append(f"| {load} | {LABELS.get(row['system'], row['system'])} | {row.get('rps', float('nan')):,.0f} "
                     f"| {groups} | {row.get('cpu_ms_per_request', float('nan')) * 1000:.1f} |")
    return "\n".join(lines)


def redis_table(rows: Sequence[dict[str, Any]], key: str = "payload_bytes", top: int = 6) -> str:
    """Markdown: what Redis did per request (INFO commandstats): commands per request, counting the
    commands scripts run (exact, noise-free), and the largest commands by time (``evalsha``'s time
    holds its inner commands' time: the script's own work is its time less theirs)."""
    lines = [f"| {key} | system | Redis commands per request | Redis ms per request, by command (largest {top}; "
             "calls per request) |", "|---:|---|---:|---|"]
    for row in rows:
        spent = sorted(row.get("redis_ms_per_request", {}).items(), key=lambda kv: -kv[1])
        spent = [(c, ms) for c, ms in spent if c not in _NOT_SERVED][:top]
        if spent:
            calls = row.get("redis_calls_per_request", {})
            text = ", ".join(f"{c} {ms:.3f}" + (f" ({calls[c]:.3f})" if c in calls else "") for c, ms in spent)
            load = size_label(row[key]) if key == "payload_bytes" else row[key]
            lines.append(f"| {load} | {LABELS.get(row['system'], row['system'])} "
                         f"| {row.get('redis_commands_per_request', float('nan')):.2f} | {text} |")
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
