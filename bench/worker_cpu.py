"""The workers' CPU per request on Scale/Shift, this checkout against an older one, side by side.

    python -m bench.worker_cpu --old-src DIR [--in-flight 256] [--rounds 4] [--duration-s 5]

Two redis-servers, one per checkout, each served by one worker per stage of
``bench.pipelines:scale_shift`` (``conveyor worker``, run from that checkout). One driver
process of this checkout (``Gateway.predict`` in ``--in-flight`` coroutines, a closed loop)
loads one side at a time; the order of old and new alternates each round, so that a shared
machine's noise spreads over both. Per run: req/s, and the CPU (psutil user+system) of both
worker processes and their children over the measured window, per request; the last table
gives new/old ratios of the medians. ``--old-src`` is e.g.
``mkdir /tmp/conveyor-old-w && git archive 2f05f09 | tar -x -C /tmp/conveyor-old-w``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from statistics import median

import psutil

from bench.harness import wait_ready
from bench.http_front import APP, NAME, STAGES, _cpu_s, _start_redis, stop_all

ROOT = Path(__file__).resolve().parents[1]
API_DRIVER = ROOT / "bench" / "api_driver.py"

Rows = dict[str, list[tuple[float, float]]]


def _workers_cpu_s(procs: list[psutil.Process]) -> float:
    return sum(_cpu_s(p) for p in procs)


def _run(url: str, workers: list[psutil.Process], in_flight: int, duration_s: int) -> tuple[float, float]:
    """req/s and worker CPU us per request of one closed-loop window."""
    driver = subprocess.Popen([sys.executable, str(API_DRIVER), url, str(in_flight), str(duration_s), "--handshake"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        if driver.stdin is None or driver.stdout is None:
            raise RuntimeError("driver pipes missing")
        if driver.stdout.readline().strip() != "go":
            raise RuntimeError("driver failed before its measured window")
        before = _workers_cpu_s(workers)
        driver.stdin.write("\n")
        driver.stdin.flush()
        result = json.loads(driver.stdout.readline())
        cpu_s = _workers_cpu_s(workers) - before
        driver.stdin.write("\n")
        driver.stdin.flush()
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    return float(result["rps"]), cpu_s / max(int(result["count"]), 1) * 1e6


def _report(rows: Rows, in_flight: int) -> None:
    print(f"\nmedians, {in_flight} in flight: req/s [workers' CPU us/request, both stages]")
    print("| old | new | new/old req/s | new/old worker CPU per request |")
    print("|---:|---:|---:|---:|")
    o_rps, o_cpu = median(r for r, _ in rows["old"]), median(c for _, c in rows["old"])
    n_rps, n_cpu = median(r for r, _ in rows["new"]), median(c for _, c in rows["new"])
    print(f"| {o_rps:,.0f} [{o_cpu:.1f}] | {n_rps:,.0f} [{n_cpu:.1f}] | {n_rps / o_rps:.2f} | {n_cpu / o_cpu:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-src", type=Path, required=True, help="a checkout of the older code")
    parser.add_argument("--in-flight", type=int, default=256, help="driver coroutines")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration-s", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="conveyor-worker-cpu-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls: dict[str, str] = {}
        workers: dict[str, list[psutil.Process]] = {}
        for name, src in (("old", args.old_src.resolve()), ("new", ROOT)):
            urls[name] = _start_redis(tmp, procs)
            env = {**os.environ, "CONVEYOR_REDIS_URL": urls[name], "PYTHONPATH": str(src)}
            workers[name] = []
            for stage in STAGES:
                proc = subprocess.Popen([sys.executable, "-c", "from workers.cli import main; main()", "worker", APP,
                                         "--stage", stage], env=env, cwd=src, stdout=subprocess.DEVNULL,
                                        stderr=(tmp / f"{name}-{stage}.log").open("w"))
                procs.append(proc)
                workers[name].append(psutil.Process(proc.pid))
        for url in urls.values():
            asyncio.run(wait_ready(url, NAME, len(STAGES)))
        rows: Rows = defaultdict(list)
        for rnd in range(args.rounds):
            for name in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                rps, cpu_us = _run(urls[name], workers[name], args.in_flight, args.duration_s)
                rows[name].append((rps, cpu_us))
                print(f"round {rnd + 1}/{args.rounds} {name}: {rps:>9,.0f} req/s  "
                      f"workers' CPU {cpu_us:6.1f} us/request", flush=True)
        _report(rows, args.in_flight)
    finally:
        stop_all(procs, tmp)


if __name__ == "__main__":
    main()
