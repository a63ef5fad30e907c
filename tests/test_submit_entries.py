"""A gateway's turn of submissions as batch entries (``submit.lua``, ``gateway.client.sizing``).

The script on a real Redis first: a turn becomes entries of at most the given size, in order, with
no limit in force, and stays single entries with a ``max_backlog`` (admission counts entries), with a
producer's own limit, and without the optional last argument (a foreign producer's documented call).
Then a real gateway (the Python API) in front of real ``conveyor worker`` processes: a burst reaches
the first stage as a few entries and each request is answered once (one entry per request with
``batch_entries=False``), and a request that kills its worker inside such an entry is the only one
dead-lettered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from broker import codec, protocol
from broker.keys import Keys
from broker.spec import StageInfo, encode_spec
from broker.submit import SUBMIT_LUA, Refused, Submissions, Submitter
from gateway import Gateway, GatewaySettings
from gateway.errors import StageError
from tests.helpers import running_workers
from tests.packing_stages import POISON

APP = "tests.packing_stages:first"
PIPELINE = "c-first"
KEYS = Keys(PIPELINE)
T = 30.0  # bound of any single wait here


def _sizes(client: redis.Redis) -> list[int]:
    """Requests per entry on the first stream, in order (1 for a single entry)."""
    sizes = []
    for _, fields in client.xrange(KEYS.stream(0)):
        items = fields.get(protocol.F_ITEMS)
        sizes.append(1 if items is None else len(msgpack.unpackb(items, raw=True)) // 4)
    return sizes


def _requests(client: redis.Redis) -> list[bytes]:
    """The request ids on the first stream, in order, batch entries expanded."""
    return [f[protocol.F_ID] for entry_id, fields in client.xrange(KEYS.stream(0))
            for _, f in protocol.expand(entry_id, fields) if f is not None]


def _submit(redis_url: str, count: int, entries: int, own_limit: int | None = None,
            size: Callable[[int], int] = lambda i: 1) -> int:
    """``count`` requests in one turn of ``submit.lua`` (``entries``: its last argument), as a gateway's
    hub sends them; how many it admitted."""
    reply = KEYS.reply_prefix + b"gw"

    async def submit() -> int:
        client = aioredis.Redis.from_url(redis_url)
        submissions = Submissions(client)
        try:
            submitter = Submitter(KEYS, reply, own_limit)
            await submissions.load()
            batch = [submitter.entry(b"r-%d" % i, codec.encode(b"x" * size(i)), b"") for i in range(count)]
            [admitted] = await submissions.send([(submitter, batch, [], entries)])
            assert isinstance(admitted, int), admitted
            return admitted
        finally:
            await submissions.close()
            await client.aclose()

    return asyncio.run(submit())


@pytest.mark.redis
@pytest.mark.parametrize(("entries", "stage_limit", "own_limit", "sizes"), [
    (3, None, None, [3, 2, 2]),  # split evenly, in order, the larger first
    (1, None, None, [7]),
    (7, None, None, [1] * 7),  # as many entries as requests: single entries
    (3, 100, None, [1] * 7),  # a max_backlog in force: admission counts entries, so single ones
    (3, None, 100, [1] * 7),  # the producer's own limit: the same
    (3, None, 5, [1] * 5),  # admitted in part: the head of the turn, single entries
    (0, None, None, [1] * 7),  # no last argument: a foreign producer's documented call
], ids=["3-entries", "one-entry", "7-entries", "max-backlog", "own-limit", "partial", "foreign-call"])
def test_the_submit_script_packs_a_turn_only_where_no_limit_counts_entries(
        redis_url: str, redis_client: redis.Redis, entries: int, stage_limit: int | None, own_limit: int | None,
        sizes: list[int]) -> None:
    if stage_limit is not None:
        redis_client.set(KEYS.max_backlog, stage_limit)
    assert _submit(redis_url, 7, entries, own_limit) == sum(sizes)
    assert _sizes(redis_client) == sizes
    assert _requests(redis_client) == [b"r-%d" % i for i in range(sum(sizes))]
    [(entry_id, fields)] = redis_client.xrange(KEYS.stream(0), count=1)
    [(_, first)] = protocol.expand(entry_id, fields)[:1]
    assert first is not None and first[protocol.F_REPLY] == KEYS.reply_prefix + b"gw"
    assert codec.decode(first[protocol.F_DATA]) == b"x"


@pytest.mark.redis
@pytest.mark.parametrize("n", [b"3", b"x", b"-1", b"1.5"])
def test_a_foreign_producers_wrong_count_is_refused_before_anything_is_written(redis_client: redis.Redis,
                                                                              n: bytes) -> None:
    """A count that is no whole number, or more requests than the arguments hold: an error, and no entry
    added (the producer is told of a failure only where nothing was submitted)."""
    args = [value for i in range(2) for value in (b"r-%d" % i, codec.encode(i), KEYS.reply_prefix + b"p", b"")]
    with pytest.raises(redis.ResponseError, match="must be the number n of requests"):
        redis_client.eval(SUBMIT_LUA, 2, KEYS.stream(0), KEYS.max_backlog, n, b"", *args)
    assert redis_client.exists(KEYS.stream(0)) == 0


@pytest.mark.redis
@pytest.mark.parametrize(("last", "sizes"), [(b"2.5", [4, 3]), (b"-1", [1] * 7), (b"x", [1] * 7), (b"99", [1] * 7)])
def test_a_foreign_producers_odd_last_argument_never_splits_a_request(redis_client: redis.Redis, last: bytes,
                                                                      sizes: list[int]) -> None:
    """The documented call with a last argument that is not a whole number of entries: a fraction is
    rounded down; anything else means single entries. Every request stays whole and in order."""
    args: list[bytes] = []
    for i in range(7):
        args += [b"r-%d" % i, codec.encode(i), KEYS.reply_prefix + b"p", b""]
    assert redis_client.eval(SUBMIT_LUA, 2, KEYS.stream(0), KEYS.max_backlog, 7, b"", *args, last) == 7
    assert _sizes(redis_client) == sizes
    assert _requests(redis_client) == [b"r-%d" % i for i in range(7)]


@pytest.mark.redis
def test_a_turn_whose_script_redis_forgot_loads_it_and_each_call_gets_its_own_outcome(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The scripts flushed (as a restarted Redis would have them): the turn loads submit.lua and goes
    through. Two partitions' calls in one round trip: one refused by admission (its producer's own
    limit is 0), the other admitted, each told apart."""
    other = Keys(PIPELINE, partition=1)

    async def turn() -> list[object]:
        client = aioredis.Redis.from_url(redis_url)
        submissions = Submissions(client)
        try:
            await submissions.load()
            redis_client.script_flush()
            open_one = Submitter(KEYS, KEYS.reply_prefix + b"gw")
            shut_one = Submitter(other, other.reply_prefix + b"gw", 0)
            return list(await submissions.send([
                (shut_one, [shut_one.entry(b"r-0", codec.encode(0), b"")], [], 0),
                (open_one, [open_one.entry(b"r-%d" % i, codec.encode(i), b"") for i in (1, 2)], [], 0)]))
        finally:
            await submissions.close()
            await client.aclose()

    refused, admitted = asyncio.run(turn())
    assert isinstance(refused, Refused) and refused.overloaded, refused
    assert admitted == 2
    assert _requests(redis_client) == [b"r-1", b"r-2"]


