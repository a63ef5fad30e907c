"""What tracing costs: one conveyor with tracing off, one sampling 1 %, one sampling 100 %, measured in
interleaved rounds over HTTP (issue 40's goals: at 256 connections, 1 % at most 2 % fewer req/s, 100 %
at most 15 % fewer).

    python -m bench.traces [--rounds 5] [--connections 256] [--duration-s 5] [--timing-headers] [--base DIR]

Three stacks of this checkout (each its own redis-server, ``conveyor worker`` per stage of the peers'
Scale/Shift pipeline and ``conveyor gateway``), started side by side; the traced ones export to an
OTLP/HTTP receiver on loopback that counts and discards (``tests.otlp_receiver``, no decoding), with
``OTEL_TRACES_SAMPLER=traceidratio`` and ``OTEL_TRACES_SAMPLER_ARG`` 0.01 or 1. Every round measures
each stack, in an order that rotates. Printed: CPU per request of each process group, then each traced
stack's figures as ratios to the untraced one's, per round and their median (``bench.peers.paired``).
``--timing-headers`` also turns the headers on in the traced stacks; ``--base DIR`` adds a fourth
stack sampling 100 % from another checkout (the code before a change), measured in the same rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.peers.load import which_generator
from bench.peers.paired import DEFAULT_RESULTS, _measure, interleaved, render_ratios
from bench.peers.report import cpu_table, save, summarise
from bench.peers.runner import machine
from bench.peers.servers import Conveyor
from tests.otlp_receiver import Receiver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--connections", default="256")
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--timing-headers", action="store_true")
    p.add_argument("--results", type=str, default=str(DEFAULT_RESULTS))
    p.add_argument("--base", type=Path, help="another checkout: a fourth stack, sampling 100 %%, runs its code")
    args = p.parse_args(argv)
    generator = which_generator("auto")
    results = Path(args.results)
    logs = results / "logs"
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with Receiver(discard=True) as receiver:
        def traced(ratio: str) -> dict[str, str]:
            return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_SAMPLER": "traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": ratio}

        extra = ["--timing-headers"] if args.timing_headers else []
        servers: dict[str, Any] = {
            "tracing off": Conveyor(logs / "off"),
            "sampling 1%": Conveyor(logs / "1pct", gateway_args=extra, env=traced("0.01")),
            "sampling 100%": Conveyor(logs / "100pct", gateway_args=extra, env=traced("1")),
        }
        if args.base is not None:
            servers["sampling 100% (base)"] = Conveyor(logs / "100pct-base", gateway_args=extra, env=traced("1"),
                                                       root=args.base.resolve())
        systems = list(servers)
        loads = [int(c) for c in args.connections.split(",")]
        runs = interleaved(servers, loads, args.rounds, args.duration_s,
                           lambda system, load, duration_s: _measure(system, servers, load, duration_s, generator))
        exports = receiver.requests
    rows = summarise(runs)
    m = machine()
    path = save(results / f"traces-{time.strftime('%Y%m%d-%H%M%S')}.json",
                {"mode": "traces", "started": started, "machine": m, "loadgen": generator, "runs": runs,
                 "summary": rows, "timing_headers": args.timing_headers, "base": str(args.base or "")})
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']} (shared); "
          f"{args.rounds} interleaved rounds of {args.duration_s:g} s, medians; load: {generator}; "
          f"{exports} OTLP exports received\n")
    print(cpu_table(rows))
    for system in systems[1:]:
        print()
        print(render_ratios(runs, system, systems[0]))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
