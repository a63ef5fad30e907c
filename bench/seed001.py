"""Seed 001's batching benchmark: 880 requests to a stage whose predict sleeps 0.001*log(n+1) s.

    python -m bench.seed001

Sequential awaits pay the full path per request; all 880 at once share batches of up to 200.
The seed reports 90.9 s and 0.124 s for its in-process queues.
"""

from __future__ import annotations

import asyncio
import time

from bench.harness import embedded_redis, machine, wait_ready, workers
from gateway import Gateway


async def measure(redis_url: str) -> tuple[float, float]:
    data = list(range(880))
    async with Gateway(redis_url, "bench-seed001") as gw:
        await gw.predict(0)  # warm up connections
        t0 = time.perf_counter()
        sequential = [await gw.predict(x) for x in data]
        t1 = time.perf_counter()
        batched = await asyncio.gather(*(gw.predict(x) for x in data))
        t2 = time.perf_counter()
    if not (sequential == list(batched) == [x * x for x in data]):
        raise AssertionError("wrong answers")
    return t1 - t0, t2 - t1


def main() -> None:
    with embedded_redis() as url, workers("bench.pipelines:seed001", ["Square"], url):
        asyncio.run(wait_ready(url, "bench-seed001", 1))
        seq, together = asyncio.run(measure(url))
    print(f"machine: {machine()}")
    print(f"880 sequential awaits: {seq:.3f} s ({seq / 880 * 1000:.2f} ms per request)")
    print(f"880 at once:           {together:.3f} s")
    print(f"ratio:                 {seq / together:.0f}x")


if __name__ == "__main__":
    main()
