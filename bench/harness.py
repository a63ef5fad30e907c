"""Shared by the benchmarks: an embedded Redis, real `conveyor worker` processes, latency stats."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import redis.asyncio as aredis

from broker.keys import Keys
from gateway.monitor.status import read_status
from workers.embedded.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    mem_gib = psutil.virtual_memory().total / 2**30
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, " \
           f"Python {platform.python_version()}, {platform.system()} {platform.release()}"


@contextlib.contextmanager
def embedded_redis() -> Iterator[str]:
    server = EmbeddedRedis()
    try:
        yield server.start()
    finally:
        server.stop()


@contextlib.contextmanager
def workers(app: str, stages: Sequence[str | tuple[str, int]],
            redis_url: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``conveyor worker APP --stage NAME`` per stage; ``(NAME, n)`` adds ``--workers n``."""
    env = dict(os.environ, CONVEYOR_REDIS_URL=redis_url, CONVEYOR_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    procs = []
    for stage in stages:
        name, count = (stage, None) if isinstance(stage, str) else stage
        extra = [] if count is None else ["--workers", str(count)]
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", app, "--stage", name, *extra],
                                      env=env, cwd=ROOT))
    try:
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


async def wait_ready(redis_url: str, pipeline: str, n_stages: int, timeout_s: float = 30.0,
                     min_workers: dict[str, int] | None = None) -> None:
    """Until every stage has a live worker, and ``min_workers[name]`` live ones for the stages named
    there: a measurement must not run beside workers still loading a model (they take a core)."""
    client = aredis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    wanted = min_workers or {}
    try:
        while time.monotonic() < deadline:
            status = await read_status(client, Keys(pipeline))
            if (status.ready and len(status.stages) == n_stages
                    and all(s.live_workers >= wanted.get(s.name, 1) for s in status.stages)):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"pipeline {pipeline} not ready within {timeout_s}s")
    finally:
        await client.aclose()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]
