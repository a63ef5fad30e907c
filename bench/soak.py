"""Soak: a million requests through Scale/Shift (2 stages, batch 64); memory must stay flat.

    python -m bench.soak [--requests 1000000] [--in-flight 1024] [--every 50000]

One gateway keeps ``--in-flight`` requests going (a closed loop: each client coroutine sends
its next request when the last is answered) against real ``conveyor worker`` processes on an
embedded Redis. Every ``--every`` answers it samples Redis's ``used_memory`` (INFO memory), the
number of keys (DBSIZE), the stage streams' lengths and this process's RSS (the gateway's), and
prints a row. At the end it compares the last sample with the first one taken after warm-up
and exits non-zero if either memory grew by more than ``--tolerance`` (default 10 %).

Every answer is checked (f(x) = 2 x + 3). Latencies go into an array allocated up front, so
that the measurement itself does not grow the RSS it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import numpy as np
import psutil
import redis.asyncio as aredis

from bench.harness import embedded_redis, machine, wait_ready, workers
from broker.keys import Keys
from gateway import Gateway, GatewaySettings

PIPELINE = "bench-scale-shift"


@dataclass
class Sample:
    answered: int
    elapsed_s: float
    rate: float
    p50_ms: float
    p99_ms: float
    redis_mib: float
    keys: int
    backlog: int
    rss_mib: float


async def soak(url: str, total: int, in_flight: int, every: int) -> list[Sample]:
    latencies = np.full(total, np.nan)  # touched now: its pages are in the RSS from the first sample
    keys = Keys(PIPELINE)
    me = psutil.Process()
    admin = aredis.Redis.from_url(url)
    samples: list[Sample] = []
    answered = 0
    inputs = iter(range(total))
    next_sample = every
    window_started = started = time.perf_counter()
    sampling = asyncio.Lock()

    async def sample() -> None:
        nonlocal window_started
        async with sampling:
            now = time.perf_counter()
            window = latencies[max(0, answered - every):answered]
            memory = await admin.info("memory")
            backlog = sum([await admin.xlen(keys.stream(i)) for i in (0, 1)])
            samples.append(Sample(
                answered, now - started, every / (now - window_started),
                float(np.nanpercentile(window, 50)) * 1e3, float(np.nanpercentile(window, 99)) * 1e3,
                int(memory["used_memory"]) / 2**20, int(await admin.dbsize()), backlog,
                me.memory_info().rss / 2**20))
            window_started = now
            print_row(samples[-1])

    async with Gateway(url, PIPELINE, GatewaySettings(timeout_s=60)) as gw:
        async def client() -> None:
            nonlocal answered, next_sample
            for x in inputs:
                t0 = time.perf_counter()
                y = await gw.predict(x)
                latencies[answered] = time.perf_counter() - t0
                answered += 1
                if y != 2 * x + 3:
                    raise AssertionError(f"wrong answer for {x}: {y}")
                if answered >= next_sample:
                    next_sample += every
                    await sample()

        try:
            await asyncio.gather(*(client() for _ in range(in_flight)))
        finally:
            await admin.aclose()
    elapsed = time.perf_counter() - started
    print(f"\n{total} requests in {elapsed:.1f} s: {total / elapsed:.0f} req/s; latency p50 "
          f"{np.percentile(latencies, 50) * 1e3:.2f} ms, p99 {np.percentile(latencies, 99) * 1e3:.2f} ms, "
          f"p999 {np.percentile(latencies, 99.9) * 1e3:.2f} ms")
    return samples


def print_row(s: Sample) -> None:
    print(f"{s.answered:>9} {s.elapsed_s:>8.1f} {s.rate:>8.0f} {s.p50_ms:>7.2f} {s.p99_ms:>7.2f} "
          f"{s.redis_mib:>10.2f} {s.keys:>6} {s.backlog:>7} {s.rss_mib:>9.1f}", flush=True)


def verdict(samples: list[Sample], tolerance: float) -> bool:
    """Flat: the last sample within ``tolerance`` of the first after warm-up (the second sample)."""
    if len(samples) < 3:
        print("too few samples to judge")
        return False
    base, last = samples[1], samples[-1]
    ok = True
    for name, first, end in (("Redis used_memory", base.redis_mib, last.redis_mib),
                             ("gateway RSS", base.rss_mib, last.rss_mib)):
        peak = max(getattr(s, "redis_mib" if name.startswith("Redis") else "rss_mib") for s in samples[1:])
        growth = (end - first) / first
        flat = growth <= tolerance
        ok = ok and flat
        print(f"{name}: {first:.2f} MiB at {base.answered} requests, {end:.2f} MiB at {last.answered} "
              f"(peak {peak:.2f}): {growth:+.1%} -> {'flat' if flat else 'GROWING'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--in-flight", type=int, default=1024)
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"soak: {args.requests} requests, {args.in_flight} in flight, pipeline {PIPELINE} (batch 64, 1 worker each)")
    print(f"{'answered':>9} {'time s':>8} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'redis MiB':>10} {'keys':>6} {'backlog':>7} {'gw RSS MiB':>9}")
    with embedded_redis() as url, workers("bench.pipelines:scale_shift", ["Scale", "Shift"], url):
        asyncio.run(wait_ready(url, PIPELINE, 2))
        samples = asyncio.run(soak(url, args.requests, args.in_flight, args.every))
    sys.exit(0 if verdict(samples, args.tolerance) else 1)


if __name__ == "__main__":
    main()
