"""Conveyor's own latency: one singleton stage that returns its input, requests one at a time.

    python -m bench.latency [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from gateway import Gateway


async def measure(url: str, total: int) -> list[float]:
    async with Gateway(url, "bench-echo") as gw:
        for i in range(200):  # warm up
            await gw.predict(i)
        latencies = []
        for i in range(total):
            t0 = time.perf_counter()
            await gw.predict(i)
            latencies.append(time.perf_counter() - t0)
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with embedded_redis() as url, workers("bench.pipelines:echo", ["Echo"], url):
        asyncio.run(wait_ready(url, "bench-echo", 1))
        lat = asyncio.run(measure(url, args.requests))
    print(f"{args.requests} sequential requests: p50 {percentile(lat, 0.5) * 1e3:.3f} ms, "
          f"p99 {percentile(lat, 0.99) * 1e3:.3f} ms, p999 {percentile(lat, 0.999) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
