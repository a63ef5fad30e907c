"""Priorities at saturation: 256 requests in flight at the default level and a 5 % stream of priority 1.

    python -m bench.priorities [--rounds 3] [--duration-s 10] [--connections 256] [--share 0.05]

Scale -> Shift (examples/scale_shift.py's stages and settings) as two pipelines on one embedded
Redis, their workers all running: ``bench-prio`` with ``priority_levels=2`` and ``bench-flat``
without levels. Through the Python API (``Gateway.predict``, in this process), each round measures,
in turn:

- **idle**: priority-1 requests one at a time on ``bench-prio`` (nothing else in flight): their p99;
- **flat** (today's behaviour): on ``bench-flat``, 256 closed-loop callers at the default level and an
  open-loop stream of priority-1 requests at ``share`` of the round's first flat throughput, which a
  pipeline without levels serves at the default level (Triton's rule): the stream's p99 and the
  default level's throughput;
- **levels**: the same load on ``bench-prio``, where the stream is served first at every stage.

Printed per round and as medians: the stream's p99 in each, levels p99 / idle p99 (the goal: at
most 2), and the default level's throughput levels / flat (the goal: at least 0.95). Both loaded
runs carry the same extra stream, so the throughput ratio is the price of the priority machinery.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from examples.scale_shift import Scale, Shift
from gateway import Gateway
from workers import Pipeline

CORES = [0, 1]
with_levels = Pipeline("bench-prio", priority_levels=2).add(Scale, workers=2, cpus=CORES).add(Shift)
flat = Pipeline("bench-flat").add(Scale, workers=2, cpus=CORES).add(Shift)


async def idle_p99(gw: Gateway, total: int) -> float:
    latencies = []
    for x in range(total):
        t0 = time.perf_counter()
        assert await gw.predict(x, priority=1) == x * 2 + 3
        latencies.append(time.perf_counter() - t0)
    return percentile(sorted(latencies), 0.99)


async def saturated(gw: Gateway, connections: int, duration_s: float, stream_rate: float) -> tuple[float, float, int]:
    """The default level's throughput (closed loop), and the p99 and count of the priority-1 stream."""
    stop = time.perf_counter() + duration_s
    done = 0
    stream: list[float] = []

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await gw.predict(3)
            done += 1

    async def one(t0: float) -> None:
        await gw.predict(5, priority=1)
        stream.append(time.perf_counter() - t0)

    async def feed() -> None:
        tasks = []
        if stream_rate <= 0:
            return
        interval, next_at = 1.0 / stream_rate, time.perf_counter() + 0.5  # after the callers fill the stages
        while next_at < stop:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(time.perf_counter())))
            next_at += interval
        await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    await asyncio.gather(feed(), *(caller() for _ in range(connections)))
    return done / (time.perf_counter() - t0), percentile(sorted(stream), 0.99), len(stream)


async def run(url: str, rounds: int, duration_s: float, connections: int, share: float, idle_total: int) -> None:
    async with Gateway(url, "bench-prio") as prio, Gateway(url, "bench-flat") as plain:
        await saturated(plain, connections, 2.0, 0)  # warm up both
        await saturated(prio, connections, 2.0, 0)
        rate = 0.0
        rows = []
        for r in range(rounds):
            idle = await idle_p99(prio, idle_total)
            flat_tput, flat_p99, _ = await saturated(plain, connections, duration_s, rate * share)
            rate = rate or flat_tput
            if r == 0:  # the first flat run set the stream's rate: measured again with the stream
                flat_tput, flat_p99, _ = await saturated(plain, connections, duration_s, rate * share)
            tput, p99, n = await saturated(prio, connections, duration_s, rate * share)
            rows.append((idle, flat_p99, p99, flat_tput, tput))
            print(f"round {r + 1}: stream {rate * share:.0f}/s ({n} requests): p99 idle {idle * 1e3:.2f} ms, "
                  f"flat {flat_p99 * 1e3:.1f} ms, levels {p99 * 1e3:.2f} ms (x{p99 / idle:.2f} idle); default level "
                  f"{flat_tput:.0f}/s flat, {tput:.0f}/s levels (x{tput / flat_tput:.3f})", flush=True)
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"median of {rounds}: p99 idle {med[0] * 1e3:.2f} ms, flat (today) {med[1] * 1e3:.1f} ms, levels "
              f"{med[2] * 1e3:.2f} ms; levels/idle x{statistics.median(r[2] / r[0] for r in rows):.2f}; default "
              f"throughput flat {med[3]:.0f}/s, levels {med[4]:.0f}/s, "
              f"x{statistics.median(r[4] / r[3] for r in rows):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--share", type=float, default=0.05)
    parser.add_argument("--idle-requests", type=int, default=1000)
    args = parser.parse_args()
    print(machine(), time.strftime("%Y-%m-%d %H:%M %Z"), flush=True)
    with embedded_redis() as url:
        stages = ["Scale", "Shift"]
        with workers("bench.priorities:with_levels", stages, url), workers("bench.priorities:flat", stages, url):
            asyncio.run(wait_ready(url, "bench-prio", 2))
            asyncio.run(wait_ready(url, "bench-flat", 2))
            asyncio.run(run(url, args.rounds, args.duration_s, args.connections, args.share, args.idle_requests))


if __name__ == "__main__":
    main()