@pytest.mark.redis
def test_a_turn_with_a_large_payload_stays_single_entries(redis_url: str, redis_client: redis.Redis) -> None:
    """A payload of 64 KiB or more would be copied once more into a batch entry: not worth 5 us."""
    assert _submit(redis_url, 4, 2, size=lambda i: 100_000 if i == 1 else 1) == 4
    assert _sizes(redis_client) == [1, 1, 1, 1]
    assert _requests(redis_client) == [b"r-%d" % i for i in range(4)]


def _first_stage_registered(client: redis.Redis, batch_entries: bool, item_ms: float = 0.01) -> None:
    """What two live workers of a first stage of batch 16 leave in Redis: spec, heartbeats, a stats entry."""
    info = StageInfo(index=0, name="First", batch_size=16, batch_entries=batch_entries)
    client.set(KEYS.spec, encode_spec([info]))
    now = protocol.now_ms()
    client.zadd(KEYS.heartbeats(0), {"w1": now, "w2": now})
    client.xadd(KEYS.stats(0), {"n": "16 16", "ms": f"{16 * item_ms} {16 * item_ms}"})


def _refreshed_entries(redis_url: str, n: int, username: str | None = None) -> int:
    """A gateway lane's batch entries for a turn of ``n`` after a refresh of its pipeline's view."""
    url = redis_url if username is None else redis_url.replace("unix://", f"unix://{username}:x@", 1)

    async def refresh() -> int:
        async with Gateway(url, PIPELINE, GatewaySettings(timeout_s=T)) as gw:
            await asyncio.wait_for(gw.views.refreshed(), T)
            return gw.lanes[0].sizing.entries(n)

    return asyncio.run(refresh())


