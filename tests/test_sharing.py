"""Hot-worker preference (workers/batching/handoff.py) against a real Redis and real worker processes.

The mechanism first: a read sent with ``unblock`` goes ahead of a peer's read that was blocked
before it (Redis serves blocked readers first come, first served), loses nothing, and a refused
``CLIENT UNBLOCK`` leaves the read working. Then two workers of one stage: at one request in
flight the worker that ran the last batch takes the next one (without the handoff they take
turns), and with more in flight than one worker can take, both still work.
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
from gateway import Gateway
from tests.helpers import running_workers, wait_for
from workers.batching.adaptive import SingletonReadSize
from workers.batching.collector import StreamReader
from workers.batching.handoff import SHARE_MIN_S, HotHandoff, ReadPeers
from workers.loop.heartbeat import Heartbeat, Readers

STREAM = "conveyor:{t-handoff-unit}:stream:0"
APP = "tests.handoff_stages:two_workers"
BURSTS = "tests.handoff_stages:bursts"


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
        self.reader = StreamReader(client, STREAM, consumer)
        self.connected = threading.Event()
        self.empty_reads = 0
        self.got: list[bytes] = []

    def run(self) -> None:
        self.reader.read(1)  # connects (and learns its client id) before blocking
        self.connected.set()
        for _ in range(50):
            entries = self.reader.read(self.count, block_ms=10_000)
            if entries:
                self.got = [e[0] for e in entries]
                return
            self.empty_reads += 1


def blocked_on_stream(client: redis.Redis, *readers: StreamReader) -> bool:
    """Whether each of ``readers`` is blocked in XREADGROUP now (by client id: other tests' clients
    on the shared server do not count)."""
    blocked = {int(c["id"]) for c in client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")}
    return all(r.client_id in blocked for r in readers)


@pytest.fixture
def peer(redis_client: redis.Redis, stream: str) -> Iterator[BlockedReader]:
    """A peer worker's reader, blocked on the stream (idle) when the test starts."""
    blocked = BlockedReader(redis_client, "peer")
    blocked.start()
    assert blocked.connected.wait(5)
    wait_for(lambda: blocked_on_stream(redis_client, blocked.reader), 5, "the peer blocked on the stream")
    yield blocked
    blocked.reader.close()


def test_a_read_with_unblock_goes_ahead_of_a_blocked_peer(redis_client: redis.Redis, stream: str,
                                                          peer: BlockedReader) -> None:
    hot = StreamReader(redis_client, stream, "hot")
    got: list[bytes] = []
    try:
        hot.read(1)  # connect
        peer_id = peer.reader.client_id or 0
        reading = threading.Thread(target=lambda: got.extend(e[0] for e in hot.read(1, block_ms=10_000,
                                                                                   unblock=[peer_id])))
        reading.start()
        # The peer's read came back empty and was sent again: both block, the hot one first.
        wait_for(lambda: peer.empty_reads >= 1 and blocked_on_stream(redis_client, peer.reader, hot), 5,
                 "both readers blocked")
        entry = redis_client.xadd(stream, {"data": b"1"})
        reading.join(5)
        assert got == [entry]  # first come, first served: without the unblock the peer would have it
        assert hot.unblock_refused is None
        second = redis_client.xadd(stream, {"data": b"2"})
        peer.join(5)
        assert peer.got == [second]  # the peer lost nothing: it takes the next one
    finally:
        hot.close()


def test_a_read_sent_ahead_of_the_commit_takes_what_the_commit_brings(redis_client: redis.Redis, stream: str,
                                                                     peer: BlockedReader) -> None:
    """The worker's order (workers.batching.handoff): its next read is sent ahead, then the commit, then
    the read's reply is taken. The caller's next request, sent once the commit's answer is out,
    goes to this reader, not to the peer blocked before it. (Sent after the commit, the read
    raced that request; CI saw the peer win about half the time.)"""
    hot = StreamReader(redis_client, stream, "hot")
    try:
        hot.read(1)  # connect
        hot.send_read(1, block_ms=10_000, unblock=[peer.reader.client_id or 0])
        assert hot.read_pending
        redis_client.lpush("t-handoff-answer", b"done")  # the commit: a round trip on another connection
        entry = redis_client.xadd(stream, {"data": b"1"})  # ... and at once the caller's next request
        assert [e[0] for e in hot.finish_read()] == [entry]
        assert not hot.read_pending and hot.unblock_refused is None
        second = redis_client.xadd(stream, {"data": b"2"})
        peer.join(5)
        assert peer.got == [second]  # the peer was unblocked, read again, and lost nothing
    finally:
        redis_client.delete("t-handoff-answer")
        hot.close()


