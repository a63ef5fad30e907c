"""Throughput and latency of the Scale/Shift pipeline (batch 64, wait 2 ms, 1 worker each).

    python -m bench.scale_shift [--requests N] [--in-flight 1,64,1024]

For each concurrency level, that many client coroutines on one gateway each send requests one
after another (a closed loop) until N requests are answered; reports req/s and p50/p99/p999.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from gateway import Gateway


async def level(gw: Gateway, in_flight: int, total: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    counter = iter(range(total))

    async def client() -> None:
        for x in counter:
            t0 = time.perf_counter()
            y = await gw.predict(x)
            latencies.append(time.perf_counter() - t0)
            if y != x * 2 + 3:
                raise AssertionError(f"{x} -> {y}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    return total / (time.perf_counter() - t0), sorted(latencies)


async def run(url: str, levels: list[int], total: int) -> None:
    async with Gateway(url, "bench-scale-shift") as gw:
        await level(gw, 64, 2000)  # warm up
        print(f"{'in flight':>9} {'requests':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p999 ms':>8}")
        for n in levels:
            count = total if n > 1 else min(total, 5000)
            rate, lat = await level(gw, n, count)
            print(f"{n:>9} {count:>9} {rate:>9.0f} {percentile(lat, 0.5) * 1e3:>8.2f} "
                  f"{percentile(lat, 0.99) * 1e3:>8.2f} {percentile(lat, 0.999) * 1e3:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--in-flight", default="1,64,1024")
    args = parser.parse_args()
    levels = [int(v) for v in args.in_flight.split(",")]
    print(f"machine: {machine()}")
    with embedded_redis() as url, workers("bench.pipelines:scale_shift", ["Scale", "Shift"], url):
        asyncio.run(wait_ready(url, "bench-scale-shift", 2))
        asyncio.run(run(url, levels, args.requests))


if __name__ == "__main__":
    main()
