"""The gateway view's per-node partition reads (:class:`broker.status.NodeReads`) on a Redis Cluster whose slot map
changed under them: slots moved to another master, a master failed over to its replica (both alive)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.cluster import key_slot

from broker.connection import RedisSettings
from broker.keys import Keys
from broker.status import NodeReads, PartitionQuery, PartitionReads
from tests.cluster import LocalCluster

pytestmark = pytest.mark.system  # a Redis Cluster of its own


def _queries(prefix: str) -> tuple[list[Keys], list[PartitionQuery]]:
    keys = Keys(prefix).partitions(6)
    return keys, [PartitionQuery(k, (b"0",)) for k in keys]


def test_partitions_of_two_masters_whose_slots_moved_are_read_not_named_out_of_reach(
        partial_cluster: LocalCluster) -> None:
    """Two masters' partitions moved to the third: both nodes answer MOVED, and their partitions were read through
    the cluster client at once; on its one connection per node the second read failed ("Too many connections"),
    its healthy partitions named out of reach for a refresh."""
    keys, queries = _queries("t-moved2")
    masters = [partial_cluster.master_of(k.spec) for k in keys]
    a = masters[0]
    b = next(m for m in masters if m != a)
    target = next(p for p in partial_cluster.ports if p not in (a, b))

    async def main() -> list[PartitionReads | BaseException]:
        client = RedisSettings(partial_cluster.url).async_client(1)  # as the gateway's view makes it
        nodes = NodeReads(client)
        try:
            assert all(isinstance(r, PartitionReads) for r in await nodes.read(queries))
            assert all(isinstance(r, PartitionReads) for r in await nodes.read(queries))  # on the nodes' own clients
            for k, m in zip(keys, masters, strict=True):
                if m in (a, b):
                    partial_cluster.move_slot(key_slot(k.spec.encode()), m, target)
            return await nodes.read(queries)
        finally:
            await nodes.aclose()
            await client.aclose()

    got = asyncio.run(asyncio.wait_for(main(), 30))
    assert all(isinstance(r, PartitionReads) for r in got), got


def test_a_master_demoted_to_replica_has_its_client_closed(failover_cluster: LocalCluster) -> None:
    """A manual failover: the old master lives on as a replica, no longer read; its client was kept open for ever
    (one per node so demoted, or gone from the map)."""
    keys, queries = _queries("t-demoted")
    old = failover_cluster.master_of(keys[0].spec)
    replica = failover_cluster.replica_of(old)
    old_name = f"{failover_cluster.host}:{old}"

    async def main() -> set[str]:
        client = RedisSettings(failover_cluster.url).async_client(1)
        nodes = NodeReads(client)
        try:
            await nodes.read(queries)
            await nodes.read(queries)
            assert old_name in nodes._clients, sorted(nodes._clients)
            with failover_cluster.node(replica) as node:
                node.execute_command("CLUSTER", "FAILOVER")
            deadline = time.monotonic() + 15
            while failover_cluster.master_of(keys[0].spec) != replica:
                assert time.monotonic() < deadline, "no failover"
                await asyncio.sleep(0.1)
            for _ in range(3):
                got = await nodes.read(queries)
                assert all(isinstance(r, PartitionReads) for r in got), got
            return set(nodes._clients)
        finally:
            await nodes.aclose()
            await client.aclose()

    clients = asyncio.run(asyncio.wait_for(main(), 40))
    assert old_name not in clients, sorted(clients)