def test_a_read_sent_ahead_and_never_taken_leaves_its_entry_to_recovery(redis_client: redis.Redis,
                                                                        stream: str) -> None:
    """The commit after a read sent ahead failed: the worker recovers (reads its own pending
    entries) without taking the read's reply. The connection is dropped, the entry the read took
    is found pending, and the reader stays in step for the reads after."""
    reader = StreamReader(redis_client, stream, "hot")
    try:
        reader.read(1)  # connect
        reader.send_read(1, block_ms=10_000)
        entry = redis_client.xadd(stream, {"data": b"1"})
        wait_for(lambda: redis_client.xpending(stream, GROUP)["pending"] == 1, 5, "the read took the entry")
        assert [e[0] for e in reader.read(8, start="0")] == [entry]  # recovery finds it
        second = redis_client.xadd(stream, {"data": b"2"})
        assert [e[0] for e in reader.read(1)] == [second]  # in step: not a stale reply
    finally:
        reader.close()


def test_a_read_with_unblock_counts_the_peers_it_found_idle(redis_client: redis.Redis, stream: str,
                                                            peer: BlockedReader) -> None:
    """CLIENT UNBLOCK answers 1 for a client it unblocked: that peer was idle."""
    hot = StreamReader(redis_client, stream, "hot")
    busy = StreamReader(redis_client, stream, "busy")
    try:
        hot.read(1)
        busy.read(1)  # connected, not blocked: a busy peer
        hot.send_read(1, block_ms=10_000, unblock=[peer.reader.client_id or 0, busy.client_id or 0])
        redis_client.xadd(stream, {"data": b"1"})
        assert len(hot.finish_read()) == 1
        assert hot.idle_peers == 1
        assert hot.read(1) == [] and hot.idle_peers == 0  # a read without unblock found nobody
        redis_client.xadd(stream, {"data": b"2"})
        peer.join(5)
    finally:
        hot.close()
        busy.close()


def test_share_gives_entries_back_whole_and_once(redis_client: redis.Redis, stream: str) -> None:
    """share.lua: entries read by one consumer go back to the stream with the same fields, leave
    its pending list, and an idle peer takes them; an entry no longer this consumer's stays put."""
    ids = [redis_client.xadd(stream, {"id": f"r{i}", "data": f"d{i}"}) for i in range(4)]
    redis_client.xreadgroup(GROUP, "hot", {stream: ">"}, count=4)
    # r3 was claimed by another consumer meanwhile (after claim_idle_s): not ours to give.
    redis_client.xclaim(stream, GROUP, "other", 0, [ids[3]])
    given = Sharer(redis_client, stream, "hot").give_back([[ids[2], ids[3]]])
    assert given == {ids[2]}
    assert redis_client.xrange(stream, ids[2], ids[2]) == []  # the old id is gone ...
    assert [e["consumer"] for e in redis_client.xpending_range(stream, GROUP, "-", "+", 10)] == \
        [b"hot", b"hot", b"other"]
    taken = redis_client.xreadgroup(GROUP, "peer", {stream: ">"}, count=10)
    assert [fields for _, fields in taken[0][1]] == [{b"id": b"r2", b"data": b"d2"}]  # ... and back once
    assert Sharer(redis_client, stream, "hot").give_back([]) == set()


