"""Nothing lost when Redis forgets, measured: a Redis without persistence SIGKILLed and started again
empty every few seconds under load, and what holding requests costs when nothing goes wrong.

    python -m bench.redis_restarts                 # 64 in flight, a restart every 5 s (4), >= 20,000 requests
    python -m bench.redis_restarts --steady        # the cost in the steady state: resend on/off, paired

The chaos run reports lost, wrong and twice-answered requests (0, 0, 0 is the goal), how many the
gateway sent again, and how long after Redis was back the requests caught by a restart were answered
(the detection delay plus a turn of the pipeline). The steady run alternates gateways with
``resend_forgotten`` on and off on one pipeline at 1 and 256 in flight (interleaved rounds, medians).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

from bench.harness import machine, percentile, wait_ready, workers
from gateway import Gateway, GatewaySettings
from workers.embedded.server import EmbeddedRedis

APP, PIPELINE = "examples.scale_shift:pipeline", "scale-shift"


@dataclass
class Chaos:
    answers: dict[int, object] = field(default_factory=dict)
    latencies_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # x -> (sent, answered)
    back_at: list[float] = field(default_factory=list)  # when Redis answered again after each kill
    killed_at: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0


async def chaos(server: EmbeddedRedis, total: int, in_flight: int, every_s: float,
                restarts: int) -> tuple[Chaos, int, int]:
    """At least ``total`` requests, and on until ``restarts`` restarts are behind (then 1 s more)."""
    result = Chaos()
    numbers = iter(range(10**9))
    calm = asyncio.Event()
    async with Gateway(server.url, PIPELINE, GatewaySettings(timeout_s=60.0)) as gw:
        async def client() -> None:
            for x in numbers:
                if x >= total and calm.is_set():
                    return
                sent = time.monotonic()
                try:
                    result.answers[x] = await gw.predict(x)
                except Exception as exc:  # counted as lost below
                    result.answers[x] = exc
                result.latencies_s[x] = (sent, time.monotonic())

        async def killer() -> None:
            for _ in range(restarts):
                await asyncio.sleep(every_s)
                result.killed_at.append(time.monotonic())
                server.kill()  # SIGKILL: everything in it is gone
                await asyncio.to_thread(server.start)  # the same socket, empty
                result.back_at.append(time.monotonic())
            await asyncio.sleep(1.0)
            calm.set()

        kill_task = asyncio.ensure_future(killer())
        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(in_flight)))
        result.elapsed_s = time.monotonic() - started
        await kill_task
        return result, gw.hub.recall.resubmitted, gw.hub.late_answers


def report_chaos(result: Chaos, total: int, in_flight: int, every_s: float, resent: int, late: int) -> None:
    lost = [x for x, a in result.answers.items() if isinstance(a, BaseException)]
    wrong = [x for x, a in result.answers.items() if not isinstance(a, BaseException) and a != 2 * x + 3]
    caught = []  # requests in flight at a kill: answered this long after Redis was back
    for killed, back in zip(result.killed_at, result.back_at, strict=True):
        caught += [done - back for sent, done in result.latencies_s.values() if sent < killed < done]
    caught.sort()
    print(f"{len(result.answers)} requests at {in_flight} in flight, Redis SIGKILLed and restarted empty every "
          f"{every_s:g} s ({len(result.killed_at)} restarts in {result.elapsed_s:.1f} s)")
    print(f"  lost {len(lost)}, wrong {len(wrong)}, answered twice to a caller 0 (one future each); "
          f"sent again {resent}, late answers dropped {late}")
    if caught:
        print(f"  {len(caught)} requests caught by a restart, answered after Redis was back: p50 "
              f"{statistics.median(caught) * 1000:.0f} ms, p99 {percentile(caught, 0.99) * 1000:.0f} ms, "
              f"max {caught[-1] * 1000:.0f} ms")


async def steady(url: str, levels: list[int], rounds: int, total: int) -> dict[tuple[bool, int], list[float]]:
    """req/s of a gateway holding requests (on) and not (off), interleaved."""
    rates: dict[tuple[bool, int], list[float]] = {}
    p50s: dict[tuple[bool, int], list[float]] = {}
    gateways = {on: Gateway(url, PIPELINE, GatewaySettings(resend_forgotten=on)) for on in (True, False)}
    for gw in gateways.values():
        await gw.start()
    try:
        for r in range(rounds):
            for n in levels:
                for on in (True, False) if r % 2 == 0 else (False, True):
                    count = min(total, 2000) if n == 1 else total
                    rate, p50 = await _closed_loop(gateways[on], n, count)
                    rates.setdefault((on, n), []).append(rate)
                    p50s.setdefault((on, n), []).append(p50)
    finally:
        for gw in gateways.values():
            await gw.close()
    for n in levels:
        on, off = statistics.median(rates[(True, n)]), statistics.median(rates[(False, n)])
        p_on, p_off = statistics.median(p50s[(True, n)]), statistics.median(p50s[(False, n)])
        print(f"  {n:>4} in flight: on {on:8.0f} req/s p50 {p_on * 1000:6.2f} ms | off {off:8.0f} req/s p50 "
              f"{p_off * 1000:6.2f} ms | on/off {on / off:.3f}")
    return rates


async def _closed_loop(gw: Gateway, in_flight: int, total: int) -> tuple[float, float]:
    latencies: list[float] = []
    numbers = iter(range(total))

    async def client() -> None:
        for x in numbers:
            t0 = time.perf_counter()
            assert await gw.predict(x) == 2 * x + 3
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    return total / (time.perf_counter() - t0), statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--every-s", type=float, default=5.0, help="seconds between restarts")
    parser.add_argument("--restarts", type=int, default=4, help="restarts before the run ends")
    parser.add_argument("--steady", action="store_true", help="measure the steady-state cost instead")
    parser.add_argument("--rounds", type=int, default=6, help="--steady: interleaved rounds")
    args = parser.parse_args()
    print(machine())
    server = EmbeddedRedis()
    url = server.start()
    try:
        with workers(APP, ["Scale", "Shift"], url):
            asyncio.run(wait_ready(url, PIPELINE, 2))
            if args.steady:
                print(f"steady state, {args.rounds} interleaved rounds, resend_forgotten on vs off:")
                asyncio.run(steady(url, [1, 256], args.rounds, args.requests))
                return
            result, resent, late = asyncio.run(chaos(server, args.requests, args.in_flight, args.every_s,
                                                    args.restarts))
            report_chaos(result, args.requests, args.in_flight, args.every_s, resent, late)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
