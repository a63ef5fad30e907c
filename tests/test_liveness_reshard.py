"""A worker's beats on a Redis Cluster while a reshard moves its partition's slot: each is written, on the
node that holds the heartbeat key (ASK followed while the slot migrates; MOVED once it moved)."""

from __future__ import annotations

import pytest
import redis
from redis.cluster import key_slot

from broker import protocol
from broker.connection import RedisSettings
from broker.keys import Keys
from broker.liveness import Beat
from tests.cluster import LocalCluster


def _beat(client: redis.Redis, hb: str) -> tuple[int, list[object]]:
    now = protocol.now_ms()
    beat = Beat(client)
    beat.alive(hb, "me", now)
    return now, beat.send()


@pytest.mark.system
def test_a_beat_reaches_its_key_while_the_slot_migrates_and_once_it_moved(partial_cluster: LocalCluster) -> None:
    cluster = partial_cluster
    client = RedisSettings(cluster.url).sync_client(retries=False)
    try:
        hb = Keys("t-ask").heartbeats(0)
        client.zadd(hb, {"me": 1})
        slot = key_slot(hb.encode())
        source = cluster.master_of(hb)
        target = next(p for p in cluster.ports if p != source)
        source_id, target_id = cluster.node_id(source), cluster.node_id(target)
        with cluster.node(source) as src, cluster.node(target) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            src.execute_command("MIGRATE", cluster.host, target, "", 0, 5000, "KEYS", hb)  # the key moved: ASK
            asked_at, asked = _beat(client, hb)
            for node in (dst, src):  # the migration ends; the client's slot map still names the source
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            moved_at, moved = _beat(client, hb)
            score = dst.zscore(hb, "me")
        assert asked == [0, 0], asked  # ZADD (an update), ZREMRANGEBYSCORE: not the source's ASK
        assert moved == [0, 0], moved  # not the source's MOVED: sent again to the target
        assert score == moved_at > asked_at
    finally:
        client.close()
