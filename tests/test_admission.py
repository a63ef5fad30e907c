"""Admission in Redis: ``max_backlog`` holds in the submit script, for every producer at once.

The worker's ``setup`` takes a second (a model loading): the gateways and a foreign producer
burst while nothing consumes, so exactly ``max_backlog`` entries can be admitted and the
stream must never hold more, whatever the number of gateways.
"""

from __future__ import annotations

import asyncio
import threading
import time
from importlib import resources
from typing import Any

import pytest
import redis

from broker.keys import Keys
from broker.spec import StageInfo, encode_spec
from gateway import Gateway, GatewaySettings, Overloaded
from tests.helpers import running_workers, wait_for
from workers import Pipeline, Stage

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

BACKLOG = 20
BURST = 10 * BACKLOG
NAME = "t-admission"
KEYS = Keys(NAME)
T = 20.0


class SlowStart(Stage):
    max_backlog = BACKLOG

    def setup(self) -> None:
        time.sleep(1.0)  # the model loads: nothing is consumed meanwhile

    def predict(self, x: Any) -> Any:
        return x + 1


pipeline = Pipeline(NAME).add(SlowStart)


class XlenSampler(threading.Thread):
    """Samples the first stage's length as fast as one connection allows, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.peak = max(self.peak, int(self.client.xlen(KEYS.stream(0))))
                self.samples += 1
        finally:
            self.client.close()


def foreign_submit(client: redis.Redis, request_id: str) -> Any:
    """What docs/protocol.md tells a producer in another language to do: EVAL the submit script."""
    script = resources.files("broker").joinpath("submit.lua").read_text()
    reply = KEYS.reply("foreign")
    return client.eval(script, 2, KEYS.stream(0), KEYS.max_backlog, 1, "", request_id, b"\x05", reply,
                       int(time.time() * 1000) + 10_000)


async def burst(gateways: list[Gateway]) -> tuple[list[Any], float]:
    """BURST requests spread over the gateways; returns outcomes and the slowest refusal."""
    slowest = 0.0

    async def one(x: int) -> Any:
        nonlocal slowest
        started = time.monotonic()
        try:
            return await gateways[x % len(gateways)].predict(x)
        except Overloaded as exc:
            slowest = max(slowest, time.monotonic() - started)
            return exc

    return list(await asyncio.gather(*(one(x) for x in range(BURST)))), slowest


def test_max_backlog_holds_from_the_first_request_for_every_producer(redis_url: str,
                                                                     redis_client: redis.Redis) -> None:
    sampler = XlenSampler(redis_url)
    with running_workers(redis_url, "tests.test_admission:pipeline", ["SlowStart"]) as workers:
        async def main() -> tuple[list[Any], float, Any]:
            settings = GatewaySettings(timeout_s=T)
            async with Gateway(redis_url, NAME, settings) as a, Gateway(redis_url, NAME, settings) as b:
                # Registration (before setup) puts the limit in Redis; the worker is not consuming yet.
                await asyncio.to_thread(wait_for, lambda: redis_client.exists(KEYS.max_backlog), T,
                                        "the worker to register the pipeline", workers.report)
                sampler.start()
                task = asyncio.ensure_future(burst([a, b]))
                # While the stream is full (the worker is still in setup), a foreign producer is refused too.
                await asyncio.to_thread(wait_for, lambda: redis_client.xlen(KEYS.stream(0)) >= BACKLOG, T,
                                        "the burst to fill the stream")
                try:
                    foreign: Any = foreign_submit(redis_client, "foreign-1")
                except redis.ResponseError as exc:
                    foreign = exc
                outcomes, slowest = await task
                return outcomes, slowest, foreign

        try:
            outcomes, slowest, foreign = asyncio.run(asyncio.wait_for(main(), 3 * T))
        finally:
            sampler.done.set()
            sampler.join(5)

    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    served = [(x, o) for x, o in enumerate(outcomes) if not isinstance(o, Overloaded)]
    assert sampler.samples > 0 and sampler.peak <= BACKLOG, (sampler.peak, sampler.samples)
    # Nothing consumed while the burst ran: exactly the bound was admitted, every other request refused.
    assert len(served) == BACKLOG and len(refused) == BURST - BACKLOG
    assert all(o == x + 1 for x, o in served)
    assert "max_backlog" in str(refused[0])
    assert slowest < 2.0, f"a refusal took {slowest:.2f}s: it must come at once, not at a timeout"
    assert isinstance(foreign, redis.ResponseError) and str(foreign).startswith("OVERLOADED"), foreign


def test_gateway_limit_and_partial_admission(redis_url: str, redis_client: redis.Redis) -> None:
    """A gateway's own max_backlog applies in the script too (the stricter wins), and one turn of
    submissions is admitted in part: its head in, the rest Overloaded. No worker: nothing drains
    (the pipeline is registered by hand, as a worker would, with no limit of its own)."""
    redis_client.set(KEYS.spec, encode_spec([StageInfo(0, "SlowStart")]))
    redis_client.set(KEYS.max_backlog, "none")

    async def main() -> list[Any]:
        async with Gateway(redis_url, NAME, GatewaySettings(timeout_s=2.0, max_backlog=5)) as gw:
            async def one(x: int) -> Any:
                try:
                    return await gw.predict(x, timeout_s=0.5)
                except (Overloaded, TimeoutError) as exc:
                    return type(exc)

            return list(await asyncio.gather(*(one(x) for x in range(12))))

    outcomes = asyncio.run(asyncio.wait_for(main(), T))
    assert outcomes.count(Overloaded) == 7 and outcomes.count(TimeoutError) == 5
    assert outcomes[:5] == [TimeoutError] * 5  # the head of the turn got in
    assert redis_client.xlen(KEYS.stream(0)) == 5


@pytest.mark.parametrize("limit", [None, 3])
def test_submit_script_counts(redis_client: redis.Redis, limit: int | None) -> None:
    """The script says how many it added; without a stored limit it adds everything."""
    if limit is not None:
        redis_client.set(KEYS.max_backlog, limit)
    script = resources.files("broker").joinpath("submit.lua").read_text()
    entries: list[Any] = []
    for k in range(5):
        entries += [f"r{k}", b"\x01", KEYS.reply("x"), 0]
    added = redis_client.eval(script, 2, KEYS.stream(0), KEYS.max_backlog, 5, "", *entries)
    assert added == (5 if limit is None else 3)
    assert redis_client.xlen(KEYS.stream(0)) == added


@pytest.mark.parametrize("limit", [None, 3])
@pytest.mark.parametrize("tail", [["", "-3"], ["", "2"], ["", "x"], ["", "0.5"], ["", "1", "2", "1", "t"],
                                  ["", "1", "1", "abc", "t"], ["", "1", "-1"], ["", "1", "abc"]],
                         ids=["h<0", "h>levels", "h-text", "h-fraction", "m>pairs", "m-position", "m<0", "m-text"])
def test_bad_optional_arguments_are_refused_before_anything_is_added(redis_client: redis.Redis, limit: int | None,
                                                                     tail: list[str]) -> None:
    """docs/protocol.md: an error reply adds nothing, so that a producer retrying on it does not duplicate its
    request. h (how many of the last KEYS are the streams of the levels above) and the trace pairs are read before
    the XADDs: one that cannot be right is an error before any entry is written (h < 0 added the entry, then
    failed on the UNLINK)."""
    if limit is not None:
        redis_client.set(KEYS.max_backlog, limit)
    script = resources.files("broker").joinpath("submit.lua").read_text()
    above = KEYS.at_level(1).stream(0)
    with pytest.raises(redis.ResponseError, match=r"submit\.lua"):
        redis_client.eval(script, 3, KEYS.stream(0), KEYS.max_backlog, above, 1, "", "rid4", b"\x01",
                          KEYS.reply("x"), 0, *tail)
    assert redis_client.xlen(KEYS.stream(0)) == 0
    # The same call with h = 1: added, the level above counted.
    good = [t if i != 1 else "1" for i, t in enumerate(tail[:2])]
    assert redis_client.eval(script, 3, KEYS.stream(0), KEYS.max_backlog, above, 1, "", "rid4", b"\x01",
                             KEYS.reply("x"), 0, *good) == 1
    assert [fields[b"id"] for _, fields in redis_client.xrange(KEYS.stream(0))] == [b"rid4"]
