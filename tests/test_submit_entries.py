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
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from broker import codec, protocol
from broker.keys import Keys
from broker.submit import Submitter
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


@pytest.mark.redis
@pytest.mark.parametrize(("per_entry", "stage_limit", "own_limit", "sizes"), [
    (3, None, None, [3, 3, 1]),
    (8, None, None, [7]),
    (3, 100, None, [1] * 7),  # a max_backlog in force: admission counts entries, so single ones
    (3, None, 100, [1] * 7),  # the producer's own limit: the same
    (0, None, None, [1] * 7),  # no last argument: a foreign producer's documented call
], ids=["3-per-entry", "one-entry", "max-backlog", "own-limit", "foreign-call"])
def test_the_submit_script_packs_a_turn_only_where_no_limit_counts_entries(
        redis_url: str, redis_client: redis.Redis, per_entry: int, stage_limit: int | None, own_limit: int | None,
        sizes: list[int]) -> None:
    if stage_limit is not None:
        redis_client.set(KEYS.max_backlog, stage_limit)
    reply = KEYS.reply_prefix + b"gw"

    async def submit() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            submitter = Submitter(client, KEYS, reply, own_limit)
            await submitter.load()
            batch = [submitter.entry(b"r-%d" % i, codec.encode(i), b"") for i in range(7)]
            admitted = await submitter(batch, [], per_entry)
            await submitter.close()
            return admitted
        finally:
            await client.aclose()

    assert asyncio.run(submit()) == 7
    assert _sizes(redis_client) == sizes
    assert _requests(redis_client) == [b"r-%d" % i for i in range(7)]
    [(entry_id, fields)] = redis_client.xrange(KEYS.stream(0), count=1)
    [(_, first)] = protocol.expand(entry_id, fields)[:1]
    assert first is not None and first[protocol.F_REPLY] == reply and codec.decode(first[protocol.F_DATA]) == 0


@pytest.mark.redis
def test_a_turn_with_a_large_payload_stays_single_entries(redis_url: str, redis_client: redis.Redis) -> None:
    """A payload of 64 KiB or more would be copied once more into a batch entry: not worth 5 us."""
    reply = KEYS.reply_prefix + b"gw"

    async def submit() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            submitter = Submitter(client, KEYS, reply)
            await submitter.load()
            batch = [submitter.entry(b"r-%d" % i, codec.encode(b"x" * (100_000 if i == 1 else 1)), b"")
                     for i in range(4)]
            admitted = await submitter(batch, [], 4)
            await submitter.close()
            return admitted
        finally:
            await client.aclose()

    assert asyncio.run(submit()) == 4
    assert _sizes(redis_client) == [1, 1, 1, 1]
    assert _requests(redis_client) == [b"r-%d" % i for i in range(4)]


async def _burst(redis_url: str, values: list[int], batch_entries: bool) -> list[Any]:
    """One warm-up request (which starts the gateway's first read of the first stage's workers), then
    ``values`` at once: one turn of submissions."""
    settings = GatewaySettings(timeout_s=T, batch_entries=batch_entries)
    async with Gateway(redis_url, PIPELINE, settings) as gw:
        assert await gw.predict(100) == 101
        if gw.first_stage.task is not None:
            await asyncio.wait_for(gw.first_stage.task, T)
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
