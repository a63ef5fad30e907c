"""Where a request's CPU goes at 1 in flight, this checkout against another, side by side.

    python -m bench.low_load --base DIR [--pairs 6] [--duration-s 4]

At 1 in flight every request is a batch of one at every stage, so a worker's cost per batch is the
whole story of its loop (the read, the checks, the commit, the next read). Each run: one Redis of
its own, one ``conveyor worker`` per stage of ``bench.pipelines:scale_shift`` and one
``Gateway.predict`` caller, all of one checkout's code (``DIR`` is e.g. ``git worktree add
/tmp/before 1c76422``); runs of the two checkouts alternate, so a shared machine's noise falls on
both. Per run: req/s, CPU microseconds per request of the gateway (the caller's process), of each
stage's worker process and of Redis, and Redis commands per request. The last table gives the
medians and this / base.

The caller runs this file as a script (``--run``) with the checkout first on ``PYTHONPATH``, so it
imports that checkout's ``gateway``; only public API is used (``Gateway``, ``conveyor worker``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = "bench-scale-shift"
STAGES = ("Scale", "Shift")
START_TIMEOUT_S = 60.0


def _cpu_s(procs: list[psutil.Process]) -> float:
    """As bench.oip_load's, repeated: ``--run`` imports only the measured checkout's public API
    (an older checkout has no bench.oip_load)."""
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


async def _drive(url: str, duration_s: float, groups: dict[str, list[psutil.Process]]) -> dict[str, Any]:
    """Warm up, then ``predict`` one request after another for ``duration_s``; CPU per request."""
    import redis  # the checkout's own dependencies, in the caller's venv

    from gateway import Gateway  # this checkout's: PYTHONPATH puts it first
    gateway = Gateway(url, PIPELINE)
    await gateway.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                await gateway.predict(1, timeout_s=2.0)
                break
            except Exception:  # not registered yet, or its workers still starting
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        for _ in range(300):
            await gateway.predict(1)
        stats = redis.Redis.from_url(url)
        calls_before = {k: v["calls"] for k, v in stats.info("commandstats").items()}
        cpu_before = {label: _cpu_s(procs) for label, procs in groups.items()}
        own_before, started, count = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - started < duration_s:
            if await gateway.predict(3) != 9:
                raise RuntimeError("wrong answer")
            count += 1
        elapsed = time.perf_counter() - started
        cpu = {label: (_cpu_s(procs) - cpu_before[label]) / count * 1e6 for label, procs in groups.items()}
        cpu["gateway"] = (time.process_time() - own_before) / count * 1e6
        calls_after = {k: v["calls"] for k, v in stats.info("commandstats").items()}
        commands = sum(calls_after.values()) - sum(calls_before.values())
        return {"rps": count / elapsed, "cpu_us": cpu, "commands": commands / count}
    finally:
        await gateway.close()


def run_one(url: str, duration_s: float, redis_pid: int) -> dict[str, Any]:
    """In the checkout's interpreter: its workers, its gateway, one measured window."""
    src = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    env = dict(os.environ, CONVEYOR_LOG_LEVEL="WARNING")
    workers = {stage: subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", "bench.pipelines:scale_shift",
                                        "--stage", stage, "--redis", url], cwd=src, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for stage in STAGES}
    try:
        time.sleep(1.0)  # the supervisors start their children
        groups = {stage: _tree(proc.pid) for stage, proc in workers.items()}
        groups["redis"] = [psutil.Process(redis_pid)]
        return asyncio.run(_drive(url, duration_s, groups))
    finally:
        for proc in workers.values():
            proc.terminate()
        for proc in workers.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _measure(src: Path, duration_s: float) -> dict[str, Any]:
    """One run of ``src``'s code on a Redis of its own (this checkout's embedded server)."""
    from workers.embedded.server import EmbeddedRedis
    server = EmbeddedRedis()
    url = server.start()
    try:
        env = dict(os.environ, PYTHONPATH=str(src))
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", url, str(duration_s),
                              str(server.pid)], env=env, cwd=src, capture_output=True, text=True,
                             timeout=START_TIMEOUT_S + duration_s + 60)
        if out.returncode != 0:
            raise RuntimeError(f"run of {src} failed: {out.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result
    finally:
        server.stop()


def _row(name: str, r: dict[str, Any]) -> str:
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_us"].items())
    return f"| {name} | {r['rps']:,.0f} | {cpu} | {r['commands']:.2f} |"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        url, duration_s, redis_pid = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(run_one(url, duration_s, redis_pid)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--duration-s", type=float, default=4.0)
    args = parser.parse_args()
    sides = {"this": ROOT, "base": args.base.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "base": []}
    print("| run | req/s | CPU us per request | Redis commands per request |\n|---|---:|---|---:|")
    for pair in range(args.pairs):
        for name in (("this", "base") if pair % 2 == 0 else ("base", "this")):
            result = _measure(sides[name], args.duration_s)
            runs[name].append(result)
            print(_row(f"{name} {pair + 1}", result), flush=True)
    print("\n| | this | base | this / base |\n|---|---:|---:|---:|")
    for key in ["rps", *runs["this"][0]["cpu_us"]]:
        def med(name: str, key: str = key) -> float:
            return median(r["rps"] if key == "rps" else r["cpu_us"][key] for r in runs[name])
        label = "req/s" if key == "rps" else f"{key} CPU us/request"
        print(f"| {label} | {med('this'):,.1f} | {med('base'):,.1f} | {med('this') / med('base'):.3f} |")


if __name__ == "__main__":
    main()
