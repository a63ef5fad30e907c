"""What a ``/metrics`` scrape costs the gateway's event loop.

    python -m bench.metrics_scrape [--tries 5] [--pipelines 50]

1. The most batches a gateway's view holds for one stage (``gateway.client.view.MAX_HELD_BATCHES``), fed to
   the metrics as a scrape does: CPU seconds with conveyor's counts (:mod:`gateway.monitor.batch_metrics`)
   against prometheus-client's `Histogram` observed per batch (what it replaced), and a bare bisect per batch.
2. A scrape of ``--pipelines`` pipelines of three busy stages: the longest the event loop went without a
   turn while the text was written, and the text's size.
Best of ``--tries`` for each figure (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from gateway.client.view import MAX_HELD_BATCHES
from gateway.monitor.metrics import BATCH_DURATION_BUCKETS, BATCH_SIZE_BUCKETS, Metrics
from gateway.monitor.status import PipelineStatus, StageStatus
from tests.metrics_statuses import NoBackend, Served, busy_pipeline


def _cpu_s(work: Callable[[], object], tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best


def held_batches(tries: int) -> None:
    rng = random.Random(3)
    held = [(1, rng.randrange(20, 90) / 1e6) for _ in range(MAX_HELD_BATCHES)]

    def counts() -> None:
        Metrics(NoBackend()).update({"p": PipelineStatus(True, [StageStatus(0, "s", live_workers=1, batches=held)])})

    def histograms() -> None:
        registry = CollectorRegistry()
        size = Histogram("size", "", ("pipeline", "index", "stage"), buckets=BATCH_SIZE_BUCKETS, registry=registry)
        duration = Histogram("duration", "", ("pipeline", "index", "stage"), buckets=BATCH_DURATION_BUCKETS,
                             registry=registry)
        for n, seconds in held:
            size.labels("p", "0", "s").observe(n)
            duration.labels("p", "0", "s").observe(seconds)

    def bisects() -> None:
        for _, seconds in held:
            bisect_left(BATCH_DURATION_BUCKETS, seconds)

    print(f"{MAX_HELD_BATCHES:,} held batches of one stage, CPU s (best of {tries}):")
    for name, work in (("conveyor's counts", counts), ("prometheus-client Histogram", histograms),
                       ("a bare bisect each", bisects)):
        print(f"  {name}: {_cpu_s(work, tries):.3f}")


async def _longest_stall(pipelines: int) -> tuple[float, int]:
    metrics = Metrics(Served({f"p-{n}": busy_pipeline(3) for n in range(pipelines)}))
    longest, last, scraping = 0.0, time.perf_counter(), True

    async def turning() -> None:
        nonlocal longest, last
        while scraping:
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
            await asyncio.sleep(0)

    turner = asyncio.create_task(turning())
    await asyncio.sleep(0)
    try:
        text = await metrics.scrape(openmetrics=True)
    finally:
        scraping = False
        await turner
    return longest, len(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.metrics_scrape", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=5)
    p.add_argument("--pipelines", type=int, default=50)
    args = p.parse_args(argv)
    held_batches(args.tries)
    stalls = [asyncio.run(_longest_stall(args.pipelines)) for _ in range(args.tries)]
    print(f"a scrape of {args.pipelines} pipelines x 3 stages (OpenMetrics, {stalls[0][1]:,} bytes): the loop's "
          f"longest stall {min(s for s, _ in stalls) * 1000:.1f} ms (best of {args.tries})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
