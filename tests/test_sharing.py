"""Bursts shared with idle peers (workers/batching/sharing.py, broker/share.py and share.lua)
against a real Redis and real worker processes.

The pieces first: ``share.lua`` gives entries back whole and once, one call per idle peer gives
each its part, it works on a Redis Cluster; which peers are idle (``XINFO CONSUMERS``); how much
to share. Then two workers of one stage: a burst read whole by one is shared with the other, after
a quiet spell too, and not at all with ``share_bursts=False``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from broker import protocol
from broker.connection import RedisSettings
from broker.keys import GROUP, Keys
from broker.share import Sharer
from broker.streams import StreamReader
from gateway import Gateway
from tests.helpers import running_workers, wait_for
from workers.batching.sharing import SHARE_MIN_S, WAITED_MIN_S, BurstSharing, parts_to_share

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

KEYS = Keys("t-share-unit")
STREAM = KEYS.stream(0)
HEARTBEATS = KEYS.heartbeats(0)


@pytest.fixture
def stream(redis_client: redis.Redis) -> Iterator[str]:
    redis_client.delete(STREAM)
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    yield STREAM
    redis_client.delete(STREAM)


class BlockedReader(threading.Thread):
    """Reads ``STREAM`` as ``consumer`` with BLOCK, again after each empty read, until it gets entries."""

    def __init__(self, client: redis.Redis, consumer: str, count: int = 1) -> None:
        super().__init__(daemon=True)
        self.count = count
        self.consumer = consumer
        self.reader = StreamReader(client, STREAM, consumer)
        self.got: list[bytes] = []

    def run(self) -> None:
        for _ in range(50):
            entries = self.reader.read(self.count, block_ms=10_000)
            if entries:
                self.got = [e[0] for e in entries]
                return


def start_blocked(client: redis.Redis, *names: str, count: int = 32) -> list[BlockedReader]:
    readers = [BlockedReader(client, name, count) for name in names]
    for reader in readers:
        reader.start()
    wait_for(lambda: _all_blocked(client, len(names)), 5, "the peers blocked on the stream")
    return readers


def _all_blocked(client: redis.Redis, n: int) -> bool:
    return sum(1 for c in client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")) >= n


def test_share_gives_entries_back_whole_and_once(redis_client: redis.Redis, stream: str) -> None:
    """share.lua: entries read by one consumer go back to the stream with the same fields, leave
    its pending list, and an idle peer takes them; an entry no longer this consumer's stays put."""
    ids = [redis_client.xadd(stream, {"id": f"r{i}", "data": f"d{i}"}) for i in range(4)]
    redis_client.xreadgroup(GROUP, "hot", {stream: ">"}, count=4)
    # r3 was claimed by another consumer meanwhile (after claim_idle_s): not ours to give.
    redis_client.xclaim(stream, GROUP, "other", 0, [ids[3]])
    given = Sharer(redis_client, "hot").give_back(stream, [[ids[2], ids[3]]])
    assert given == {ids[2]}
    assert redis_client.xrange(stream, ids[2], ids[2]) == []  # the old id is gone ...
    assert [e["consumer"] for e in redis_client.xpending_range(stream, GROUP, "-", "+", 10)] == \
        [b"hot", b"hot", b"other"]
    taken = redis_client.xreadgroup(GROUP, "peer", {stream: ">"}, count=10)
    assert [fields for _, fields in taken[0][1]] == [{b"id": b"r2", b"data": b"d2"}]  # ... and back once
    assert Sharer(redis_client, "hot").give_back(stream, []) == set()


def test_an_entry_of_more_fields_than_lua_can_pass_stays_with_its_reader(redis_client: redis.Redis,
                                                                          stream: str) -> None:
    """A foreign entry of 5,000 fields (10,000 values, past Lua's unpack limit) failed the whole script,
    and the worker that read the burst exited; it is now left with its reader, the others given."""
    wide = redis_client.xadd(stream, {"id": "wide", "data": "d", **{f"x{i}": "1" for i in range(5000)}})
    plain = redis_client.xadd(stream, {"id": "r1", "data": "d1"})
    redis_client.xreadgroup(GROUP, "hot", {stream: ">"}, count=2)
    assert Sharer(redis_client, "hot").give_back(stream, [[wide, plain]]) == {plain}
    assert [e["message_id"] for e in redis_client.xpending_range(stream, GROUP, "-", "+", 10)] == [wide]