@pytest.mark.redis
def test_a_gateway_packs_only_for_first_stage_workers_that_read_batch_entries(redis_url: str,
                                                                               redis_client: redis.Redis) -> None:
    _first_stage_registered(redis_client, batch_entries=True)
    assert _refreshed_entries(redis_url, 40) == 3  # at least one per live worker (2), none over 16
    assert _refreshed_entries(redis_url, 1) == 0
    _first_stage_registered(redis_client, batch_entries=False)  # workers older than batch entries
    assert _refreshed_entries(redis_url, 40) == 0
    _first_stage_registered(redis_client, batch_entries=True, item_ms=2.0)  # items of 2 ms: not worth it
    assert _refreshed_entries(redis_url, 40) == 0


@pytest.mark.redis
def test_a_gateway_that_cannot_read_the_first_stages_stats_submits_single_entries(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A gateway user made before batch entries (no XREVRANGE): the stage's cost is unknown, so no packing."""
    _first_stage_registered(redis_client, batch_entries=True, item_ms=2.0)
    redis_client.acl_setuser("old-gateway", enabled=True, nopass=True, keys=["*"], commands=["+@all", "-xrevrange"])
    try:
        assert _refreshed_entries(redis_url, 40, username="old-gateway") == 0
        assert _refreshed_entries(redis_url, 40) == 0  # full rights: the 2 ms items say the same
    finally:
        redis_client.acl_deluser("old-gateway")


async def _burst(redis_url: str, values: list[int], batch_entries: bool) -> list[Any]:
    """One warm-up request (which starts the gateway's first read of the first stage's workers), then
    ``values`` at once: one turn of submissions."""
    settings = GatewaySettings(timeout_s=T, batch_entries=batch_entries)
    async with Gateway(redis_url, PIPELINE, settings) as gw:
        assert await gw.predict(100) == 101
        await asyncio.wait_for(gw.views.refreshed(), T)  # the first stage's workers read: turns sized
        assert gw.lanes[0].sizing.batch_size == (16 if batch_entries else 0)
        return await asyncio.gather(*(gw.predict(x) for x in values), return_exceptions=True)


@pytest.mark.system
@pytest.mark.parametrize("on", [True, False], ids=["batch-entries", "no-batch-entries"])
def test_a_gateways_burst_reaches_the_first_stage_as_batch_entries(redis_url: str, redis_client: redis.Redis,
                                                                   on: bool) -> None:
    n = 32
    with running_workers(redis_url, APP, ["IncOrDie", "Pass"]) as workers:
        workers.wait_ready(PIPELINE)
        results = asyncio.run(_burst(redis_url, list(range(n)), on))
    assert results == [x + 1 for x in range(n)]
    added = int(redis_client.xinfo_stream(KEYS.stream(0))["entries-added"])
    # One worker, batches of 16: the burst is two batch entries (with the warm-up's single one).
    assert added == (1 + 2 if on else 1 + n), f"{added} entries for {n} requests"


@pytest.mark.system
def test_a_request_that_kills_its_worker_inside_a_gateways_batch_entry_is_the_only_one_dead_lettered(
        redis_url: str, redis_client: redis.Redis) -> None:
    """16 requests reach the first stage as one batch entry; one kills its worker on every delivery.
    Delivered again, the entry is split into single entries: the fifteen others are answered, the
    poison is dead-lettered (max_deliveries 2) and its requester told."""
    values = list(range(16))
    values[5] = POISON
    with running_workers(redis_url, APP, ["IncOrDie", "Pass"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        workers.wait_ready(PIPELINE)
        results = asyncio.run(_burst(redis_url, values, True))
        log = workers.stage("IncOrDie").log(100_000)
    assert [r for i, r in enumerate(results) if i != 5] == [x + 1 for i, x in enumerate(values) if i != 5]
    poisoned = results[5]
    assert isinstance(poisoned, StageError) and poisoned.type == protocol.E_DEAD_LETTER, poisoned
    assert "split into single entries" in log, log
    [letter] = [fields for _, fields in redis_client.xrange(KEYS.dead(0))]
    assert b"max_deliveries=2" in letter[b"reason"]
