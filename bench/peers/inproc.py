"""Closed loops run inside this process: conveyor's Python gateway API, and raw Redis SET/GET.

Same shape as the HTTP generator: ``in_flight`` coroutines each send one request after another
for ``duration_s``; answers are checked, wrong ones count as errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import redis.asyncio as aredis

from bench.peers.load import LoadResult, percentile
from gateway import Gateway, GatewaySettings

CALL_TIMEOUT_S = 30.0  # each call's bound, as the HTTP generator's
Call = Callable[[int], Awaitable[bool]]  # one request (the coroutine's number); True if the answer was right


def expected(x: Any) -> Any:
    return x * 2 + 3


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


async def closed_loop(call: Call, in_flight: int, duration_s: float, timeout_s: float | None = 30.0) -> LoadResult:
    """``timeout_s``: each call's bound (``asyncio.wait_for``); None when ``call`` bounds itself and
    raises TimeoutError (as `Gateway.predict` does: a wait_for's timer and task per call would be
    counted as the gateway's own CPU)."""
    latencies: list[float] = []
    kinds: dict[str, int] = {}
    stop_at = time.perf_counter() + duration_s

    async def client(n: int) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                ok = await (call(n) if timeout_s is None else asyncio.wait_for(call(n), timeout_s))
            except asyncio.TimeoutError:
                kinds["timeout"] = kinds.get("timeout", 0) + 1
                continue
            except Exception as exc:  # any failure of the system under test is an error to count
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
                continue
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                kinds["wrong answer"] = kinds.get("wrong answer", 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(in_flight)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return LoadResult(requests=len(latencies), duration_s=elapsed, errors=sum(kinds.values()),
                      p50_ms=percentile(latencies, 0.5) * 1e3, p99_ms=percentile(latencies, 0.99) * 1e3,
                      p999_ms=percentile(latencies, 0.999) * 1e3, error_kinds=kinds)


async def gateway_api(redis_url: str, pipeline: str, x: Any, in_flight: int, duration_s: float,
                      warmup_s: float = 0.0, started: Callable[[], None] | None = None,
                      batch_entries: bool = True) -> LoadResult:
    """conveyor's Python API: one `Gateway` in this process, ``in_flight`` coroutines on it;
    ``started`` is called when the measured part begins, after the warm-up."""
    want = expected(x)
    async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=60.0, batch_entries=batch_entries)) as gw:

        async def call(n: int) -> bool:
            return same(await gw.predict(x, CALL_TIMEOUT_S), want)  # the gateway's own deadline, no wait_for

        if warmup_s > 0:
            await closed_loop(call, min(in_flight, 64), warmup_s, timeout_s=None)
        if started is not None:
            started()
        return await closed_loop(call, in_flight, duration_s, timeout_s=None)


async def redis_set_get(redis_url: str, data: bytes, in_flight: int, duration_s: float) -> LoadResult:
    """The floor for a payload: one SET and one GET of the same bytes per request, on redis-py."""
    client = aredis.Redis.from_url(redis_url, max_connections=max(4, in_flight))
    try:

        async def call(n: int) -> bool:
            key = f"bench:peers:raw:{n}"
            await client.set(key, data)
            back = await client.get(key)
            return back is not None and len(back) == len(data)

        result = await closed_loop(call, in_flight, duration_s)
        await client.delete(*(f"bench:peers:raw:{n}" for n in range(in_flight)))
        return result
    finally:
        await client.aclose()
