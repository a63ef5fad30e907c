"""The gateway process's CPU per request, this checkout against an older one, side by side.

    python -m bench.gateway_cpu --old-src DIR [--in-flight 256] [--rounds 3] [--duration-s 5]

One redis-server and one worker per stage of ``bench.pipelines:scale_shift`` serve both
gateways. Two ways in, each measured for the old and the new code in interleaved rounds (the
order alternates each round) so that a shared machine's noise spreads over both:

- ``http``: ``conveyor gateway`` (asyncio loop) driven by wrk at ``--in-flight`` connections;
  CPU of the gateway process (psutil, user+system) over the wrk run;
- ``api``: a fresh process running ``Gateway.predict`` in ``--in-flight`` coroutines (a closed
  loop, no other work per call); its own CPU (``time.process_time``) over the measured window.

Per row: req/s and CPU microseconds per request; the last table gives new/old ratios of the
medians. ``--old-src`` is e.g. ``git worktree add /tmp/conveyor-old 2f05f09``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from statistics import median

import psutil

from bench.http_front import (
    WRK_LUA,
    _cpu_s,
    _start_gateway,
    _start_redis,
    _wait_http,
    _wrk,
    start_workers,
    stop_all,
)

ROOT = Path(__file__).resolve().parents[1]
API_DRIVER = ROOT / "bench" / "api_driver.py"  # run by path against the checkout under test

Rows = dict[tuple[str, str], list[tuple[float, float]]]


def _api(src: Path, url: str, in_flight: int, duration_s: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, str(API_DRIVER), url, str(in_flight), str(duration_s)], cwd=src,
                         env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, check=True,
                         timeout=duration_s + 60).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return float(result["rps"]), float(result["cpu_us"])


def _report(rows: Rows, in_flight: int) -> None:
    print(f"\nmedians, {in_flight} in flight: req/s [gateway CPU us/request]")
    print("| way in | old | new | new/old req/s | new/old CPU per request |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("http", "api"):
        old, new = rows.get((mode, "old")), rows.get((mode, "new"))
        if not old or not new:
            continue
        o_rps, o_cpu = median(r for r, _ in old), median(c for _, c in old)
        n_rps, n_cpu = median(r for r, _ in new), median(c for _, c in new)
        print(f"| {mode} | {o_rps:,.0f} [{o_cpu:.1f}] | {n_rps:,.0f} [{n_cpu:.1f}] | {n_rps / o_rps:.2f} | "
              f"{n_cpu / o_cpu:.2f} |")


def _rounds(args: argparse.Namespace, modes: list[str], gateways: dict[str, tuple[int, psutil.Process]],
            srcs: dict[str, Path], url: str, script: Path) -> Rows:
    """Every mode for old and new, ``args.rounds`` times; the order of old and new alternates."""
    rows: Rows = defaultdict(list)
    for rnd in range(args.rounds):
        order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
        for mode in modes:
            for name in order:
                if mode == "http":
                    port, proc = gateways[name]
                    before = _cpu_s(proc)
                    rps, _ = _wrk(port, args.in_flight, args.duration_s, script)
                    cpu_us = (_cpu_s(proc) - before) / max(rps * args.duration_s, 1) * 1e6
                else:
                    rps, cpu_us = _api(srcs[name], url, args.in_flight, args.duration_s)
                rows[(mode, name)].append((rps, cpu_us))
                print(f"round {rnd + 1}/{args.rounds} {mode:<4} {name}: {rps:>9,.0f} req/s  "
                      f"gateway CPU {cpu_us:6.1f} us/request", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-src", type=Path, required=True, help="a checkout of the older code")
    parser.add_argument("--in-flight", type=int, default=256, help="wrk connections / coroutines")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=int, default=5)
    parser.add_argument("--modes", default="http,api")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="conveyor-gateway-cpu-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = _start_redis(tmp, procs)
        env = {**os.environ, "CONVEYOR_REDIS_URL": url}
        start_workers(env, tmp, procs)
        modes = args.modes.split(",")
        gateways: dict[str, tuple[int, psutil.Process]] = {}
        if "http" in modes:
            for name, front in (("old", "old"), ("new", "asyncio")):
                proc, port = _start_gateway(front, env, args.old_src.resolve(), tmp, echo=False)
                procs.append(proc)
                gateways[name] = (port, psutil.Process(proc.pid))
            for port, _ in gateways.values():
                _wait_http(port, "/readyz")
        script = tmp / "post.lua"
        script.write_text(WRK_LUA)
        srcs = {"old": args.old_src.resolve(), "new": ROOT}
        _report(_rounds(args, modes, gateways, srcs, url, script), args.in_flight)
    finally:
        stop_all(procs, tmp)


if __name__ == "__main__":
    main()
