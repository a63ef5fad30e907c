"""Priorities at saturation: 256 requests in flight at the default level and a 5 % stream of priority 1.

    python -m bench.priorities [--rounds 3] [--duration-s 10] [--connections 256] [--share 0.05]
                               [--stream-client same|own [--stage-timings]]

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

(flat and levels in an order that alternates between rounds.)

With ``--stream-client own`` the priority-1 stream (and its idle measurement) comes from a process
with a gateway of its own, so that its latency is not the 256 callers' event loop's (the stages are
what a priority reorders; the caller's own process is not).

Printed per round and as medians: the stream's p99 in each, levels p99 / idle p99 (the goal: at
most 2), and the default level's throughput levels / flat (the goal: at least 0.95). Both loaded
runs carry the same extra stream, so the throughput ratio is the price of the priority machinery.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import statistics
import sys
import time

from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from examples.scale_shift import Scale, Shift
from gateway import Gateway
from gateway.client.trace_context import CURRENT, RequestTrace
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


async def open_loop(gw: Gateway, stop: float, stream_rate: float, stream: list[float],
                    timings: list[list[tuple[float, float]]] | None = None) -> None:
    """Priority-1 requests at ``stream_rate`` until ``stop`` (from 0.5 s on, after the callers fill the
    stages), each one's latency appended to ``stream``; with ``timings``, each one's stage timings too
    (queue and predict ms per stage: the ``t`` token of broker.tracing, as ``--timing-headers`` asks)."""
    async def one(t0: float) -> None:
        trace = None
        if timings is not None:
            trace = RequestTrace(0, 0, 0, False, b"- t", time.time_ns())
            CURRENT.set(trace)  # this task's context: the hub reads it as it queues the request
        await gw.predict(5, priority=1)
        stream.append(time.perf_counter() - t0)
        if trace is not None and timings is not None:
            timings.append(trace.timing or [])

    tasks = []
    interval, next_at = 1.0 / stream_rate, time.perf_counter() + 0.5
    while next_at < stop:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(time.perf_counter())))
        next_at += interval
    await asyncio.gather(*tasks)


async def child_stream(url: str, pipeline: str, rate: float, duration_s: float,
                       timed: bool = False) -> tuple[float, int]:
    """``--stream-client own``: the stream (or, at rate 0, the idle measurement) from a process of its own,
    with a gateway of its own: its p99 and count (``timed``: where its time went, printed)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.priorities", "--child", url, pipeline,
                                                str(rate), str(duration_s), "1" if timed else "0",
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    figures = json.loads(out.decode().strip().splitlines()[-1])
    if "where" in figures:
        print(f"  {pipeline}, the stream's time: {figures['where']}", flush=True)
    return float(figures["p99"]), int(figures["n"])


async def child_main(url: str, pipeline: str, rate: float, duration_s: float, timed: bool) -> None:
    figures: dict[str, object] = {}
    async with Gateway(url, pipeline) as gw:
        for _ in range(50):  # warm: connections, registration
            await gw.predict(5, priority=1)
        if rate <= 0:
            figures.update(p99=await idle_p99(gw, int(duration_s)), n=int(duration_s))
        else:
            stream: list[float] = []
            timings: list[list[tuple[float, float]]] | None = [] if timed else None
            await open_loop(gw, time.perf_counter() + duration_s, rate, stream, timings)
            figures.update(p99=percentile(sorted(stream), 0.99), n=len(stream))
            if timings:
                figures["where"] = where_the_time_went(stream, timings)
    print(json.dumps(figures), flush=True)


def where_the_time_went(stream: list[float], timings: list[list[tuple[float, float]]]) -> str:
    """The stream's p99 split: each stage's queue (p50 / p99 ms), and the rest (outside the stages:
    the submit and the answer's way back)."""
    parts = []
    for stage in range(min(len(t) for t in timings)):
        queues = sorted(t[stage][0] for t in timings)
        parts.append(f"stage {stage} queue {percentile(queues, 0.5):.1f} / {percentile(queues, 0.99):.1f} ms")
    outside = sorted(s * 1e3 - sum(q + c for q, c in t) for s, t in zip(stream, timings, strict=True))
    return "; ".join([*parts, f"outside {percentile(outside, 0.5):.1f} / {percentile(outside, 0.99):.1f} ms"])


