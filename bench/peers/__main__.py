"""conveyor against mosec on the same 2-stage pipeline, side by side, in one run.

    python -m bench.peers [--rounds 3] [--connections 1,16,256,1024] [--duration-s 5] [--quick]
    python -m bench.peers --payloads [--sizes 1KiB,64KiB,1MiB,16MiB] [--in-flight 4]

See bench/peers/__init__.py for what is measured and how.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from bench.peers.load import LoadError, which_generator
from bench.peers.report import save
from bench.peers.runner import Runner, RunSettings, parse_sizes
from bench.peers.servers import ServerError
from gateway.http.settings import LOOPS

DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "results"
MISSING = ("mosec is not installed in this environment. Install the benchmark extra:\n"
           "    pip install -e '.[bench]'      (mosec>=0.9.8,<0.10 and matplotlib)\n"
           "or run conveyor alone with --systems conveyor-http,conveyor-python")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians over them")
    p.add_argument("--connections", default="1,16,256,1024", help="HTTP connections (= requests in flight)")
    p.add_argument("--duration-s", type=float, default=5.0, help="length of one measurement")
    p.add_argument("--systems", default="conveyor-http,mosec-http,conveyor-python",
                   help="any of conveyor-http, mosec-http, conveyor-python (payloads add redis-set-get)")
    p.add_argument("--loadgen", choices=("auto", "wrk", "builtin"), default="auto",
                   help="HTTP load generator: wrk if on PATH (auto), else the built-in asyncio client")
    p.add_argument("--payloads", action="store_true", help="the payload benchmark (numpy float32 arrays)")
    p.add_argument("--sizes", default=None, help="array sizes for --payloads (default 1KiB,64KiB,1MiB,16MiB)")
    p.add_argument("--in-flight", type=int, default=4, help="requests in flight for --payloads")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `conveyor gateway` (repeat), e.g. --gateway-arg=--processes=2")
    p.add_argument("--api-loop", choices=LOOPS, default="auto",
                   help="the Python API's event loop (auto: uvloop where installed, as `conveyor gateway --loop`)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where the JSON results go")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 s, small loads and sizes")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.duration_s = 1, 1.0
        args.connections = "1,16"
        args.sizes = args.sizes or "1KiB,1MiB"
    args.sizes = args.sizes or "1KiB,64KiB,1MiB,16MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "mosec-http" in systems and importlib.util.find_spec("mosec") is None:
        print(MISSING, file=sys.stderr)
        return 2
    try:
        generator = which_generator(args.loadgen)
    except LoadError as exc:
        print(exc, file=sys.stderr)
        return 2
    mode = "payloads" if args.payloads else "peers"
    settings = RunSettings(mode=mode, systems=systems, rounds=args.rounds, duration_s=args.duration_s,
                           connections=[int(c) for c in args.connections.split(",")],
                           sizes=parse_sizes(args.sizes), in_flight=args.in_flight, generator=generator,
                           gateway_args=list(args.gateway_arg), log_dir=args.results / "logs", api_loop=args.api_loop)
    runner = Runner(settings)
    try:
        document = runner.run()
    except (ServerError, LoadError) as exc:
        print(f"bench.peers: {exc}", file=sys.stderr)
        return 1
    path = save(args.results / f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}.json", document)
    print(runner.render(document))
    print(f"\nresults: {path}\nplots:   python -m bench.plot {args.results} --out docs/img --name NAME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
