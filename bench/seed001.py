"""Seed 001's batching benchmark: 880 requests to a stage whose predict sleeps 0.001*log(n+1) s.

    python -m bench.seed001 [--rounds 3]

Sequential awaits pay the full path per request; all 880 at once share batches of up to 200.
The seed reports 90.9 s and 0.124 s for its in-process queues. The adaptive policy (default)
and the deadline policy run side by side on one Redis, taking turns per round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack

from bench.harness import embedded_redis, machine, wait_ready, workers
from gateway import Gateway

PIPELINES = {"adaptive": ("bench-seed001", "seed001"), "deadline": ("bench-seed001-deadline", "seed001_deadline")}


async def measure(gw: Gateway) -> tuple[float, float]:
    data = list(range(880))
    t0 = time.perf_counter()
    sequential = [await gw.predict(x) for x in data]
    t1 = time.perf_counter()
    batched = await asyncio.gather(*(gw.predict(x) for x in data))
    t2 = time.perf_counter()
    if not (sequential == list(batched) == [x * x for x in data]):
        raise AssertionError("wrong answers")
    return t1 - t0, t2 - t1


async def run(url: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {label: [] for label in PIPELINES}
    gateways = {label: Gateway(url, name) for label, (name, _) in PIPELINES.items()}
    try:
        for gw in gateways.values():
            await gw.start()
            await gw.predict(0)  # warm up connections
        for r in range(rounds):
            order = list(PIPELINES) if r % 2 == 0 else list(reversed(PIPELINES))
            for label in order:
                results[label].append(await measure(gateways[label]))
    finally:
        for gw in gateways.values():
            await gw.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with embedded_redis() as url, ExitStack() as stack:
        for _name, attribute in PIPELINES.values():
            stack.enter_context(workers(f"bench.pipelines:{attribute}", ["Square"], url))
        for name, _ in PIPELINES.values():
            asyncio.run(wait_ready(url, name, 1))
        results = asyncio.run(run(url, args.rounds))
    print(f"{'policy':<9} {'880 sequential s':>17} {'ms/request':>11} {'880 at once s':>14}"
          f"   (median of {args.rounds})")
    for label, rows in results.items():
        seq = statistics.median(r[0] for r in rows)
        together = statistics.median(r[1] for r in rows)
        print(f"{label:<9} {seq:>17.3f} {seq / 880 * 1000:>11.2f} {together:>14.3f}")
    seq = statistics.median(r[0] for r in results["adaptive"])
    together = statistics.median(r[1] for r in results["adaptive"])
    print(f"goals (adaptive): sequential <= 1.5 s: {'met' if seq <= 1.5 else 'NOT met'}; "
          f"at once <= 0.07 s: {'met' if together <= 0.07 else 'NOT met'}")


if __name__ == "__main__":
    main()