async def saturated(gw: Gateway, connections: int, duration_s: float, stream_rate: float,
                    own_client: tuple[str, str] | None = None, timed: bool = False) -> tuple[float, float, int]:
    """The default level's throughput (closed loop), and the p99 and count of the priority-1 stream
    (``own_client``: its Redis URL and pipeline, sent by a process of its own)."""
    stop = time.perf_counter() + duration_s
    done = 0
    stream: list[float] = []

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await gw.predict(3)
            done += 1

    t0 = time.perf_counter()
    if stream_rate <= 0:
        await asyncio.gather(*(caller() for _ in range(connections)))
        return done / (time.perf_counter() - t0), math.nan, 0
    if own_client:
        child = asyncio.ensure_future(child_stream(*own_client, stream_rate, duration_s - 2.0, timed))  # starts in ~1 s
        await asyncio.gather(*(caller() for _ in range(connections)))
        p99, n = await child
        return done / (time.perf_counter() - t0), p99, n
    await asyncio.gather(open_loop(gw, stop, stream_rate, stream), *(caller() for _ in range(connections)))
    return done / (time.perf_counter() - t0), percentile(sorted(stream), 0.99), len(stream)


async def run(url: str, rounds: int, duration_s: float, connections: int, share: float, idle_total: int,
              own: bool, timed: bool = False) -> None:
    async with Gateway(url, "bench-prio") as prio, Gateway(url, "bench-flat") as plain:
        await saturated(plain, connections, 2.0, 0)  # warm up both
        await saturated(prio, connections, 2.0, 0)
        rate = 0.0
        rows = []
        for r in range(rounds):
            idle = (await child_stream(url, "bench-prio", 0, idle_total))[0] if own else \
                await idle_p99(prio, idle_total)
            if r == 0:  # a first flat run sets the stream's rate
                rate = (await saturated(plain, connections, duration_s, 0))[0]
            flat_run = functools.partial(saturated, plain, connections, duration_s, rate * share,
                                         (url, "bench-flat") if own else None, timed)
            levels_run = functools.partial(saturated, prio, connections, duration_s, rate * share,
                                           (url, "bench-prio") if own else None, timed)
            # the order alternates between rounds: a drift within a round falls on each side alike
            if r % 2 == 0:
                flat_tput, flat_p99, _ = await flat_run()
                tput, p99, n = await levels_run()
            else:
                tput, p99, n = await levels_run()
                flat_tput, flat_p99, _ = await flat_run()
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
    parser.add_argument("--stream-client", choices=("same", "own"), default="same",
                        help="same: the priority-1 stream shares the callers' process and gateway; own: it comes "
                             "from a process with a gateway of its own (another service, or a gateway replica)")
    parser.add_argument("--stage-timings", action="store_true",
                        help="with --stream-client own: print where the stream's time went (each stage's queue, "
                             "the rest), from the stages' own timings")
    parser.add_argument("--child", nargs=5, metavar=("URL", "PIPELINE", "RATE", "DURATION_S", "TIMED"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, pipeline, rate, duration_s, timed = args.child
        asyncio.run(child_main(url, pipeline, float(rate), float(duration_s), timed == "1"))
        return
    print(machine(), time.strftime("%Y-%m-%d %H:%M %Z"), f"stream client: {args.stream_client}", flush=True)
    with embedded_redis() as url:
        stages = ["Scale", "Shift"]
        with workers("bench.priorities:with_levels", stages, url), workers("bench.priorities:flat", stages, url):
            asyncio.run(wait_ready(url, "bench-prio", 2))
            asyncio.run(wait_ready(url, "bench-flat", 2))
            asyncio.run(run(url, args.rounds, args.duration_s, args.connections, args.share, args.idle_requests,
                            args.stream_client == "own", args.stage_timings))


if __name__ == "__main__":
    main()