def test_two_idle_peers_each_get_their_part(redis_client: redis.Redis, stream: str) -> None:
    """A blocked read takes all it can, so one call per idle peer: each gets its part."""
    ids = [redis_client.xadd(stream, {"data": f"{i}"}) for i in range(6)]
    redis_client.xreadgroup(GROUP, "hot", {stream: ">"}, count=32)  # a burst, read whole by the hot worker
    peers = start_blocked(redis_client, "peer1", "peer2")
    try:
        given = Sharer(redis_client, "hot").give_back(stream, [ids[2:4], ids[4:6]])
        assert given == set(ids[2:])
        for peer in peers:
            peer.join(5)
        assert sorted(len(p.got) for p in peers) == [2, 2]  # one call for both: [0, 4]
    finally:
        for peer in peers:
            peer.reader.close()

def test_share_on_a_cluster(cluster_url: str) -> None:
    """share.lua names one key, so it runs on the node owning the stream's slot."""
    client = RedisSettings(cluster_url).sync_client()
    stream = "conveyor:{t-share-cluster}:stream:0"
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        entry = client.xadd(stream, {"id": "r1", "data": "d1"})
        client.xreadgroup(GROUP, "hot", {stream: ">"}, count=1)
        assert Sharer(client, "hot").give_back(stream, [[entry]]) == {entry}
        taken = client.xreadgroup(GROUP, "peer", {stream: ">"}, count=1)
        assert [fields for _, fields in taken[0][1]] == [{b"id": b"r1", b"data": b"d1"}]
    finally:
        client.close()

def test_a_burst_is_shared_only_when_peers_idle_and_their_part_is_worth_it() -> None:
    item_s = 0.010  # 10 ms per entry
    assert parts_to_share(4, 8, 1, item_s) == [2]
    assert parts_to_share(5, 8, 1, item_s) == [2]  # this worker keeps the larger half
    assert parts_to_share(6, 32, 2, item_s) == [2, 2]  # one part per idle peer
    assert parts_to_share(7, 32, 2, item_s) == [2, 2]
    assert parts_to_share(9, 32, 5, item_s) == [2, 2, 1, 1, 1]  # keeps 2
    assert parts_to_share(4, 8, 0, item_s) == []  # nobody idle to take it
    assert parts_to_share(8, 8, 1, item_s) == []  # a full read: a backlog, which peers read anyway
    assert parts_to_share(1, 8, 1, item_s) == []
    item_s = SHARE_MIN_S * 0.4
    assert parts_to_share(2, 8, 1, item_s) == []  # one entry is not worth the hand-over
    assert parts_to_share(8, 32, 3, item_s) == [4]  # parts of 2 (three peers) or 2-3 (two) would not be


def test_idle_peers_are_live_workers_with_nothing_pending(redis_client: redis.Redis, stream: str) -> None:
    """A live peer (recent heartbeat) holding nothing is idle, whether or not it is a consumer of
    the group yet; one holding entries is busy; this worker itself and a dead one do not count."""
    redis_client.xadd(stream, {"data": b"1"})
    redis_client.xreadgroup(GROUP, "busy", {stream: ">"}, count=1)  # holds an entry
    now = protocol.now_ms()
    redis_client.zadd(HEARTBEATS, {"me": now, "busy": now, "idle": now, "new": now, "dead": now - 60_000})
    try:
        assert Sharer(redis_client, "me").idle_peers(stream, HEARTBEATS) == 2  # "idle" and "new"
        redis_client.xreadgroup(GROUP, "idle", {stream: ">"}, count=1)  # nothing left to take
        assert Sharer(redis_client, "busy").idle_peers(stream, HEARTBEATS) == 3  # "me", "idle", "new"
    finally:
        redis_client.delete(HEARTBEATS)


def test_a_burst_after_idle_is_shared_by_the_worker_that_read_it(redis_client: redis.Redis, stream: str) -> None:
    """BurstSharing, the worker's side: a first read that waited, got 4 of 8 asked, with one idle
    peer and 10 ms per entry, keeps 2 and gives 2 back, which the blocked peer takes."""
    ids = [redis_client.xadd(stream, {"data": f"{i}"}) for i in range(4)]
    entries = [(i, {}) for i in ids]
    redis_client.xreadgroup(GROUP, "me", {stream: ">"}, count=8)
    [peer] = start_blocked(redis_client, "peer")
    redis_client.zadd(HEARTBEATS, {"me": protocol.now_ms(), "peer": protocol.now_ms()})
    sharing = BurstSharing(Sharer(redis_client, "me"))
    sharing.observe(1, 0.010)
    try:
        assert sharing.share(KEYS, 0, entries, 8, idle_s=0.0001) == entries  # no wait: a backlog, kept
        kept = sharing.share(KEYS, 0, entries, 8, idle_s=0.2)
        assert [e[0] for e in kept] == ids[:2]
        peer.join(5)
        assert len(peer.got) == 2  # the blocked peer took its part (added again: new ids)
    finally:
        peer.reader.close()


