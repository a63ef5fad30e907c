"""Bursts shared with idle peers (workers/batching/sharing.py): on and off, paired.

Two pipelines, each a stage of two workers that sleeps a few milliseconds per item
(``bench.pipelines:who_runs``, sharing on, and ``who_runs_unshared``, ``share_bursts=False``) and
answers the pid of the worker that ran it. Bursts of ``--burst`` requests sent together, after a
quiet spell (``--quiet-ms``: every worker blocked, none busy), alternate between the two pipelines;
for each: the share of bursts that ran on both workers, and the median time to answer a burst.
Its cost is per item, as a one-thread model's: a burst run on both workers is answered in about half the time.

Usage: ``python -m bench.bursts [--bursts 50] [--burst 4] [--model-ms 15] [--quiet-ms 300]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.harness import embedded_redis, machine, wait_ready, workers
from gateway import Gateway

PIPELINES = {"shared": ("bench.pipelines:who_runs", "bench-who-runs"),
             "unshared": ("bench.pipelines:who_runs_unshared", "bench-who-runs-unshared")}


async def _measure(url: str, bursts: int, burst: int, model_s: float, quiet_s: float) -> None:
    async with Gateway(url, PIPELINES["shared"][1]) as shared, Gateway(url, PIPELINES["unshared"][1]) as unshared:
        gateways = {"shared": shared, "unshared": unshared}
        spread = {name: 0 for name in gateways}
        took: dict[str, list[float]] = {name: [] for name in gateways}
        for _ in range(bursts):
            for name, gw in gateways.items():
                await asyncio.sleep(quiet_s)  # the quiet spell: every worker blocked, none busy
                started = time.perf_counter()
                ran = await asyncio.gather(*(gw.predict(model_s, timeout_s=10) for _ in range(burst)))
                took[name].append(time.perf_counter() - started)
                spread[name] += len(set(ran)) > 1
        for name in gateways:
            print(f"{name:>8}: bursts of {burst} on both workers {spread[name]}/{bursts} = "
                  f"{spread[name] / bursts:.3f}, median {statistics.median(took[name]) * 1000:.1f} ms per burst")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=50)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--model-ms", type=float, default=15.0, help="the stage's sleep per item")
    parser.add_argument("--quiet-ms", type=float, default=300.0, help="the pause before each burst")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    apps = [app for app, _ in PIPELINES.values()]
    with embedded_redis() as url, workers(apps[0], ["WhoRuns"], url), workers(apps[1], ["WhoRuns"], url):
        for _, name in PIPELINES.values():
            asyncio.run(wait_ready(url, name, 1, min_workers={"WhoRuns": 2}))
        asyncio.run(_measure(url, args.bursts, args.burst, args.model_ms / 1000, args.quiet_ms / 1000))


if __name__ == "__main__":
    main()
