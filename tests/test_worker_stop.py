"""An idle worker asked to stop ends its blocked read at once (its heartbeat thread sends ``CLIENT UNBLOCK``)
instead of waiting for the read's timeout: here a read of a minute (``idle_block_ms``), so a worker that
stops within the test's bound was interrupted. With one stream, several priority levels (one ``XREADGROUP``
naming them all) and several partitions (a read per partition). Each worker then still answers nothing
twice and leaves nothing pending: a request sent before the stop was answered."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest
import redis

from broker.connection import RedisSettings
from gateway import Gateway
from tests.helpers import wait_for
from workers import Pipeline, Stage
from workers.loop.heartbeat import Heartbeat, Wake
from workers.loop.worker import Worker, WorkerSettings
from workers.process.watch import StatusPipe

BLOCK_MS = 60_000  # an idle read this long: a stop that waited for it would take a minute
STOP_BOUND_S = 5.0


class Echo(Stage):
    def predict(self, x: Any) -> Any:
        return x


PIPELINES = {
    "one-stream": Pipeline("t-stop-one").add(Echo),
    "levels": Pipeline("t-stop-levels", priority_levels=3).add(Echo),
    "partitions": Pipeline("t-stop-parts", partitions=2).add(Echo),
}


def blocked_reads(admin: redis.Redis) -> int:
    """Connections blocked in an XREADGROUP (CLIENT LIST flag ``b``): the worker's idle read(s)."""
    return sum(1 for c in admin.client_list() if "b" in c.get("flags", "") and c.get("cmd") == "xreadgroup")


@pytest.mark.parametrize("shape", list(PIPELINES))
def test_an_idle_worker_stops_without_waiting_for_its_read(redis_url: str, shape: str) -> None:
    pipeline = PIPELINES[shape]
    consumer = f"Echo@test:{os.getpid()}:{shape}:0"
    # The socket timeout outlasts the read (a worker refuses an idle read the client would cut: check_idle_block).
    redis_settings = RedisSettings(redis_url, socket_timeout_s=BLOCK_MS / 1000 + 10)
    worker = Worker(pipeline, pipeline.stages[0], redis_settings, consumer,
                    WorkerSettings(idle_block_ms=BLOCK_MS), StatusPipe(None))
    thread = threading.Thread(target=worker.run, name=f"worker-{shape}", daemon=True)
    admin = redis.Redis.from_url(redis_url)
    thread.start()
    try:
        wait_for(lambda: worker.ready, 30, "the worker to be ready")

        async def one() -> Any:
            async with Gateway(redis_url, pipeline.name) as gw:
                return await gw.predict(41)

        assert asyncio.run(one()) == 41
        reads = 2 if shape == "partitions" else 1
        wait_for(lambda: blocked_reads(admin) >= reads, 10, f"{reads} blocked read(s) of the idle worker")
        worker.request_stop()  # what its SIGTERM handler does: set the flag
        thread.join(STOP_BOUND_S)
        assert not thread.is_alive(), f"an idle worker still running {STOP_BOUND_S}s after a stop (its read: 60 s)"
        assert blocked_reads(admin) == 0
    finally:
        worker.request_stop()
        thread.join(BLOCK_MS / 1000 + 5)
        admin.close()


def test_a_stop_ends_the_heartbeats_wait_long_before_its_next_beat(redis_url: str) -> None:
    """The stop flag is seen when the stop is asked (``Wake``), not at the next beat (a minute here)."""
    stopping, interrupted, wake = [False], threading.Event(), Wake()
    heartbeat = Heartbeat(RedisSettings(redis_url), [], "Echo@test:wake:0", "Echo", interval_s=60.0,
                          claim_idle_s=180.0, on_stop=(lambda: stopping[0], interrupted.set), wake=wake)
    heartbeat.start()
    try:
        stopping[0] = True  # what Worker.request_stop does: the flag, then the wake
        wake.set()
        assert interrupted.wait(STOP_BOUND_S), f"no interrupt {STOP_BOUND_S}s after a stop (next beat: 60 s)"
    finally:
        heartbeat.stop()
