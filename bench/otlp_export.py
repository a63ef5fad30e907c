"""What one span export costs the exporting process, by the number of spans it carries: why
conveyor sends 16,384 spans an export by default (``broker.tracing.EXPORT_BATCH``) where the SDK sends 512.

    python -m bench.otlp_export [--sizes 512,4096,16384] [--posts 20]

Each size: ``--posts`` exports of that many stage-sized spans through the SDK's OTLP/HTTP exporter's
client (as :func:`broker.tracing.start_sink` uses it) to a receiver on loopback in this process that
discards them; printed: this thread's CPU per export and per span, and the encoding's per span.
"""

from __future__ import annotations

import argparse
import os
import time

from broker import otlp, tracing
from tests.otlp_receiver import Receiver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.otlp_export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,4096,16384")
    p.add_argument("--posts", type=int, default=20)
    args = p.parse_args(argv)
    tail = otlp.head("Scale predict") + otlp.string_prefixes("conveyor.request.id")[20] + b"r" * 20
    span = otlp.span(os.urandom(16), os.urandom(8), os.urandom(8), time.time_ns(), time.time_ns(), tail)
    with Receiver(discard=True) as receiver:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint  # the SDK's exporter reads its own
        sink = tracing.start_sink("bench", os.environ)
        send = sink._send  # the exporter's client's export(bytes)
        print(f"span: {len(span)} bytes\n\n| spans an export | CPU ms an export | us a span: export | encoding |")
        print("|---:|---:|---:|---:|")
        for size in (int(s) for s in args.sizes.split(",")):
            spans = [bytes(span) for _ in range(size)]
            send(otlp.export_request({"service.name": "bench"}, "conveyor", spans))  # the connection is open
            began = time.thread_time()
            for _ in range(args.posts):
                send(otlp.export_request({"service.name": "bench"}, "conveyor", spans))
            took = (time.thread_time() - began) / args.posts
            began = time.thread_time()
            for _ in range(args.posts):
                otlp.export_request({"service.name": "bench"}, "conveyor", spans)
            encoding = (time.thread_time() - began) / args.posts
            print(f"| {size:,} | {took * 1e3:.2f} | {took / size * 1e6:.3f} | {encoding / size * 1e6:.3f} |")
        sink.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
