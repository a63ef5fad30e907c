"""Redis refusing writes (maxmemory reached with noeviction) is overload, not a crash."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gateway import Gateway, GatewaySettings, Overloaded
from tests.helpers import running_workers
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "examples.scale_shift:pipeline"


def test_out_of_memory_refuses_requests_then_service_resumes(private_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    with running_workers(private_redis.url, APP, ["Scale", "Shift"]) as workers:
        workers.wait_ready("scale-shift")
        pids = {c.pid for p in workers.procs for c in p.children()}

        async def scenario() -> None:
            async with Gateway(private_redis.url, "scale-shift", GatewaySettings(timeout_s=10)) as gw:
                assert await gw.predict(1) == 5
                admin.config_set("maxmemory", 1)  # every write is refused with OOM from now on
                with pytest.raises(Overloaded, match=r"memory"):
                    await asyncio.wait_for(gw.predict(2), 5)  # refused at once, well before its deadline
                admin.config_set("maxmemory", 0)
                answers = await asyncio.wait_for(asyncio.gather(*(gw.predict(v) for v in range(20))), 20)
                assert answers == [v * 2 + 3 for v in range(20)]
                assert (await gw.pipeline_status()).reachable, "the gateway's tasks survived the refusals"

        asyncio.run(scenario())
        workers.check_alive()
        assert {c.pid for p in workers.procs for c in p.children()} == pids, "no worker crashed"
    admin.close()
