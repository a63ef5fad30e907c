"""The gateway's view of a pipeline on a Redis Cluster while one master is killed (SIGKILL, no replica)."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker.connection import CONNECTION_ERRORS
from broker.keys import Keys
from gateway import Gateway, Overloaded
from gateway.client.gateway import partition_of
from tests.cluster import LocalCluster
from tests.helpers import running_workers

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0
WATCH_S = 8.0  # refreshes watched after the kill
NAMED_WITHIN_S = 5.0  # the dead master's partition is named out of reach within this


@pytest.mark.parametrize("partition", [0, 1])
def test_a_killed_master_leaves_the_other_masters_partitions_reachable(partial_cluster: LocalCluster,
                                                                       partition: int) -> None:
    """Three partitions on three masters, one master killed. redis-py's cluster pipeline met the dead node's
    connection error by closing its whole client and retrying: the reads of the healthy masters' partitions,
    under way at once on that client, lost their connections ("Connection closed by server") or their answer
    within the bound, and the view named them out of reach too (requests keyed to them refused, 503) for a
    refresh or more. Only the dead master's partition is named, refresh after refresh; the others serve."""
    keys = Keys("t-parts1").partitions(3)
    masters = [partial_cluster.master_of(k.spec) for k in keys]
    assert len(set(masters)) == 3, masters
    healthy = [p for p in range(3) if p != partition]
    key_of = {partition_of(f"k{i}", 3): f"k{i}" for i in range(50)}
    with running_workers(partial_cluster.url, "tests.cluster_stages:partitioned", ["Scale", "Shift"],
                         stop_timeout_s=40) as workers:
        workers.wait_ready("t-parts1", T, workers={"Scale": 2})

        async def main() -> tuple[list[str], float | None, list[str]]:
            wrong: list[str] = []  # a healthy partition named out of reach, and when
            named_after: float | None = None  # when the dead one was first named
            refused: list[str] = []  # requests keyed to healthy partitions that failed
            async with Gateway(partial_cluster.url, "t-parts1") as gw:
                view = gw.view
                assert view is not None
                for p in range(3):
                    assert await gw.predict(1, key=key_of[p]) == 5
                partial_cluster.kill(masters[partition])
                killed_at = time.monotonic()
                v = 0
                while (since := time.monotonic() - killed_at) < WATCH_S:
                    await gw.views.next_refresh()
                    status = await gw.pipeline_status()
                    unreached = {p for p, s in enumerate(status.by_partition) if not s.reachable} | set(view.down)
                    if partition in unreached and named_after is None:
                        named_after = since
                    if unreached - {partition}:
                        wrong.append(f"{sorted(unreached)} at {since:.1f}s: {status.error[:160]}")
                    for p in healthy:
                        v += 1
                        try:
                            assert await gw.predict(v, key=key_of[p], timeout_s=5.0) == 2 * v + 3
                        except (Overloaded, TimeoutError, *CONNECTION_ERRORS) as exc:
                            refused.append(f"partition {p} at {since:.1f}s: {exc!r}"[:200])
            return wrong, named_after, refused

        wrong, named_after, refused = asyncio.run(asyncio.wait_for(main(), 60))
    assert not wrong, f"healthy partitions named out of reach: {wrong}"
    assert not refused, f"requests keyed to healthy partitions failed: {refused}"
    assert named_after is not None and named_after < NAMED_WITHIN_S, named_after
