"""Seed 000's example as conveyor ships it (examples/scale_shift.py): a singleton ``Scale`` with
two workers, then a batched ``Shift``; 2,000 requests at once.

    python -m bench.seed000 [--rounds 5] [--requests 2000]

Prints req/s per round and the CPU seconds each Scale worker spent (both must be busy: a singleton
stage reads a share of its queue per XREADGROUP, not the whole queue and not one entry). For scale,
the same bursts run interleaved against the same work with both stages batched (batch 64, one
worker each): on a shared machine, the ratio between the two is the figure to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psutil

from bench.harness import embedded_redis, machine, wait_ready, workers
from gateway import Gateway

NAME = "scale-shift"
BATCHED = "bench-scale-shift"


async def burst(gw: Gateway, total: int) -> float:
    t0 = time.perf_counter()
    ys = await asyncio.gather(*(gw.predict(x) for x in range(total)))
    elapsed = time.perf_counter() - t0
    if list(ys) != [x * 2 + 3 for x in range(total)]:
        raise AssertionError("wrong answers")
    return total / elapsed


def cpu_seconds(procs: list[psutil.Process]) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in procs]


async def run(url: str, rounds: int, total: int,
              scale_workers: list[psutil.Process]) -> tuple[list[float], list[float], list[float]]:
    rates: list[float] = []
    batched: list[float] = []
    cpu = [0.0] * len(scale_workers)
    async with Gateway(url, NAME) as gw, Gateway(url, BATCHED) as reference:
        await burst(gw, 500)  # warm up
        await burst(reference, 500)
        for _ in range(rounds):
            before = cpu_seconds(scale_workers)
            rates.append(await burst(gw, total))
            cpu = [c + a - b for c, a, b in zip(cpu, cpu_seconds(scale_workers), before, strict=True)]
            batched.append(await burst(reference, total))
    return rates, batched, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with embedded_redis() as url, workers("examples.scale_shift:pipeline", [("Scale", 2), "Shift"], url) as procs, \
            workers("bench.pipelines:scale_shift", ["Scale", "Shift"], url):
        asyncio.run(wait_ready(url, NAME, 2))
        asyncio.run(wait_ready(url, BATCHED, 2))
        deadline = time.monotonic() + 30
        scale_workers = psutil.Process(procs[0].pid).children()
        while len(scale_workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            scale_workers = psutil.Process(procs[0].pid).children()
        rates, batched, cpu = asyncio.run(run(url, args.rounds, args.requests, scale_workers))
    print(f"{args.requests} at once, req/s per round: {' '.join(f'{r:.0f}' for r in rates)}")
    ratio = statistics.median(rates) / statistics.median(batched)
    print(f"same work, both stages batched:    {' '.join(f'{r:.0f}' for r in batched)}  (median "
          f"{statistics.median(batched):.0f}; seed 000 / batched = {ratio:.2f})")
    print(f"median {statistics.median(rates):.0f} req/s, best {max(rates):.0f}; goal >= 10,000: "
          f"{'met' if statistics.median(rates) >= 10_000 else 'NOT met'} (median)")
    print(f"CPU seconds per Scale worker over the rounds: {' '.join(f'{c:.2f}' for c in cpu)}")


if __name__ == "__main__":
    main()