def test_two_idle_peers_each_get_their_part(redis_client: redis.Redis, stream: str) -> None:
    """A blocked read takes all it can, so one call per idle peer: each gets its part."""
    ids = [redis_client.xadd(stream, {"data": f"{i}"}) for i in range(6)]
    redis_client.xreadgroup(GROUP, "hot", {stream: ">"}, count=32)  # a burst, read whole by the hot worker
    peers = [BlockedReader(redis_client, name, count=32) for name in ("peer1", "peer2")]
    for peer in peers:
        peer.start()
        assert peer.connected.wait(5)
    wait_for(lambda: blocked_on_stream(redis_client, *(p.reader for p in peers)), 5, "both peers blocked")
    try:
        given = Sharer(redis_client, stream, "hot").give_back([ids[2:4], ids[4:6]])
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
        assert Sharer(client, stream, "hot").give_back([[entry]]) == {entry}
        taken = client.xreadgroup(GROUP, "peer", {stream: ">"}, count=1)
        assert [fields for _, fields in taken[0][1]] == [{b"id": b"r1", b"data": b"d1"}]
    finally:
        client.close()

def test_a_burst_is_shared_only_when_peers_idle_and_their_part_is_worth_it() -> None:
    handoff = HotHandoff(ReadPeers(learned=("run", (7,))), enabled=True)
    handoff.after_batch(size=1, count=8, run_s=0.010, first_wait_s=0.01)  # 10 ms per entry
    assert handoff.to_share(4, 8, idle_peers=1) == [2]
    assert handoff.to_share(5, 8, idle_peers=1) == [2]  # this worker keeps the larger half
    assert handoff.to_share(6, 32, idle_peers=2) == [2, 2]  # one part per idle peer
    assert handoff.to_share(7, 32, idle_peers=2) == [2, 2]
    assert handoff.to_share(9, 32, idle_peers=5) == [2, 2, 1, 1, 1]  # keeps 2
    assert handoff.to_share(4, 8, idle_peers=0) == []  # nobody idle to take it
    assert handoff.to_share(8, 8, idle_peers=1) == []  # a full read: a backlog, which peers read anyway
    assert handoff.to_share(1, 8, idle_peers=1) == []
    handoff.after_batch(size=4, count=8, run_s=SHARE_MIN_S * 1.6, first_wait_s=0.01)  # 0.4 x SHARE_MIN_S each
    assert handoff.to_share(2, 8, idle_peers=1) == []  # one entry is not worth the hand-over
    assert handoff.to_share(8, 32, idle_peers=3) == [4]  # parts of 2 (three peers) or 2-3 (two) would not be
    handoff.share_refused = True
    assert handoff.to_share(8, 32, idle_peers=1) == []
    assert HotHandoff(ReadPeers(learned=("run", (7,))), enabled=False).to_share(4, 8, idle_peers=1) == []


def test_a_batch_window_cut_short_by_a_peer_waits_on(redis_client: redis.Redis, stream: str) -> None:
    """A peer filling a batch (read_until) that a hot worker unblocks keeps waiting for the time
    it has left, behind the hot worker: its window is not cut short."""
    filling = StreamReader(redis_client, stream, "filling")
    hot = StreamReader(redis_client, stream, "hot")
    got: list[bytes] = []
    hot_got: list[bytes] = []
    try:
        filling.read(1)
        hot.read(1)  # both connected
        window = threading.Thread(target=lambda: got.extend(e[0] for e in filling.read_until(4, 10.0)))
        window.start()
        wait_for(lambda: blocked_on_stream(redis_client, filling), 5, "the filling reader blocked")
        peer_id = filling.client_id or 0
        ahead = threading.Thread(target=lambda: hot_got.extend(e[0] for e in hot.read(1, block_ms=10_000,
                                                                                      unblock=[peer_id])))
        ahead.start()
        wait_for(lambda: blocked_on_stream(redis_client, filling, hot), 5, "both blocked, the hot one first")
        first = redis_client.xadd(stream, {"data": b"1"})
        ahead.join(5)
        assert hot_got == [first]
        second = redis_client.xadd(stream, {"data": b"2"})
        window.join(5)
        assert got == [second]  # before the fix: [] at once, the window ended by the unblock
    finally:
        hot.close()
        filling.close()


