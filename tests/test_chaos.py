"""Chaos: up to 8,000 requests (as many as a minute allows) through a 2-stage pipeline while workers
are SIGKILLed and every Redis client connection is dropped, and every request still gets exactly
one, correct answer.

Two ``conveyor worker`` processes (``--workers 2`` each, one per stage) run
``tests.chaos_stages:chaos`` (f(x) = 3 x + 1, batched, ``claim_idle_s`` = 1 s) on a private
Redis. One gateway keeps 256 requests in flight while a chaos thread SIGKILLs a random worker
child every 0.5 s (the supervisors restart them) and three times drops every client connection
(``CLIENT KILL TYPE normal SKIPME yes``): the workers' and the gateway's. Only workers up for a
second or more and already connected to Redis are killed: three deaths in a row before 'ready'
make a supervisor give up on its stage by design (a stage that cannot start), which is not what
this test is about, and on a loaded machine a worker's imports alone can take over a second.

What is checked: every request answered (none lost: no TimeoutError, no error), each answer
equal to f(its input) (none misrouted), no request id pushed twice to the gateway's reply list
(none duplicated: first write wins even when a killed worker's batch runs again), nothing left
in the streams or pending lists at the end, and the supervisors still up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import redis

from broker import codec
from broker.keys import GROUP, Keys
from broker.replies import ReplyList
from gateway import Gateway, GatewaySettings, StageError
from gateway.client.hub import Hub
from tests.chaos_stages import chaos_f
from tests.helpers import Workers, running_workers, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.chaos_stages:chaos"
PIPELINE = "c-chaos"
REQUESTS = 8_000  # ~10 s of load on 2 cores: some 15 kills and the three drops
SEND_FOR_S = 60.0  # no new request after this: a slow machine (workers restarting for seconds) sends fewer
MIN_SENT = 1_000  # what the chaos must have met, at least
IN_FLIGHT = 256
KILL_EVERY_S = 0.5
CONNECTION_DROPS = 3
TIMEOUT_S = 60.0
LOAD_BOUND_S = 150.0  # the whole load, chaos included: sending (at most SEND_FOR_S), then what is in flight
MIN_AGE_S = 1.0  # only kill workers that are up (see the module docstring)


class CountingHub(Hub):
    """A gateway hub that counts, per request id, the records pushed to its reply list (each id must
    be pushed at most once) apart from those it re-read from result keys after a reconnect."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: collections.Counter[str] = collections.Counter()
        self.recovered: collections.Counter[str] = collections.Counter()
        self.recoveries = 0
        self._recovering = False

    def _deliver(self, element: bytes) -> None:
        with contextlib.suppress(codec.CodecError):
            counter = self.recovered if self._recovering else self.pushed
            for record in codec.decode(element):
                counter[str(record.get("id"))] += 1
        super()._deliver(element)

    async def _recover(self, replies: ReplyList, reread: bool) -> None:
        self.recoveries += 1
        self._recovering = True
        try:
            await super()._recover(replies, reread)
        finally:
            self._recovering = False


class CountingGateway(Gateway):
    """A gateway on a :class:`CountingHub` of its own."""

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings) -> None:
        self.counting = CountingHub(redis_url, settings)
        super().__init__(redis_url, pipeline, settings, hub=self.counting)
        self._own_hub = True  # started and closed with this gateway

    @property
    def pushed(self) -> collections.Counter[str]:
        return self.counting.pushed

    @property
    def recovered(self) -> collections.Counter[str]:
        return self.counting.recovered

    @property
    def recoveries(self) -> int:
        return self.counting.recoveries


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    wrong: list[tuple[int, Any]] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    answered: int = 0
    sent: int = 0
    duration_s: float = 0.0


def connected(proc: psutil.Process) -> bool:
    """Whether the worker holds a socket (its Redis connections, opened once its imports are
    done; 'ready' follows within milliseconds for these trivial stages)."""
    net_connections = getattr(proc, "net_connections", None) or proc.connections
    return bool(net_connections(kind="all"))