def test_a_refused_share_keeps_the_burst_whole(redis_url: str, redis_client: redis.Redis, stream: str) -> None:
    """An ACL without XINFO or ZRANGE: the burst stays with the worker that read it, and it asks no more."""
    user = f"t-no-share-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+ping", "+hello"])
    limited = redis.Redis.from_url(redis_url, username=user, password="pw")
    ids = [redis_client.xadd(stream, {"data": f"{i}"}) for i in range(4)]
    entries = [(i, {}) for i in ids]
    sharing = BurstSharing(Sharer(limited, "me"))
    sharing.observe(1, 0.010)
    try:
        assert sharing.share(KEYS, 0, entries, 8, idle_s=0.2) == entries
        assert sharing.share(KEYS, 0, entries, 8, idle_s=0.2) == entries
    finally:
        limited.close()
        redis_client.acl_deluser(user)


def _burst_pids(redis_url: str, name: str, quiet_s: float = 0.0, priority: int = 0) -> list[list[int]]:
    """Bursts of 4 requests sent at once (at most 40 bursts or 30 s, until 5 in a row ran on both
    workers); ``quiet_s``: an idle spell before each burst."""
    async def bursts() -> list[list[int]]:
        async with Gateway(redis_url, name) as gw:
            runs: list[list[int]] = []
            deadline = time.monotonic() + 30
            while len(runs) < 40 and time.monotonic() < deadline:
                if quiet_s:
                    await asyncio.sleep(quiet_s)  # the idle spell is the stimulus, not a wait for state
                runs.append(list(await asyncio.gather(*(gw.predict(0.02, timeout_s=10, priority=priority)
                                                        for _ in range(4)))))
                if len(runs) >= 5 and all(len(set(run)) == 2 for run in runs[-5:]):
                    break
            return runs

    return asyncio.run(bursts())


def test_a_burst_read_whole_by_one_worker_is_shared_with_its_idle_peer(redis_url: str) -> None:
    """Four requests sent at once reach the stream in one call, and the worker first in line reads
    all four. Its idle peer gets half of them (before: the whole burst ran on one worker), after a
    quiet spell too; with share_bursts=False the burst stays whole."""
    with running_workers(redis_url, "tests.sharing_stages:bursts", [("burst", 2)]) as group:
        group.wait_ready("t-share", workers={"burst": 2})
        # A burst must come after its reader waited WAITED_MIN_S: one that lands sooner after the last answer
        # is taken for a backlog, by design. Sent straight after the answers, on a fast machine it did (every
        # other burst ran whole): a spell of four times that keeps each a burst.
        runs = _burst_pids(redis_url, "t-share", quiet_s=4 * WAITED_MIN_S)
        assert all(len(set(run)) == 2 for run in runs[-5:]), f"bursts ran on one worker: {runs[-5:]}"
        runs = _burst_pids(redis_url, "t-share", quiet_s=0.6)
        assert all(len(set(run)) == 2 for run in runs[-5:]), f"bursts after idle ran on one worker: {runs[-5:]}"
    with running_workers(redis_url, "tests.sharing_stages:unshared", [("burst", 2)]) as group:
        group.wait_ready("t-unshared", workers={"burst": 2})
        runs = _burst_pids(redis_url, "t-unshared")
        assert sum(len(set(run)) == 1 for run in runs) >= len(runs) // 2, f"not shared, yet: {runs}"


def test_a_burst_of_a_higher_level_is_shared_too(redis_url: str) -> None:
    """A higher level's burst read by an idle worker runs at once (no batch window), and is shared with
    an idle peer as the default level's is: the most urgent requests must not queue on one worker."""
    with running_workers(redis_url, "tests.sharing_stages:leveled", [("burst", 2)]) as group:
        group.wait_ready("t-share-levels", workers={"burst": 2})
        runs = _burst_pids(redis_url, "t-share-levels", quiet_s=4 * WAITED_MIN_S, priority=1)
        assert all(len(set(run)) == 2 for run in runs[-5:]), f"priority bursts ran on one worker: {runs[-5:]}"