def test_peers_are_learned_only_on_the_same_server(redis_url: str, redis_client: redis.Redis) -> None:
    """A field published with another server's run id (from before a restart) is not a peer."""
    keys = Keys("t-handoff-peers")
    readers_key, hb_key = keys.readers(0), keys.heartbeats(0)
    redis_client.delete(readers_key, hb_key)
    run_id = redis_client.info("server")["run_id"]
    now = protocol.now_ms()
    redis_client.zadd(hb_key, {"same": now, "restarted": now, "gone": now - 3_600_000 + 1000})
    redis_client.hset(readers_key, mapping={"same": f"{run_id}:41", "restarted": "0123abcd:42", "gone": f"{run_id}:43"})
    peers = ReadPeers()
    beat = Heartbeat(RedisSettings(redis_url), [hb_key], "me", "s", 0.2, 30.0, SingletonReadSize(),
                     Readers(readers_key, lambda: f"{run_id}:40", peers))
    beat.start()
    try:
        beat.ready()
        wait_for(lambda: peers.learned == (run_id, (41,)), 5, "the live peer on this server learned")
        assert redis_client.hget(readers_key, "me") == f"{run_id}:40".encode()
        wait_for(lambda: not redis_client.hexists(readers_key, "gone"), 5, "a worker no longer live removed")
    finally:
        beat.stop()
        redis_client.delete(readers_key, hb_key)


def test_a_heartbeat_under_an_acl_without_the_readers_commands_goes_on(redis_url: str,
                                                                       redis_client: redis.Redis) -> None:
    """An ACL written before P:readers: the heartbeat still beats, and the handoff turns off."""
    user = f"t-old-acl-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+ping", "+hello", "+select", "+zadd", "+zremrangebyscore", "+zrange"])
    keys = Keys("t-handoff-acl")
    peers = ReadPeers(learned=("run", (5,)))
    url = redis_url.replace("unix://", f"unix://{user}:pw@", 1)
    beat = Heartbeat(RedisSettings(url), [keys.heartbeats(0)], "me", "s", 0.2, 30.0, SingletonReadSize(),
                     Readers(keys.readers(0), lambda: "run:40", peers))
    beat.start()
    try:
        beat.ready()
        wait_for(lambda: peers.refused, 5, "the handoff turned off")
        assert peers.learned == (None, ())
        first = redis_client.zscore(keys.heartbeats(0), "me")
        assert first is not None
        wait_for(lambda: (redis_client.zscore(keys.heartbeats(0), "me") or 0) > first, 5, "it beats on")
    finally:
        beat.stop()
        redis_client.acl_deluser(user)
        redis_client.delete(keys.heartbeats(0))


def test_a_refused_unblock_leaves_the_read_working(redis_url: str, redis_client: redis.Redis, stream: str) -> None:
    user = f"t-no-unblock-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+ping", "+hello", "+client|id", "+xreadgroup"])
    limited = redis.Redis.from_url(redis_url, username=user, password="pw")
    reader = StreamReader(limited, stream, "limited")
    handoff = HotHandoff(ReadPeers(learned=("run", (123456789,))), enabled=True)
    handoff.after_batch(size=1, count=8, run_s=0.01, first_wait_s=0.01)
    try:
        entry = redis_client.xadd(stream, {"data": b"1"})
        assert [e[0] for e in reader.read(8, block_ms=1000, unblock=handoff.unblock_ids("run"))] == [entry]
        assert reader.unblock_refused is not None and "client|unblock" in reader.unblock_refused
        handoff.refused(reader.unblock_refused)
        assert handoff.unblock_ids("run") == ()  # from now on it reads as usual
    finally:
        reader.close()
        limited.close()
        redis_client.acl_deluser(user)


