"""Adaptive against deadline batching on Scale/Shift (batch 64, wait 2 ms, both stages), side by side.

    python -m bench.scale_shift [--requests N] [--in-flight 1,16,256,1024] [--rounds 2]

Both pipelines run at once on one Redis (one worker per stage each, plus a third pipeline, adaptive
with two Shift workers, for the batch-split check at 256 in flight). For each concurrency level
and round, the policies take turns (the order alternates per round) on the same machine state:
that many client coroutines on one gateway each send requests one after another (a closed loop).
Printed per policy and level: req/s (mean of rounds), p50/p99/p999 over all rounds, mean batch
size per stage (from the stats stream) and Redis commands per request (INFO commandstats,
commands inside scripts counted, the benchmark's own status reads left out). Then one row over
HTTP at 1 in flight (`conveyor gateway` in a subprocess, sequential keep-alive requests).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import redis.asyncio as aredis

from bench.counters import command_calls, per_request, sync_command_calls
from bench.harness import ROOT, embedded_redis, machine, percentile, wait_ready, workers
from broker.keys import Keys
from gateway import Gateway
from gateway.monitor.status import read_status

APP = "bench.pipelines"


@dataclass
class Config:
    label: str
    pipeline: str
    attribute: str
    stages: list[str | tuple[str, int]]
    levels: set[int] | None = None  # None: every level


CONFIGS = [
    Config("adaptive", "bench-scale-shift", "scale_shift", ["Scale", "Shift"]),
    Config("deadline", "bench-scale-shift-deadline", "scale_shift_deadline", ["Scale", "Shift"]),
    Config("adaptive, 2 Shift workers", "bench-scale-shift-2w", "scale_shift_2w", ["Scale", ("Shift", 2)], {256}),
]


@dataclass
class Row:
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    batches: dict[int, list[int]] = field(default_factory=dict)
    commands: list[float] = field(default_factory=list)


async def closed_loop(gw: Gateway | Gateway, in_flight: int, total: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    counter = iter(range(total))

    async def client() -> None:
        for x in counter:
            t0 = time.perf_counter()
            y = await gw.predict(x)
            latencies.append(time.perf_counter() - t0)
            if y != x * 2 + 3:
                raise AssertionError(f"{x} -> {y}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    return total / (time.perf_counter() - t0), latencies


async def measure(client: aredis.Redis, gw: Gateway, config: Config, marks: dict[int, bytes], in_flight: int,
                  total: int, row: Row) -> None:
    await read_status(client, Keys(config.pipeline), marks)  # batches from here on
    before = await command_calls(client)
    rate, latencies = await closed_loop(gw, in_flight, total)
    after = await command_calls(client)
    await asyncio.sleep(0.35)  # idle workers hand over their last batch stats
    status = await read_status(client, Keys(config.pipeline), marks)
    row.rates.append(rate)
    row.latencies += latencies
    row.commands.append(per_request(before, after, total))
    for stage in status.stages:
        row.batches.setdefault(stage.index, []).extend(size for size, _ in stage.batches)


def requests_for(in_flight: int, total: int) -> int:
    return min(total, 2000) if in_flight == 1 else (min(total, 5000) if in_flight <= 16 else total)


async def run(url: str, levels: list[int], total: int, rounds: int) -> dict[tuple[str, int], Row]:
    rows: dict[tuple[str, int], Row] = {}
    client = aredis.Redis.from_url(url)
    gateways = {c.label: Gateway(url, c.pipeline) for c in CONFIGS}
    marks: dict[str, dict[int, bytes]] = {c.label: {} for c in CONFIGS}
    try:
        for gw in gateways.values():
            await gw.start()
        for c in CONFIGS:
            await closed_loop(gateways[c.label], 64, 2000)  # warm up
        for r in range(rounds):
            for n in levels:
                order = [c for c in CONFIGS if c.levels is None or n in c.levels]
                for c in order if r % 2 == 0 else reversed(order):
                    row = rows.setdefault((c.label, n), Row())
                    await measure(client, gateways[c.label], c, marks[c.label], n, requests_for(n, total), row)
    finally:
        for gw in gateways.values():
            await gw.close()
        await client.aclose()
    return rows


def print_rows(rows: dict[tuple[str, int], Row], levels: list[int]) -> None:
    print(f"{'policy':<26} {'in flight':>9} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'p999 ms':>8} "
          f"{'mean batch (per stage)':>23} {'cmds/req':>8}")
    for n in levels:
        for c in CONFIGS:
            row = rows.get((c.label, n))
            if row is None:
                continue
            lat = sorted(row.latencies)
            batches = "/".join(f"{sum(b) / len(b):.1f}" if b else "-" for _, b in sorted(row.batches.items()))
            print(f"{c.label:<26} {n:>9} {sum(row.rates) / len(row.rates):>8.0f} {percentile(lat, 0.5) * 1e3:>7.2f} "
                  f"{percentile(lat, 0.99) * 1e3:>7.2f} {percentile(lat, 0.999) * 1e3:>8.2f} {batches:>23} "
                  f"{sum(row.commands) / len(row.commands):>8.2f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_gateway(url: str, pipeline: str) -> Iterator[int]:
    port = free_port()
    env = dict(os.environ, CONVEYOR_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", pipeline, "--redis", url, "--port", str(port)],
                            env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP gateway did not become ready")
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def http_sequential(url: str, pipeline: str, total: int) -> tuple[float, list[float], float]:
    """req/s, latencies and Redis commands per request of ``total`` sequential keep-alive requests."""
    import redis

    client = redis.Redis.from_url(url)
    with http_gateway(url, pipeline) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        headers = {"content-type": "application/json"}

        def one(x: int) -> float:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/predict", body=json.dumps(x), headers=headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            if resp.status != 200 or body["result"] != x * 2 + 3:
                raise AssertionError(f"{x} -> {resp.status} {body}")
            return time.perf_counter() - t0

        for x in range(200):
            one(x)  # warm up
        before = sync_command_calls(client)
        t0 = time.perf_counter()
        latencies = [one(x) for x in range(total)]
        elapsed = time.perf_counter() - t0
        after = sync_command_calls(client)
        conn.close()
    client.close()
    return total / elapsed, sorted(latencies), per_request(before, after, total)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20_000, help="per level and round (fewer at 1 and 16)")
    parser.add_argument("--in-flight", default="1,16,256,1024")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--http-requests", type=int, default=2000)
    args = parser.parse_args()
    levels = [int(v) for v in args.in_flight.split(",")]
    print(f"machine: {machine()}")
    with embedded_redis() as url, ExitStack() as stack:
        for c in CONFIGS:
            stack.enter_context(workers(f"{APP}:{c.attribute}", c.stages, url))
        for c in CONFIGS:
            asyncio.run(wait_ready(url, c.pipeline, len(c.stages)))
        rows = asyncio.run(run(url, levels, args.requests, args.rounds))
        print_rows(rows, levels)
        if args.http_requests:
            rate, lat, commands = http_sequential(url, CONFIGS[0].pipeline, args.http_requests)
            print(f"{'adaptive, HTTP':<26} {1:>9} {rate:>8.0f} {percentile(lat, 0.5) * 1e3:>7.2f} "
                  f"{percentile(lat, 0.99) * 1e3:>7.2f} {percentile(lat, 0.999) * 1e3:>8.2f} {'':>23} "
                  f"{commands:>8.2f}")


if __name__ == "__main__":
    main()
