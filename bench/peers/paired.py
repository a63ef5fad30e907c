"""Two checkouts of conveyor (and mosec) at once, measured in interleaved rounds: a change's effect.

    git worktree add --detach /tmp/conveyor-base <commit>
    python -m bench.peers.paired --base /tmp/conveyor-base [--rounds 5] [--connections 256] [--no-mosec]
    python -m bench.peers.paired --api --base . --base-worker-arg=--no-read-ahead   # a worker switch, on/off
    python -m bench.peers.paired --base . --base-gateway-arg=--no-batch-entries     # a gateway switch
    python -m bench.peers.paired --base /tmp/conveyor-base --no-mosec --body null   # every request fails

Both conveyors (their own redis-server, gateway and workers, started from each checkout's code)
and mosec run side by side; every round measures each of them at each load, in an order that
rotates, so the shared machine's noise falls on all of them alike. ``--body`` is the JSON every
HTTP request sends (``3`` by default; ``null`` fails in the first stage, ``None * 2``: a storm of
bad requests, each answered 422 with its stage's error). Printed: the peers table
rows, CPU microseconds per request of each process group, Redis commands per request and time
per command (``bench.peers.report``), then this checkout's figures as ratios to the base's,
per round and their median (a ratio within one round is the paired figure).

``--api`` drives each conveyor through its Python API (``Gateway.predict`` in this process, as
``bench.peers``'s conveyor-python) instead of HTTP; that gateway is this checkout's code for both,
so use it where the two differ in their workers (``--base-worker-arg``, or another checkout whose
gateway is the same); of ``--base-gateway-arg`` it understands ``--no-batch-entries`` (the base's
``GatewaySettings.batch_entries``). mosec is still driven over HTTP.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peers import inproc
from bench.peers.load import LoadResult, run_http, which_generator
from bench.peers.report import cpu_table, redis_table, save, summarise
from bench.peers.runner import machine, metered
from bench.peers.servers import PIPELINE_NAME, ROOT, Conveyor, Mosec
from gateway.http.settings import LOOPS
from gateway.serve import run_loop

MOSEC = "mosec"
DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "results"


Measure = Callable[[str, int, float], dict[str, Any]]  # (system, connections, seconds): its row


def interleaved(servers: dict[str, Any], loads: list[int], rounds: int, duration_s: float,
                measure: Measure) -> list[dict[str, Any]]:
    """Start ``servers``, warm each up, then measure every system at every load in ``rounds`` rounds whose
    order of systems rotates (a shared machine's noise spreads over all of them); stop them. The rows,
    each with its round, system and load."""
    systems = list(servers)
    runs: list[dict[str, Any]] = []
    try:
        for server in servers.values():
            server.start()
        for system in systems:  # warm-up, not recorded
            measure(system, 64, 1.0)
        step = 0
        for rnd in range(1, rounds + 1):
            for load in loads:
                k = step % len(systems)
                for system in systems[k:] + systems[:k]:
                    row = measure(system, load, duration_s)
                    row.update(round=rnd, system=system, connections=load)
                    runs.append(row)
                    print(f"round {rnd} {system} @ {load}: {row['rps']:,.0f} req/s, {row['errors']} errors",
                          file=sys.stderr, flush=True)
                step += 1
    finally:
        for server in servers.values():
            server.stop()
    return runs


def _measure(system: str, servers: dict[str, Any], connections: int, duration_s: float,
             generator: str, api: bool = False, api_loop: str = "auto", body: bytes = b"3") -> dict[str, Any]:
    server = servers[system]
    if api and system != MOSEC:
        batch_entries = "--no-batch-entries" not in server.gateway_args
        return metered(server.processes(gateway_in_process=True), lambda start: run_loop(inproc.gateway_api(
            server.redis_url, PIPELINE_NAME, 3, connections, duration_s, warmup_s=0.5, started=start,
            batch_entries=batch_entries), api_loop), server.redis_url)
    path = "/inference" if system == MOSEC else "/v1/predict"
    groups = server.processes()

    def work(start: Callable[[], None]) -> LoadResult:
        start()
        return run_http(generator, "127.0.0.1", server.port, path, body, "application/json", connections, duration_s)

    return metered(groups, work, None if system == MOSEC else server.redis_url)


def _redis_us(row: dict[str, Any]) -> float:
    return float(row.get("cpu_us_per_request", {}).get("redis", float("nan")))


def _workers_us(row: dict[str, Any]) -> float:
    return sum(v for k, v in row.get("cpu_us_per_request", {}).items() if k.startswith("worker"))


def _gateway_us(row: dict[str, Any]) -> float:
    cpu = row.get("cpu_us_per_request", {})
    return float(cpu.get("gateway", cpu.get("gateway (bench process)", float("nan"))))


FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "req/s": lambda row: float(row["rps"]),
    "Redis CPU us/req": _redis_us,
    "workers CPU us/req": _workers_us,
    "gateway CPU us/req": _gateway_us,
    "all CPU us/req": lambda row: float(row["cpu_ms_per_request"]) * 1000,
    "Redis commands/req": lambda row: float(row.get("redis_commands_per_request", float("nan"))),
}


def ratios(runs: list[dict[str, Any]], a: str, b: str) -> dict[str, list[float]]:
    """Per figure, ``a / b`` within each (round, load): the paired ratios."""
    out: dict[str, list[float]] = {name: [] for name in FIGURES}
    keyed = {(r["round"], r["connections"], r["system"]): r for r in runs}
    for (rnd, load, system), run in keyed.items():
        other = keyed.get((rnd, load, b))
        if system != a or other is None:
            continue
        one, two = summarise([run])[0], summarise([other])[0]
        for name, figure in FIGURES.items():
            x, y = figure(one), figure(two)
            if y and y == y and x == x:
                out[name].append(x / y)
    return out


def render_ratios(runs: list[dict[str, Any]], a: str, b: str) -> str:
    lines = [f"| {a} / {b} | median | per round |", "|---|---:|---|"]
    for name, values in ratios(runs, a, b).items():
        if values:
            lines.append(f"| {name} | {statistics.median(values):.3f} | {', '.join(f'{v:.2f}' for v in values)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.paired", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--connections", default="256")
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--no-mosec", action="store_true")
    p.add_argument("--api", action="store_true", help="conveyor through its Python API (see above), not HTTP")
    p.add_argument("--api-loop", choices=LOOPS, default="auto",
                   help="with --api, the event loop (auto: uvloop where installed, as `conveyor gateway --loop`)")
    p.add_argument("--base-worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the base's `conveyor worker` (repeat), e.g. --no-read-ahead")
    p.add_argument("--base-gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the base's `conveyor gateway` (repeat), e.g. --no-batch-entries")
    p.add_argument("--body", default="3", help="the JSON each HTTP request sends (null: every request fails)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = p.parse_args(argv)
    if args.api and args.body != "3":
        p.error("--body is what HTTP requests send; with --api each conveyor is driven through its Python API")
    body = args.body.encode()
    generator = which_generator("auto")
    logs = args.results / "logs"
    kind = "API" if args.api else "HTTP"
    base, this = f"conveyor {kind} (base)", f"conveyor {kind} (this)"
    servers: dict[str, Any] = {base: Conveyor(logs / "base", gateway_args=args.base_gateway_arg,
                                              worker_args=args.base_worker_arg, root=args.base.resolve()),
                               this: Conveyor(logs / "this")}
    if not args.no_mosec:
        servers[MOSEC] = Mosec(logs)
    loads = [int(c) for c in args.connections.split(",")]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = interleaved(servers, loads, args.rounds, args.duration_s,
                       lambda system, load, duration_s: _measure(system, servers, load, duration_s, generator,
                                                                 args.api, args.api_loop, body))
    rows = summarise(runs)
    m = machine()
    path = save(args.results / f"paired-{time.strftime('%Y%m%d-%H%M%S')}.json",
                {"mode": "paired", "started": started, "machine": m, "base": str(args.base), "this": str(ROOT),
                 "api": args.api, "body": args.body, "base_worker_args": args.base_worker_arg,
                 "base_gateway_args": args.base_gateway_arg,
                 "loadgen": generator, "runs": runs, "summary": rows})
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']} (shared); "
          f"{args.rounds} interleaved rounds of {args.duration_s:g} s, medians; load: {generator}, body {args.body}\n"
          f"base: {args.base} {' '.join(args.base_worker_arg + args.base_gateway_arg)}   this: {ROOT}\n")
    print(cpu_table(rows))
    print()
    print(redis_table(rows, "connections"))
    print()
    print(render_ratios(runs, this, base))
    if not args.no_mosec:
        print()
        print(render_ratios(runs, this, MOSEC))
        print()
        print(render_ratios(runs, base, MOSEC))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