def test_handoff_only_after_a_slow_batch_that_found_no_queue() -> None:
    handoff = HotHandoff(ReadPeers(learned=("run", (7, 9))), enabled=True)
    assert handoff.unblock_ids("run") == ()  # nothing run yet
    handoff.after_batch(size=1, count=8, run_s=0.005, first_wait_s=0.01)
    assert handoff.unblock_ids("run") == (7, 9)
    assert handoff.unblock_ids("restarted") == ()  # ids learned on another server: strangers here
    assert handoff.unblock_ids(None) == ()  # not connected
    handoff.after_batch(size=8, count=8, run_s=0.005, first_wait_s=0.01)  # full: entries were queued
    assert handoff.unblock_ids("run") == ()
    handoff.after_batch(size=1, count=1, run_s=0.005, first_wait_s=0.01)  # a singleton stage that waited
    assert handoff.unblock_ids("run") == (7, 9)
    handoff.after_batch(size=1, count=1, run_s=0.005, first_wait_s=0.0001)  # ... and one that did not: a queue
    assert handoff.unblock_ids("run") == ()
    handoff.after_batch(size=1, count=8, run_s=0.0001, first_wait_s=0.01)  # a cheap stage: not worth waking peers
    assert handoff.unblock_ids("run") == ()
    handoff.after_batch(size=1, count=8, run_s=0.005, first_wait_s=0.01)
    handoff.after_idle()  # an empty read: no hotter than the peers
    assert handoff.unblock_ids("run") == ()
    handoff.after_batch(size=1, count=8, run_s=0.005, first_wait_s=0.01)
    handoff.forget_peers()  # the connection was lost: the ids may be of a server that is gone
    assert handoff.unblock_ids("run") == ()
    assert HotHandoff(ReadPeers(learned=("run", (7,))), enabled=False).unblock_ids("run") == ()


def test_at_one_in_flight_the_worker_that_just_ran_takes_the_next_request(redis_url: str,
                                                                          redis_client: redis.Redis) -> None:
    readers = Keys("t-handoff").readers(0)
    with running_workers(redis_url, APP, [("who", 2)]) as group:
        group.wait_ready("t-handoff", workers={"who": 2})
        wait_for(lambda: redis_client.hlen(readers) == 2, 10, "both workers publish their reading connection")

        async def one_at_a_time() -> list[int]:
            """Until 20 answers in a row come from one worker (each worker learns its peer at its
            next heartbeat, so the first answers may alternate); at most 400 requests or 30 s."""
            pids: list[int] = []
            deadline = time.monotonic() + 30
            async with Gateway(redis_url, "t-handoff") as gw:
                while len(pids) < 400 and time.monotonic() < deadline:
                    pids.append(await gw.predict(0.003, timeout_s=10))
                    if len(pids) >= 20 and len(set(pids[-20:])) == 1:
                        break
            return pids

        pids = asyncio.run(one_at_a_time())
        assert len(pids) >= 20 and len(set(pids[-20:])) == 1, f"the workers kept taking turns: {pids[-20:]}"

        async def eight_at_once() -> set[int]:
            async with Gateway(redis_url, "t-handoff") as gw:
                return set(await asyncio.gather(*(gw.predict(0.05, timeout_s=10) for _ in range(8))))

        # More than one worker can take at once (a batch holds 2): both work.
        assert len(asyncio.run(eight_at_once())) == 2


def test_a_burst_read_whole_by_one_worker_is_shared_with_its_idle_peer(redis_url: str,
                                                                      redis_client: redis.Redis) -> None:
    """Four requests sent at once reach the stream in one call, and the worker first in line reads
    all four. Its idle peer gets half of them (before: the whole burst ran on one worker)."""
    with running_workers(redis_url, BURSTS, [("burst", 2)]) as group:
        group.wait_ready("t-share", workers={"burst": 2})
        wait_for(lambda: redis_client.hlen(Keys("t-share").readers(0)) == 2, 10, "both workers publish")

        async def bursts() -> list[list[int]]:
            async with Gateway(redis_url, "t-share") as gw:
                runs: list[list[int]] = []
                deadline = time.monotonic() + 30
                while len(runs) < 200 and time.monotonic() < deadline:  # the first, until peers are known
                    runs.append(list(await asyncio.gather(*(gw.predict(0.02, timeout_s=10) for _ in range(4)))))
                    if len(runs) >= 5 and all(len(set(run)) == 2 for run in runs[-5:]):
                        break
                return runs

        runs = asyncio.run(bursts())
        assert all(len(set(run)) == 2 for run in runs[-5:]), f"bursts ran on one worker: {runs[-5:]}"
