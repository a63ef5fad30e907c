"""A gateway's views of the pipelines it serves (gateway.client.view): one ``conveyor gateway`` process
serving 50 pipelines on one Redis, and a view that no refresh reaches.

Every served pipeline has one view, all refreshed by one task of the process on one connection of
its own: ``/readyz`` answers from the views (no Redis call per probe), it turns 200 soon after the
workers are ready and stays 200, every pipeline answers, and the connections the gateway holds do not
grow with the pipelines it serves. The gateway is a real process; the 50 one-stage pipelines' workers
run as threads of the test process (50 worker processes would not start within the test's time on
two cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.connection import RedisSettings
from broker.keys import Keys
from broker.spec import StageInfo, encode_spec
from gateway import Gateway
from gateway.client.settings import GatewaySettings
from gateway.client.view import REFRESH_S, STALE_AFTER_S
from gateway.http.server import HttpServer, HttpSettings
from tests.helpers import http_call, wait_for
from tests.ops_stages import Proc, exchange, free_port, get, http_request, start_conveyor, status_code, stop_all
from workers import Pipeline, Stage
from workers.embedded.server import EmbeddedRedis
from workers.loop.worker import Worker, WorkerSettings
from workers.process.watch import StatusPipe

N = 50
NAMES = [f"t-many-{i}" for i in range(N)]
CLIENT_NAME = "c1-many-gateway"
# What the gateway process holds on one Redis, whatever the number of pipelines: the hub's pool
# (max_connections), its submissions' held connection, its reply list's held connection and pool
# (one each), and the views' one connection.
CONNECTION_BOUND = GatewaySettings().max_connections + 4


class Offset(Stage):
    """Adds its pipeline's own offset: each pipeline's answer is told apart."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    def predict(self, x: Any) -> Any:
        return x + self.offset


@contextlib.contextmanager
def worker_threads(redis_url: str) -> Iterator[list[Worker]]:
    """One worker per pipeline, each on a thread of its own; stopped (each commits its batch) after the block."""
    workers = []
    for i, name in enumerate(NAMES):
        pipeline = Pipeline(name).add(Offset, offset=i)
        workers.append(Worker(pipeline, pipeline.stages[0], RedisSettings(redis_url),
                              f"Offset@test:{os.getpid()}:{i}:0", WorkerSettings(), StatusPipe(None)))
    threads = [threading.Thread(target=w.run, name=f"worker-{i}", daemon=True) for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    try:
        yield workers
    finally:
        for worker in workers:
            worker.request_stop()
        for thread in threads:
            thread.join(timeout=10)
        assert not [t.name for t in threads if t.is_alive()], "worker threads did not stop"


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    resp = get(port, "/readyz")
    return resp.status, json.loads(resp.body)


def gateway_connections(admin: redis.Redis) -> int:
    return sum(1 for client in admin.client_list() if client.get("name") == CLIENT_NAME)


@pytest.mark.system  # a gateway process and 50 workers
def test_a_gateway_serving_fifty_pipelines_is_ready_answers_each_and_holds_few_connections(redis_url: str) -> None:
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-many-"))
    # The gateway's connections carry a name of their own, so CLIENT LIST tells them apart.
    gateway = start_conveyor(log_dir, "gateway", "gateway", *NAMES, "--redis", f"{redis_url}?client_name={CLIENT_NAME}",
                             "--port", str(port), redis_url=redis_url)
    procs: list[Proc] = [gateway]
    admin = redis.Redis.from_url(redis_url)
    try:
        def listening() -> bool:
            gateway.check_running()
            return status_code(port, "/healthz") == 200

        wait_for(listening, 30, "the gateway to listen", gateway.report)
        with worker_threads(redis_url) as workers:
            wait_for(lambda: all(w.ready for w in workers), 30, "the 50 workers to be ready", gateway.report)
            ready_at = time.monotonic()
            wait_for(lambda: readyz(port)[0] == 200, 10, "/readyz to say ready",
                     lambda: f"{readyz(port)}\n{gateway.report()}")
            assert time.monotonic() - ready_at < 10
            samples = []
            for _ in range(8):  # it stays ready: several refreshes of the views (one a second)
                samples.append(readyz(port))
                time.sleep(0.3)
            assert [status for status, _ in samples] == [200] * 8, samples
            body = samples[-1][1]
            assert sorted(body["pipelines"]) == sorted(NAMES) and body["error"] is None
            assert all(p["ready"] and p["stages"][0]["live_workers"] == 1 for p in body["pipelines"].values())
            for i, name in enumerate(NAMES):
                request = http_request("POST", f"/v1/pipelines/{name}/predict", b"1000",
                                       {"content-type": "application/json"})
                resp = exchange(port, request, "POST", 10.0)
                assert (resp.status, json.loads(resp.body)) == (200, {"result": 1000 + i}), (name, resp)
            held = gateway_connections(admin)
            assert 1 <= held <= CONNECTION_BOUND, (held, [c for c in admin.client_list() if c.get("name")])
            metrics = get(port, "/metrics")
            assert metrics.status == 200 and b"conveyor_redis_reachable 1.0" in metrics.body
            assert metrics.body.count(b"conveyor_pipeline_ready{") == N
            assert readyz(port)[0] == 200
            assert gateway_connections(admin) <= CONNECTION_BOUND  # probes and scrapes open none
    finally:
        admin.close()
        stop_all(procs)



@pytest.mark.redis
def test_readyz_from_a_view_no_refresh_reached_says_stale_then_recovers(private_redis: EmbeddedRedis) -> None:
    """Redis gone: the view's status is kept for STALE_AFTER_S (it is at most that old), then readiness
    says the view is stale, 503; Redis back: the views are read again (here an empty Redis: not registered)."""
    admin = redis.Redis.from_url(private_redis.url)
    admin.set(Keys("t-stale").spec, encode_spec([StageInfo(0, "Only")]))
    admin.close()

    def body(port: int) -> dict[str, Any]:
        status, raw = http_call(port, "GET", "/readyz")
        assert status == 503, raw  # never ready: no worker
        return dict(json.loads(raw))

    def saying(port: int, words: str, timeout_s: float) -> dict[str, Any]:
        def answer() -> dict[str, Any] | None:
            got = body(port)
            return got if words in got["error"] else None

        found = wait_for(answer, timeout_s, f"/readyz to say {words!r}")
        assert found is not None
        return found

    async def main() -> None:
        async with Gateway(private_redis.url, "t-stale") as gw:
            server = HttpServer(gw, HttpSettings(port=0))
            await server.start()
            try:
                fresh = await asyncio.to_thread(body, server.port)
                assert fresh["reachable"] and "no live worker" in fresh["error"], fresh
                private_redis.kill()
                gone_at = time.monotonic()
                stale = await asyncio.to_thread(saying, server.port, "stale", STALE_AFTER_S + 5)
                assert time.monotonic() - gone_at > STALE_AFTER_S - REFRESH_S, "stale before its bound"
                assert not stale["reachable"] and "old" in stale["error"], stale
                private_redis.start()
                # Nothing persisted: the spec is gone, and the view says so (read again, not stale).
                back = await asyncio.to_thread(saying, server.port, "not registered", 10)
                assert back["reachable"], back
            finally:
                await server.close()

    asyncio.run(asyncio.wait_for(main(), 60))
