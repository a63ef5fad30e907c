"""One Redis vs a 3-master Redis Cluster with 1, 3 and 6 partitions: the Scale/Shift pipeline.

    python -m bench.scaleout [--requests 20000] [--in-flight 256] [--rounds 3]

The same trivial two-stage pipeline (Scale, Shift: batch 64, wait 2 ms, one worker process each,
workers serving every partition) at a closed loop of ``--in-flight`` requests through one
:class:`Gateway`, against (a) one redis-server on TCP loopback, (b) a 3-master cluster
with the pipeline in 1 partition, (c) 3 partitions, (d) 6 partitions. The configurations are
measured in interleaved rounds (a b c d, a b c d, ...) so that a noisy neighbour hurts all alike.

Reported per configuration (median round by req/s): req/s, p50/p99 latency, the CPU seconds each
Redis node used (user+sys, from /proc via psutil), Redis CPU per request (all nodes), and the
busiest node's share. On a 2-core machine the client, the workers and the Redis nodes all share
two cores, so req/s here says little about a real cluster; what carries over is Redis CPU per
request and how the load spreads over the nodes. The paper estimate at the end turns those into
req/s for clusters whose nodes each have one core: the cluster saturates when its busiest node
does, at ``1 / (busiest node's CPU seconds per request)`` requests per second, assuming enough
gateways and workers elsewhere and partitions spread as evenly as measured here (for 12 nodes:
at least 12 partitions, spread like the 3-partition run over 3 nodes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass, field

import psutil

from bench.harness import machine, percentile, workers
from bench.pipelines import Scale, Shift
from bench.scale_shift import closed_loop
from broker.keys import Keys
from gateway import Gateway
from tests.cluster import LocalCluster
from tests.helpers import wait_ready
from workers import Pipeline

# Names whose partitions' hash tags land on distinct masters of a 3-master cluster formed by
# `redis-cli --cluster create` (slots split in three equal ranges): 3 partitions on 3 nodes, 6 on 2+2+2.
single = Pipeline("bench-so41").add(Scale).add(Shift)
p1 = Pipeline("bench-so11").add(Scale).add(Shift)
p3 = Pipeline("bench-so13", partitions=3).add(Scale).add(Shift)
p6 = Pipeline("bench-so31", partitions=6).add(Scale).add(Shift)


@dataclass
class Config:
    label: str
    app: str
    pipeline: Pipeline
    server: LocalCluster
    runs: list[Run] = field(default_factory=list)


@dataclass
class Run:
    rate: float
    p50_ms: float
    p99_ms: float
    cpu_s: dict[int, float]  # port -> CPU seconds during the run
    requests: int

    @property
    def cpu_us_per_request(self) -> float:
        return sum(self.cpu_s.values()) / self.requests * 1e6

    @property
    def busiest_share(self) -> float:
        total = sum(self.cpu_s.values())
        return max(self.cpu_s.values()) / total if total else 0.0

    @property
    def busiest_us_per_request(self) -> float:
        return max(self.cpu_s.values()) / self.requests * 1e6


def cpu_seconds(server: LocalCluster) -> dict[int, float]:
    out = {}
    for port, pid in server.pids().items():
        t = psutil.Process(pid).cpu_times()
        out[port] = t.user + t.system
    return out


async def measure(gw: Gateway, server: LocalCluster, in_flight: int, total: int) -> Run:
    before = cpu_seconds(server)
    rate, latencies = await closed_loop(gw, in_flight, total)
    after = cpu_seconds(server)
    latencies.sort()
    return Run(rate, percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3,
               {port: after[port] - before[port] for port in before}, total)


async def bench(configs: list[Config], in_flight: int, total: int, rounds: int) -> None:
    gateways = {}
    for config in configs:
        gateways[config.label] = gw = Gateway(config.server.url, config.pipeline.name)
        await gw.start()
        await measure(gw, config.server, in_flight, min(total, 3000))  # warm up
    try:
        for r in range(rounds):
            for config in configs:
                run = await measure(gateways[config.label], config.server, in_flight, total)
                config.runs.append(run)
                print(f"round {r + 1} {config.label:<22} {run.rate:>8.0f} req/s  p50 {run.p50_ms:6.2f} ms  "
                      f"p99 {run.p99_ms:6.2f} ms  redis {run.cpu_us_per_request:6.1f} us/req", flush=True)
    finally:
        for gw in gateways.values():
            await gw.close()


def report(configs: list[Config], in_flight: int, total: int, rounds: int) -> None:
    print(f"\nmedian of {rounds} interleaved rounds, {total} requests each, {in_flight} in flight")
    print(f"{'configuration':<22} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'redis us/req':>12} "
          f"{'busiest node':>12}  CPU s per node")
    medians = {}
    for config in configs:
        run = sorted(config.runs, key=lambda r: r.rate)[len(config.runs) // 2]
        medians[config.label] = run
        per_node = " ".join(f"{v:.2f}" for v in sorted(run.cpu_s.values(), reverse=True))
        print(f"{config.label:<22} {run.rate:>8.0f} {run.p50_ms:>7.2f} {run.p99_ms:>7.2f} "
              f"{run.cpu_us_per_request:>12.1f} {run.busiest_share:>11.0%}  {per_node}")
    print("\npaper estimate, one core per Redis node (the busiest node saturates first):")
    for config in configs:
        run = medians[config.label]
        line = f"  {config.label:<22} {1e6 / run.busiest_us_per_request:>9.0f} req/s as spread here"
        if config.pipeline.partitions > 1:
            # Evenly spread partitions (>= one per node): every node does 1/nodes of the Redis work.
            per_req = run.cpu_us_per_request
            line += f"; evenly spread: 3 nodes {3e6 / per_req:.0f}, 12 nodes {12e6 / per_req:.0f} req/s"
        print(line)
    for config in configs:
        if config.server.cluster_enabled:
            parts = Keys(config.pipeline.name).partitions(config.pipeline.partitions)
            spread = ", ".join(f"p{k.partition} on :{config.server.master_of(k.spec)}" for k in parts)
            print(f"  {config.label}: {spread}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    one = LocalCluster(masters=1, cluster_enabled=False).start()
    cluster = LocalCluster(masters=3).start()
    try:
        configs = [Config("one redis", "bench.scaleout:single", single, one),
                   Config("cluster, 1 partition", "bench.scaleout:p1", p1, cluster),
                   Config("cluster, 3 partitions", "bench.scaleout:p3", p3, cluster),
                   Config("cluster, 6 partitions", "bench.scaleout:p6", p6, cluster)]
        with contextlib.ExitStack() as stack:
            for config in configs:
                stack.enter_context(workers(config.app, ["Scale", "Shift"], config.server.url))
            for config in configs:
                wait_ready(config.server.url, config.pipeline.name, 60.0)
            asyncio.run(bench(configs, args.in_flight, args.requests, args.rounds))
        report(configs, args.in_flight, args.requests, args.rounds)
    finally:
        cluster.stop()
        one.stop()


if __name__ == "__main__":
    main()
