"""conveyor on a real 3-master Redis Cluster (``redis+cluster://`` URL): seed 000 end to end."""

from __future__ import annotations

import asyncio

import pytest

from broker.connection import RedisSettings, _cluster_url
from gateway.client import Gateway
from tests.helpers import running_workers
from tests.test_pipeline_e2e import assert_drained

APP = "tests.stages"
T = 30.0


def test_cluster_url_convention() -> None:
    assert RedisSettings("redis+cluster://127.0.0.1:7000").is_cluster
    assert not RedisSettings("redis://127.0.0.1:7000/0").is_cluster
    assert _cluster_url("rediss+cluster://u:pw@a:1,b:2") == ("rediss://u:pw@a:1", [("a", 1), ("b", 2)])
    with pytest.raises(ValueError, match="host:port"):
        _cluster_url("redis+cluster://a")


def test_scale_shift_seed_000_on_cluster(cluster_url: str) -> None:
    with running_workers(cluster_url, f"{APP}:scale_shift", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-scale-shift", T, workers={"Scale": 2})

        async def main() -> None:
            async with Gateway(cluster_url, "t-scale-shift") as gw:
                assert await gw.predict(3) == 9
                values = list(range(200))
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [v * 2 + 3 for v in values]
                assert await gw.predict(2.5) == 8.0
                assert gw.in_flight == 0

        asyncio.run(asyncio.wait_for(main(), T))
        client = RedisSettings(cluster_url).sync_client()
        try:
            assert_drained(client, "t-scale-shift", 2)
        finally:
            client.close()
