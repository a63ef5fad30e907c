"""Connections held across calls (the committer's, the submitter's) survive the server closing
them while idle (its ``timeout``, a restart, a proxy): the next call reconnects instead of
failing, which for a worker would mean running the batch's predict again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis

from broker.codec import encode
from broker.commit import Commit, Committer, Ttls
from broker.keys import GROUP, Keys
from broker.protocol import entry_fields, ok_record
from broker.submit import Submissions, Submitter
from workers.embedded.server import EmbeddedRedis


@pytest.fixture
def closing_redis(private_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A server of the test's own that closes connections idle for 1 s."""
    client = redis.Redis.from_url(private_redis.url)
    client.config_set("timeout", 1)
    try:
        yield client
    finally:
        client.close()


def _wait_until_only_me(client: redis.Redis, timeout_s: float = 15.0) -> None:
    """Until the server has closed every other connection (ours stays busy with these polls)."""
    deadline = time.monotonic() + timeout_s
    while len(client.client_list()) > 1:
        if time.monotonic() > deadline:
            raise AssertionError("the server did not close the idle connections")
        time.sleep(0.1)


def test_a_commit_after_the_server_closed_the_idle_connection_goes_through(
        closing_redis: redis.Redis, private_redis: EmbeddedRedis) -> None:
    keys = Keys("idle")
    stream = keys.stream(0)
    closing_redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entries: list[bytes] = [closing_redis.xadd(stream, entry_fields(b"r%d" % i, encode(i), None, None))  # type: ignore[arg-type, misc]
                            for i in range(2)]
    closing_redis.xreadgroup(GROUP, "c", {stream: ">"})
    worker_client = redis.Redis.from_url(private_redis.url)
    committer = Committer(worker_client, keys, 0, "Only", has_next=False, ttls=Ttls(60_000, 60_000))
    try:
        first = Commit(acks=[entries[0]])
        first.publish(keys.result("r0").encode(), ok_record(b"r0", 0), None)
        assert committer(first) == 1
        worker_client.connection_pool.disconnect()  # only the committer's own connection is left
        _wait_until_only_me(closing_redis)
        second = Commit(acks=[entries[1]])
        second.publish(keys.result("r1").encode(), ok_record(b"r1", 1), None)
        assert committer(second) == 1  # before: ConnectionError, and the batch ran again
        assert closing_redis.exists(keys.result("r1"))
    finally:
        committer.close()
        worker_client.close()


def test_a_turn_after_the_server_closed_the_idle_connection_goes_through(
        closing_redis: redis.Redis, private_redis: EmbeddedRedis) -> None:
    async def run() -> None:
        keys = Keys("idle")
        client = aredis.Redis.from_url(private_redis.url)
        submitter = Submitter(keys, keys.reply("gw").encode())
        submissions = Submissions(client)
        try:
            await submissions.load()
            assert await submissions.send([(submitter, [submitter.entry(b"r0", encode(0), b"")], [], 0)]) == [1]
            await asyncio.to_thread(_wait_until_only_me, closing_redis)
            assert await submissions.send([(submitter, [submitter.entry(b"r1", encode(1), b"")], [], 0)]) == [1]
            assert await client.xlen(keys.stream(0)) == 2
        finally:
            await submissions.close()
            await client.aclose()

    asyncio.run(run())
