"""Autoscaling ramp: one stage of ~2 ms CPU per item, load stepping 1 -> 128 -> 1 in flight, scaled by its
supervisor (``workers=(1, 2)``) against the same stage at a fixed fleet of its maximum (2), side by side.

    python -m bench.autoscale [--rounds 2] [--step-s 20] [--high 128]

Per run and step: req/s, p50/p99 (ms); for the autoscaled side also when it reached 2 workers after the
high step began, and when it was back to 1 after the step ended (``scale_down_after_s`` is 10 s here). The
high step's figures are taken once the autoscaled side has scaled (from its second worker's start, as
the goal asks: "once scaled"), and over the whole step too. Every answer is checked (lost or wrong: counted).
Each run has its own embedded Redis; the two systems alternate their order each round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from statistics import median

import redis.asyncio as aredis

from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from broker.keys import Keys
from gateway import Gateway, GatewaySettings
from gateway.monitor.status import read_status

APP = "tests.autoscale_stages"


@dataclass
class Step:
    in_flight: int
    started: float = 0.0
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (answered at, seconds)
    errors: int = 0


async def _drive(gw: Gateway, step: Step, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    step.started = time.monotonic()

    async def caller(c: int) -> None:
        n = 0
        while time.monotonic() < end:
            x = c * 10_000_000 + n
            sent = time.monotonic()
            try:
                ok = await gw.predict(x) == x
            except Exception:  # a benchmark counts every failure as such
                ok = False
            now = time.monotonic()
            if ok:
                step.latencies.append((now, now - sent))
            else:
                step.errors += 1
            n += 1

    await asyncio.gather(*(caller(c) for c in range(step.in_flight)))


async def _watch_workers(url: str, pipeline: str, samples: list[tuple[float, int]], stop: asyncio.Event) -> None:
    client = aredis.Redis.from_url(url)
    try:
        while not stop.is_set():
            status = await read_status(client, Keys(pipeline))
            if status.stages:
                samples.append((time.monotonic(), status.stages[0].live_workers))
            await asyncio.sleep(0.25)
    finally:
        await client.aclose()


async def _run(url: str, pipeline: str, high: int, step_s: float, tail_s: float) -> dict[str, object]:
    steps = [Step(1), Step(high), Step(1)]
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_workers(url, pipeline, samples, stop))
    async with Gateway(url, pipeline, GatewaySettings(timeout_s=30.0)) as gw:
        for step in steps:
            await _drive(gw, step, step_s if step is not steps[-1] else tail_s)
    stop.set()
    await watcher
    return _report(steps, samples)


def _report(steps: list[Step], samples: list[tuple[float, int]]) -> dict[str, object]:
    high, last = steps[1], steps[2]
    scaled_at = next((t for t, n in samples if t >= high.started and n >= 2), None)
    down_at = next((t for t, n in samples if t >= last.started and n <= 1), None)
    out: dict[str, object] = {"errors": sum(s.errors for s in steps),
                              "up_after_s": None if scaled_at is None else scaled_at - high.started,
                              "down_after_s": None if down_at is None else down_at - last.started}
    for name, step in (("low", steps[0]), ("high", high), ("back", last)):
        out[name] = _figures(step.latencies, step.started)
    if scaled_at is not None:
        out["high_scaled"] = _figures([x for x in high.latencies if x[0] >= scaled_at + 1.0], scaled_at + 1.0)
    return out


def _figures(latencies: list[tuple[float, float]], since: float) -> dict[str, float]:
    if not latencies:
        return {"rps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan")}
    span = max(t for t, _ in latencies) - since
    lat = sorted(s for _, s in latencies)
    return {"rps": len(lat) / span if span > 0 else 0.0, "p50_ms": percentile(lat, 0.5) * 1000,
            "p99_ms": percentile(lat, 0.99) * 1000}


def _one(system: str, high: int, step_s: float, tail_s: float) -> dict[str, object]:
    pipeline = "t-autoscale" if system == "autoscaled" else "t-fixed"
    os.environ["AUTOSCALE_SCALE_DOWN_AFTER_S"] = "10"
    with embedded_redis() as url, workers(f"{APP}:{'burn' if system == 'autoscaled' else 'fixed'}", ["Burn"], url):
        asyncio.run(wait_ready(url, pipeline, 1, min_workers={"Burn": 1 if system == "autoscaled" else 2}))
        return asyncio.run(_run(url, pipeline, high, step_s, tail_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=20.0)
    parser.add_argument("--tail-s", type=float, default=25.0, help="the last low step: long enough to scale down")
    parser.add_argument("--high", type=int, default=128)
    args = parser.parse_args()
    print(f"machine: {machine()}; load 1 -> {args.high} -> 1 in flight, {args.step_s:g} s steps")
    results: dict[str, list[dict[str, object]]] = {"autoscaled": [], "fixed": []}
    for r in range(args.rounds):
        order = ["autoscaled", "fixed"] if r % 2 == 0 else ["fixed", "autoscaled"]
        for system in order:
            res = _one(system, args.high, args.step_s, args.tail_s)
            results[system].append(res)
            print(f"round {r} {system}: {res}", flush=True)
    auto, fixed = results["autoscaled"], results["fixed"]

    def med(runs: list[dict[str, object]], step: str, what: str) -> float:
        return median(float(run[step][what]) for run in runs if step in run)  # type: ignore[index]

    print("| step | autoscaled req/s | fixed(2) req/s | ratio | autoscaled p99 ms | fixed p99 ms | p99 ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for step in ("low", "high", "back"):
        a, f = med(auto, step, "rps"), med(fixed, step, "rps")
        ap, fp = med(auto, step, "p99_ms"), med(fixed, step, "p99_ms")
        print(f"| {step} | {a:,.0f} | {f:,.0f} | {a / f:.3f} | {ap:.1f} | {fp:.1f} | {ap / fp:.2f} |")
    a, ap = med(auto, "high_scaled", "rps"), med(auto, "high_scaled", "p99_ms")
    f, fp = med(fixed, "high", "rps"), med(fixed, "high", "p99_ms")
    print(f"| high, once scaled | {a:,.0f} | {f:,.0f} | {a / f:.3f} | {ap:.1f} | {fp:.1f} | {ap / fp:.2f} |")
    print("autoscaled: up after", [run["up_after_s"] for run in auto], "s; down after",
          [run["down_after_s"] for run in auto], "s; errors", [run["errors"] for run in auto],
          "| fixed errors", [run["errors"] for run in fixed])


if __name__ == "__main__":
    main()
