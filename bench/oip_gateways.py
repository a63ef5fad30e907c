"""One gateway serving three pipelines against three gateways serving one each (issue 19, goal 2).

    python -m bench.oip_gateways [--rounds 5] [--connections 64] [--duration-s 5]

Three copies of the scale-shift example (``bench.oip_apps``: ss-a, ss-b, ss-c, one worker per
stage each, six workers) on one embedded Redis, and four gateways up at once: ``one`` is
``conveyor gateway ss-a ss-b ss-c``, ``three`` is ``conveyor gateway ss-a`` (and -b, -c), each on
its own port. A measurement sends the same load to either: one wrk per pipeline (one thread,
``--connections`` each, so 3 x 64 by default) on ``POST /v1/pipelines/NAME/predict`` with body
``3``, all three at once. Rounds alternate ``one`` and ``three`` (which goes first alternates too);
the idle gateways stay up and their CPU is reported apart. Per row: req/s per pipeline and in
total, p50/p99, and CPU microseconds per request of each process group (the serving gateway
processes, idle gateways, the six workers, Redis, the three wrk) over the window: three gateway
processes on two cores contend differently from one, and this shows where the CPU went.
Goal: ``three`` and ``one`` give the same req/s within noise (ratio three/one per round, median).
Results: JSON under bench/results/ (``oip-gateways-*.json``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson
import psutil

from bench.oip_apps import APPS, NAMES
from bench.oip_load import Target, run_wrk
from bench.oip_report import command_line, cpu_text, head, median, paired_ratio, progress, save, summarise, tail
from bench.oip_stack import ROOT, Stack
from bench.peers.load import LoadError
from bench.peers.servers import ServerError

CONFIGS = ("one", "three")
ALL = "all"


def _targets(stack: Stack, config: str, connections: int) -> list[Target]:
    """One Target per pipeline: the shared gateway's route for it, or its own gateway's."""
    out = []
    for name in NAMES:
        port = stack.port(ALL if config == "one" else name)
        out.append(Target(f"http://127.0.0.1:{port}/v1/pipelines/{name}/predict", [b"3"], "application/json",
                          connections=connections, label=name))
    return out


def _groups(stack: Stack, config: str) -> dict[str, list[psutil.Process]]:
    """The serving gateway processes, the idle ones, all workers, Redis."""
    every = stack.groups()
    serving = [ALL] if config == "one" else list(NAMES)
    gw = [p for label in serving for p in every[f"gateway {label}"]]
    idle = [p for label in stack.gateways if label not in serving for p in every[f"gateway {label}"]]
    workers = [p for label, ps in every.items() if label.startswith("worker") for p in ps]
    return {f"gateway ({config})": gw, "idle gateways": idle, "workers (6)": workers, "redis": every["redis"]}


def measure(stack: Stack, config: str, connections: int, duration_s: float) -> dict[str, Any]:
    window = run_wrk(_targets(stack, config, connections), duration_s, _groups(stack, config), threads=1)
    per = window.results
    return {"rps": sum(r.rps for r in per.values()), "requests": window.requests,
            "p50_ms": median(r.p50_ms for r in per.values()), "p99_ms": max(r.p99_ms for r in per.values()),
            "errors": sum(r.errors for r in per.values()),
            "pipelines": {name: {"rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms} for name, r in per.items()},
            "cpu_us": window.cpu_us_per_request()}


def _check(stack: Stack) -> None:
    for config in CONFIGS:
        for target in _targets(stack, config, 1):
            status, body, _ = target.check()
            if status != 200 or orjson.loads(body) != {"result": 9}:
                raise ServerError(f"{config} {target.url} answered {status}: {body[:300]!r}")


def run(rounds: int, connections: list[int], duration_s: float) -> list[dict[str, Any]]:
    stack = Stack(ROOT / "bench" / "results" / "logs" / "oip-gateways")
    rows: list[dict[str, Any]] = []
    try:
        stack.start_redis()
        for name in NAMES:
            for stage in ("Scale", "Shift"):
                stack.worker(f"{name} {stage}", APPS[name], stage)
        stack.gateway(ALL, NAMES)
        for name in NAMES:
            stack.gateway(name, [name])
        stack.wait_ready()
        _check(stack)
        for config in CONFIGS:
            measure(stack, config, 16, 1.0)  # warm-up
        step = 0
        for rnd in range(1, rounds + 1):
            for conns in connections:
                order = CONFIGS if step % 2 == 0 else CONFIGS[::-1]
                step += 1
                for config in order:
                    row = {"config": config, "connections": conns, "round": rnd,
                           **measure(stack, config, conns, duration_s)}
                    rows.append(row)
                    per = ", ".join(f"{n} {v['rps']:,.0f}" for n, v in row["pipelines"].items())
                    progress(f"round {rnd} 3x{conns} conn {config:<5} {row['rps']:>8,.0f} req/s ({per}) "
                             f"p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms err {row['errors']}")
    finally:
        stack.stop()
    return rows


def render(rows: list[dict[str, Any]], connections: list[int]) -> str:
    summary = summarise(rows)
    lines = ["| connections | gateways | req/s total | req/s ss-a / ss-b / ss-c | p50 ms | p99 ms | errors "
             "| CPU us per request |", "|---:|---|---:|---|---:|---:|---:|---|"]
    for conns in connections:
        for config in CONFIGS:
            s = summary[(config, conns)]
            chosen = [r for r in rows if r["config"] == config and r["connections"] == conns]
            per = " / ".join(f"{median(r['pipelines'][n]['rps'] for r in chosen):,.0f}" for n in NAMES)
            lines.append(f"| 3 x {conns} | {config} | {s['rps']:,.0f} | {per} | {s['p50_ms']:.2f} "
                         f"| {s['p99_ms']:.2f} | {s['errors']} | {cpu_text(s['cpu_us'])} |")
    lines += ["", "| connections | three / one, req/s (median of rounds) | per round |", "|---:|---:|---|"]
    for conns in connections:
        ratio, per_round = paired_ratio(rows, "three", "one", conns)
        lines.append(f"| 3 x {conns} | {ratio:.3f} | {', '.join(f'{r:.3f}' for r in per_round)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.oip_gateways", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--connections", default="64", help="connections per pipeline (three pipelines)")
    p.add_argument("--duration-s", type=float, default=5.0)
    args = p.parse_args(argv)
    connections = [int(c) for c in args.connections.split(",")]
    top = head(command_line())
    try:
        rows = run(args.rounds, connections, args.duration_s)
    except (ServerError, LoadError) as exc:
        print(f"bench.oip_gateways: {exc}", file=sys.stderr)
        return 1
    end = tail()
    text = render(rows, connections)
    path = save("oip-gateways", {"head": top, "tail": end, "rows": rows, "table": text})
    print(f"{top}\n{args.rounds} interleaved rounds of {args.duration_s:g} s, medians; wrk, one thread per "
          f"pipeline\n\n{text}\n{end}\n\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
