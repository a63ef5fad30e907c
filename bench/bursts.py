"""Which worker takes a request: the hot-worker preference and burst sharing (workers/batching/handoff.py).

Two workers of one stage that sleeps a few milliseconds per batch (``bench.pipelines:who_runs``)
and answers the pid that ran it. Two measures:

- at 1 in flight, the share of requests taken by the worker that ran the one before (1.0: the hot
  worker keeps serving; about 0.5: they take turns, each on caches gone cold);
- bursts of ``--burst`` requests sent together, the share of bursts that ran on both workers
  (before sharing, the worker first in line read each burst whole).

Its batch costs the same at any size, so the rate printed shows only what the hand-over costs.

Usage: ``python -m bench.hot_worker [--requests 300] [--bursts 50] [--burst 4]``. Compare runs on one
machine at one time: a loaded machine is where the order of reads and commits shows.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

from bench.harness import embedded_redis, machine, wait_ready, workers
from gateway import Gateway

APP = "bench.pipelines:who_runs"
NAME = "bench-who-runs"


async def _measure(url: str, requests: int, bursts: int, burst: int, model_s: float) -> None:
    async with Gateway(url, NAME) as gw:
        for _ in range(20):  # each worker learns its peer at its next heartbeat (1 s)
            await gw.predict(model_s, timeout_s=10)
        await asyncio.sleep(1.5)
        pids = [await gw.predict(model_s, timeout_s=10) for _ in range(requests)]
        same = sum(a == b for a, b in itertools.pairwise(pids))
        print(f"1 in flight: same worker as the request before {same}/{len(pids) - 1} = {same / (len(pids) - 1):.3f}")
        spread = 0
        started = time.perf_counter()
        for _ in range(bursts):
            ran = await asyncio.gather(*(gw.predict(model_s * 5, timeout_s=10) for _ in range(burst)))
            spread += len(set(ran)) > 1
        rate = bursts * burst / (time.perf_counter() - started)
        print(f"bursts of {burst}: on both workers {spread}/{bursts} = {spread / bursts:.3f}, {rate:.0f} requests/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--bursts", type=int, default=50)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--model-ms", type=float, default=3.0, help="the stage's sleep per batch at 1 in flight "
                        "(bursts sleep 5x that)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with embedded_redis() as url, workers(APP, ["WhoRuns"], url):
        asyncio.run(wait_ready(url, NAME, 1, min_workers={"WhoRuns": 2}))
        asyncio.run(_measure(url, args.requests, args.bursts, args.burst, args.model_ms / 1000))


if __name__ == "__main__":
    main()