@dataclass
class Chaos:
    """SIGKILLs a random worker child every KILL_EVERY_S; drops all client connections when
    a quarter, half and three quarters of the requests are answered, or of ``SEND_FOR_S`` has passed
    (whichever comes first: a slow machine answers fewer)."""

    workers: Workers
    redis_url: str
    outcome: Outcome
    stop: threading.Event = field(default_factory=threading.Event)
    kills: int = 0
    drops: list[int] = field(default_factory=list)  # clients killed by each CLIENT KILL
    seed: int = field(default_factory=lambda: random.randrange(2**32))

    def victims(self) -> list[psutil.Process]:
        now = time.time()
        found = []
        for proc in self.workers.procs:
            for child in proc.children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if now - child.create_time() >= MIN_AGE_S and connected(child):
                        found.append(child)
        return found

    def run(self) -> None:
        rng = random.Random(self.seed)
        admin = redis.Redis.from_url(self.redis_url)
        try:
            started = last_print = time.monotonic()
            while not self.stop.wait(KILL_EVERY_S):
                if time.monotonic() - last_print > 5:
                    last_print = time.monotonic()
                    print(f"[chaos] answered={self.outcome.answered} errors={dict(self.outcome.errors)} "
                          f"kills={self.kills} drops={self.drops}", flush=True)
                victims = self.victims()
                if victims:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        rng.choice(victims).kill()
                        self.kills += 1
                due = (len(self.drops) + 1) / (CONNECTION_DROPS + 1)
                if len(self.drops) < CONNECTION_DROPS and (self.outcome.answered >= due * REQUESTS
                                                           or time.monotonic() - started >= due * SEND_FOR_S):
                    self.drops.append(int(admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")))
        finally:
            admin.close()


async def load(gw: Gateway, outcome: Outcome) -> None:
    until = time.monotonic() + SEND_FOR_S

    def sending() -> Iterator[int]:
        for x in range(REQUESTS):
            if time.monotonic() > until:
                return
            outcome.sent += 1
            yield x

    inputs = sending()

    async def client() -> None:
        for x in inputs:
            started = time.perf_counter()
            try:
                y = await gw.predict(x)
            except (StageError, TimeoutError) as exc:
                outcome.errors[type(exc).__name__ + (f":{exc.type}" if isinstance(exc, StageError) else "")] += 1
                continue
            finally:
                outcome.answered += 1
            outcome.latencies.append(time.perf_counter() - started)
            if y != chaos_f(x):
                outcome.wrong.append((x, y))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(IN_FLIGHT)))
    outcome.duration_s = time.perf_counter() - started


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def assert_drained(url: str, workers: Workers) -> None:
    """Nothing left behind: every stream empty, nothing pending (duplicates included)."""
    keys = Keys(PIPELINE)
    client = redis.Redis.from_url(url)
    try:
        def drained() -> bool:
            return all(client.xlen(keys.stream(i)) == 0 and client.xpending(keys.stream(i), GROUP)["pending"] == 0
                       for i in (0, 1))

        wait_for(drained, 30, "the streams to drain after the load", workers.report)
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_no_request_lost_duplicated_or_misrouted_under_chaos(private_redis: EmbeddedRedis) -> None:
    url = private_redis.url
    outcome = Outcome()
    env = {"CONVEYOR_LOG_LEVEL": "WARNING"}
    with running_workers(url, APP, [("Triple", 2), ("Inc", 2)], **env) as workers:
        workers.wait_ready(PIPELINE, 30, workers={"Triple": 2, "Inc": 2})
        first_pids = {c.pid for p in workers.procs for c in p.children()}
        chaos = Chaos(workers, url, outcome)
        thread = threading.Thread(target=chaos.run, name="chaos", daemon=True)
        gw = CountingGateway(url, PIPELINE, GatewaySettings(timeout_s=TIMEOUT_S))

        async def main() -> None:
            async with gw:
                thread.start()
                try:
                    await asyncio.wait_for(load(gw, outcome), LOAD_BOUND_S)
                finally:
                    chaos.stop.set()
                assert gw.in_flight == 0

        try:
            asyncio.run(main())
        finally:
            chaos.stop.set()
            thread.join(10)
        workers.check_alive()
        assert_drained(url, workers)
        last_pids = {c.pid for p in workers.procs for c in p.children()}

    lat = sorted(outcome.latencies)
    duplicated = {i: n for i, n in gw.pushed.items() if n > 1}
    print(f"\nchaos (seed {chaos.seed}): {outcome.sent} requests, {IN_FLIGHT} in flight, {outcome.duration_s:.1f} s "
          f"({outcome.sent / outcome.duration_s:.0f} req/s)")
    print(f"  answered {outcome.answered}, correct {len(lat) - len(outcome.wrong)}, wrong {len(outcome.wrong)}, "
          f"errors {dict(outcome.errors)}, duplicated pushes {len(duplicated)}")
    print(f"  worker kills {chaos.kills}, connection drops {len(chaos.drops)} (clients killed {chaos.drops}), "
          f"gateway recoveries {gw.recoveries} (records re-read {sum(gw.recovered.values())}), "
          f"worker pids seen first {len(first_pids)}, survivors {len(first_pids & last_pids)}")
    print(f"  latency p50 {percentile(lat, 0.5) * 1e3:.1f} ms, p99 {percentile(lat, 0.99) * 1e3:.1f} ms, "
          f"p999 {percentile(lat, 0.999) * 1e3:.1f} ms, max {lat[-1] * 1e3 if lat else float('nan'):.1f} ms")

    assert outcome.sent >= MIN_SENT, f"only {outcome.sent} requests sent in {SEND_FOR_S:g} s"
    assert outcome.answered == outcome.sent
    assert not outcome.errors, f"requests lost or failed: {dict(outcome.errors)}"
    assert not outcome.wrong, f"misrouted answers: {outcome.wrong[:10]}"
    assert len(lat) == outcome.sent
    assert not duplicated, f"ids pushed more than once: {list(duplicated.items())[:10]}"
    assert chaos.kills >= 10, "the chaos did not happen"
    assert len(chaos.drops) == CONNECTION_DROPS and all(n > 0 for n in chaos.drops)
