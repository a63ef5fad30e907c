"""A Redis at its maxmemory refuses writes, the workers' heartbeats among them: their stages then look
dead. ``conveyor status`` and the gateway's readiness said only "no live worker", which sent operators
after workers that were fine; now they say that Redis is full (real Redis, real workers)."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from click.testing import CliRunner

from broker.server_info import full_memory
from gateway import Gateway, GatewaySettings
from gateway.cli import status as status_command
from gateway.monitor.status import PipelineStatus
from tests.helpers import running_workers, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system

MIB = 2**20


@pytest.mark.unit
@pytest.mark.parametrize("policy, used, said", [("noeviction", 5 * MIB, True), ("volatile-lru", 5 * MIB, True),
                                                ("allkeys-lru", 5 * MIB, False), ("noeviction", 3 * MIB, False)])
def test_full_memory_is_said_only_where_writes_are_refused(policy: str, used: int, said: bool) -> None:
    memory = {"maxmemory": 4 * MIB, "used_memory": used, "mem_not_counted_for_evict": 0, "maxmemory_policy": policy}
    text = full_memory(memory)
    assert (text is not None) is said
    assert full_memory({"maxmemory": 0, "used_memory": used, "maxmemory_policy": policy}) is None  # no limit
    if text is not None:
        assert "maxmemory" in text and policy in text and "heartbeats" in text


def _fill(client: redis.Redis) -> None:
    """Ballast, then a maxmemory below what is used: Redis refuses every write that may grow memory."""
    client.config_set("maxmemory-policy", "noeviction")
    for i in range(8):
        client.set(f"ballast:{i}", b"x" * MIB)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 4 * MIB)  # buffers come and go
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("one-more", b"x")


def _cause_said(status: PipelineStatus) -> bool:
    return any("Redis is at its maxmemory" in reason for reason in status.not_ready_stages)


def _status_error(url: str) -> str:
    """What ``conveyor status --json`` says is wrong ("" when ready)."""
    result = CliRunner().invoke(status_command, ["t-raises", "--redis", url, "--json"])
    return json.loads(result.output)["error"] or ""


def test_a_full_redis_is_named_not_only_the_dead_looking_stages(private_redis: EmbeddedRedis) -> None:
    url = private_redis.url
    client = redis.Redis.from_url(url)

    async def gateway_says() -> bool:
        async with Gateway(url, "t-raises", GatewaySettings(timeout_s=5)) as gw:
            status = await wait_for_async(gw)
            return _cause_said(status)

    async def wait_for_async(gw: Gateway) -> PipelineStatus:
        for _ in range(100):  # the view refreshes every second: 20 s at most
            status = await gw.pipeline_status()
            if _cause_said(status):
                return status
            await asyncio.sleep(0.2)
        return status

    try:
        with running_workers(url, "tests.first_hour_stages:raises", ["raises"]) as group:
            group.wait_ready("t-raises")
            assert _status_error(url) == ""
            _fill(client)
            error = wait_for(lambda: (lambda e: e if "maxmemory" in e else "")(_status_error(url)), 20,
                             "conveyor status to name Redis's maxmemory")
            assert error.startswith("stage raises: no live worker; Redis is at its maxmemory"), error
            assert asyncio.run(gateway_says())
            client.flushdb()  # room again: the ballast goes (the workers' keys are written again)
            client.config_set("maxmemory", 0)
            group.wait_ready("t-raises")
    finally:
        client.config_set("maxmemory", 0)
        client.close()
