"""A rolling restart of one stage under load loses no request.

What ``docker compose up -d`` with a new image (or a Kubernetes rollout) does to one stage's
containers: SIGTERM one ``conveyor worker``, start its replacement, then the next. A stopping
worker stops reading, finishes and commits the batch in hand, and exits; whatever it did not
read stays in the stream for the others. So no request may fail or wait for a reclaim
(``claim_idle_s`` is 30 s here, longer than the requests' deadline: an entry left pending by
a stopping worker would turn into a TimeoutError).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from broker.keys import GROUP, Keys
from gateway import Gateway, GatewaySettings
from tests.helpers import WorkerProc, start_worker, stop_process, wait_for, wait_ready
from tests.stop_stages import expected, rolling

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0
CONCURRENCY = 100
DEADLINE_S = 20.0
APP = "tests.stop_stages:rolling"


@dataclass
class Load:
    """Keeps CONCURRENCY predictions in flight through one Python gateway, in a thread."""

    redis_url: str
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        settings = GatewaySettings(timeout_s=DEADLINE_S)
        async with Gateway(self.redis_url, rolling.name, settings) as gw:
            await asyncio.gather(*(self._sender(gw, i) for i in range(CONCURRENCY)))

    async def _sender(self, gw: Gateway, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            x = i * 1_000_000 + n
            n += 1
            try:
                y = await gw.predict(x)
            except Exception as exc:  # every failure is what the test reports
                self.failures.append(f"{x}: {type(exc).__name__}: {exc}")
                continue
            if y != expected(x):
                self.failures.append(f"{x}: got {y!r}")
            self.answered += 1

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=DEADLINE_S + 5)
        assert not self.thread.is_alive(), "the load did not finish"


def _ready_line_count(proc: WorkerProc) -> int:
    return proc.log(chars=1_000_000).count("worker ready")


def test_restarting_a_stages_workers_one_by_one_under_load_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    procs = [start_worker(redis_url, APP, "SlowAdd", 1, tmp_path) for _ in range(2)]
    procs.append(start_worker(redis_url, APP, "SlowDouble", 1, tmp_path))
    load = Load(redis_url)

    def report() -> str:
        return "\n".join(p.report() for p in procs)

    try:
        wait_ready(redis_url, rolling.name, T, workers={"SlowAdd": 2, "SlowDouble": 1}, diagnostics=report)
        load.start()
        wait_for(lambda: load.answered >= 200 or load.failures, T, "traffic", report)
        for i in range(2):  # the SlowAdd workers, one after the other
            old = procs[i]
            stop_process(old.popen)
            assert old.popen.wait(timeout=T) == 0, old.report()
            assert "workers stopped" in old.log(), old.report()
            procs[i] = start_worker(redis_url, APP, "SlowAdd", 1, tmp_path)
            before = load.answered
            wait_for(lambda p=procs[i]: _ready_line_count(p) >= 1, T, "the replacement worker", report)
            wait_for(lambda b=before: load.answered >= b + 100 or load.failures, T, "traffic after the restart",
                     report)
        load.finish()
        assert not load.failures, f"{len(load.failures)} requests failed: {load.failures[:5]}\n{report()}"
        assert load.answered >= 400

        client = redis.Redis.from_url(redis_url)
        try:
            keys = Keys(rolling.name)
            for stage in (0, 1):
                pending = client.xpending(keys.stream(stage), GROUP)["pending"]
                assert pending == 0, f"stage {stage}: {pending} entries left pending"
        finally:
            client.close()
    finally:
        load.stop.set()
        deadline = time.monotonic() + T
        for proc in procs:
            stop_process(proc.popen)
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            finally:
                if proc.popen.poll() is None:
                    proc.popen.kill()
