"""A request to a pipeline one of whose stages has no live or loading worker fails fast (503 over HTTP,
with Retry-After), naming the stage, once that has lasted the grace; a loading worker counts as one."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from broker.keys import Keys
from broker.protocol import now_ms
from broker.spec import StageInfo, encode_spec
from gateway import Gateway, GatewaySettings
from gateway.client import gateway as gateway_module
from gateway.errors import Overloaded

pytestmark = pytest.mark.redis

NAME = "unserved"
T = 10.0


def test_a_stage_without_workers_fails_new_requests_fast_naming_it(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = Keys(NAME)
    redis_client.set(keys.spec, encode_spec([StageInfo(0, "Scale", 1, 0.0, None), StageInfo(1, "Shift", 8, 0.0, None)]))
    redis_client.zadd(keys.heartbeats(0), {"w-scale": now_ms() + 60_000})  # Scale is served, Shift is not
    monkeypatch.setattr(gateway_module, "UNSERVED_GRACE_S", 0.5)

    async def main() -> None:
        async with Gateway(redis_url, NAME, GatewaySettings(timeout_s=T)) as gw:
            started = time.monotonic()
            while gw.unserved is None and time.monotonic() - started < T:
                await gw.views.refreshed(gw.view)
            with pytest.raises(Overloaded, match="stage 'Shift' of pipeline 'unserved' has no live or loading worker"):
                await gw.predict(1)
            assert time.monotonic() - started < T / 2  # not the request's deadline
            redis_client.zadd(keys.loading(1), {"w-shift": now_ms()})  # a worker loading its model: wait for it
            await gw.views.refreshed(gw.view)
            await gw.views.refreshed(gw.view)
            assert gw.unserved is None
            with pytest.raises(asyncio.TimeoutError | TimeoutError):
                await asyncio.wait_for(gw.predict(2), 0.5)  # submitted: it waits for the loading worker

    asyncio.run(main())


def test_without_fail_fast_a_request_reaches_the_stream_of_a_stage_at_zero(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-fail-fast`` (a stage scaled to zero on purpose, as KEDA does): the request goes to the first
    stage's stream, whose backlog is what wakes the stage, and waits there within its deadline."""
    keys = Keys(NAME)
    redis_client.set(keys.spec, encode_spec([StageInfo(0, "Scale", 1, 0.0, None)]))
    redis_client.xgroup_create(keys.stream(0), "workers", id="0", mkstream=True)
    monkeypatch.setattr(gateway_module, "UNSERVED_GRACE_S", 0.0)

    async def main() -> None:
        async with Gateway(redis_url, NAME, GatewaySettings(timeout_s=T, fail_fast=False)) as gw:
            await gw.views.refreshed(gw.view)
            await gw.views.refreshed(gw.view)
            assert gw.unserved is None
            with pytest.raises(asyncio.TimeoutError | TimeoutError):
                await asyncio.wait_for(gw.predict(3), 0.5)
            assert redis_client.xlen(keys.stream(0)) == 1  # in the stream: KEDA's streamLength sees it

    asyncio.run(main())
