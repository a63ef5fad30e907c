"""Batch entries (``workers.loop.batch_entries``): a worker forwards a batch to the next stage as a few stream
entries of several requests each, and every stage reads both kinds.

Pure pieces first (the wire format, how a forward is split, how a burst of batch entries is shared),
then real ``conveyor worker`` processes on the session's Redis, fed by a foreign producer's backlog:
forwards really become batch entries (and single ones with ``--no-batch-entries``), a batch entry whose
worker died is split into single entries so that only the item that kills its worker is dead-lettered,
a malformed batch entry is dead-lettered with its reason, and ``audit.lua`` finds requests inside
batch entries.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from broker import codec, protocol
from broker.audit import forgotten
from broker.batch_entries import item_time_s
from broker.commit import Commit, _forward_args
from broker.keys import GROUP, Keys
from broker.streams import parse_entries
from tests.helpers import running_workers, wait_for
from tests.packing_stages import POISON, IncOrDie
from tests.test_read_ahead import answers
from workers.batching.sharing import _groups
from workers.loop.batch_entries import ForwardSizing, NextStage
from workers.pipeline import StageSpec

APP = "tests.packing_stages:packed"
PIPELINE = "c-packed"
KEYS = Keys(PIPELINE)
T = 30.0  # bound of any single wait here


def _item(i: int, reply: bytes = b"", deadline: bytes = b"") -> list[bytes]:
    return [b"r-%d" % i, codec.encode(i), reply, deadline]


# -- the wire format ---------------------------------------------------------------------------------


def test_a_batch_entry_expands_to_the_single_entries_it_carries() -> None:
    reply = KEYS.reply_prefix + b"gw"
    flat = [*_item(1, reply, b"%d" % (protocol.now_ms() + 60_000)), *_item(2)]
    entries = protocol.expand(b"5-0", {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
    assert [entry_id for entry_id, _ in entries] == [b"5-0", b"5-0"]
    items = [protocol.parse_entry(e, f, KEYS, protocol.Limits(), protocol.now_ms()) for e, f in entries]
    assert all(isinstance(item, protocol.Item) for item in items)
    first, second = items
    assert isinstance(first, protocol.Item) and isinstance(second, protocol.Item)
    assert (first.request_id, codec.decode(first.data), first.reply) == (b"r-1", 1, reply)
    assert first.deadline_ms is not None and second.deadline_ms is None and second.reply is None
    assert [protocol.item_values(f) for _, f in entries if f is not None] == [tuple(flat[:4]), tuple(flat[4:])]


@pytest.mark.parametrize(("items", "version", "reason"), [
    (b"\xc1", b"1", "malformed batch entry"),  # not msgpack
    (msgpack.packb({"a": 1}), b"1", "malformed batch entry"),  # not an array
    (msgpack.packb([b"r-1", b"x", b""]), b"1", "malformed batch entry"),  # not 4 values per request
    (msgpack.packb([b"r-1", 7, b"", b""]), b"1", "malformed batch entry"),  # a value not a string
    (msgpack.packb([]), b"1", "malformed batch entry"),  # no request
    (protocol.batch_entry_items(_item(1)), b"9", "unknown protocol version"),
])
def test_a_batch_entry_that_cannot_be_read_is_rejected_with_its_reason(items: bytes, version: bytes,
                                                                      reason: str) -> None:
    [(entry_id, fields)] = protocol.expand(b"7-0", {protocol.F_ITEMS: items, protocol.F_VERSION: version})
    rejected = protocol.parse_entry(entry_id, fields, KEYS, protocol.Limits(), protocol.now_ms())
    assert isinstance(rejected, protocol.Rejected) and reason in rejected.reason
    assert rejected.entry_id == b"7-0" and rejected.data == items[:1024]


def test_an_entry_with_both_a_request_and_items_is_rejected_and_its_requester_told() -> None:
    reply = KEYS.reply_prefix + b"gw"
    fields = [b"id", b"r-1", b"data", codec.encode(1), b"reply", reply, b"items", protocol.batch_entry_items(_item(2))]
    [(entry_id, one)] = parse_entries([[KEYS.stream(1).encode(), [(b"3-0", fields)]]])
    rejected = protocol.parse_entry(entry_id, one, KEYS, protocol.Limits(), protocol.now_ms())
    assert isinstance(rejected, protocol.Rejected) and "not both" in rejected.reason
    assert (rejected.request_id, rejected.reply) == (b"r-1", reply)


def test_a_forward_is_split_into_even_batch_entries_in_order() -> None:
    flat = [value for i in range(10) for value in _item(i)]
    assert _forward_args(Commit(forwards=flat)) == (flat, [], ([], []))  # off: one entry each
    singles, packed, _ = _forward_args(Commit(forwards=flat, forward_entries=3))
    assert singles == []
    parts = [msgpack.unpackb(blob, raw=True) for blob in packed]
    assert [len(part) // 4 for part in parts] == [4, 3, 3] and [v for part in parts for v in part] == flat
    assert len(_forward_args(Commit(forwards=flat[:8], forward_entries=5))[1]) == 2  # never an empty entry


def test_how_many_batch_entries_a_forward_becomes() -> None:
    batched = StageSpec(name="Next", index=1, cls=IncOrDie, batch_size=16)
    packing = ForwardSizing(True, batched)
    assert packing.entries(1) == 0  # one request: a single entry, as at low load
    assert packing.entries(10) == 1 and packing.entries(40) == 3  # none larger than the next batch
    packing.live = 4
    assert packing.entries(10) == 4  # one at least for each live worker of the next stage
    packing.item_s = 0.002
    assert packing.entries(10) == 0  # a next stage of milliseconds per item: single entries
    assert ForwardSizing(False, batched).entries(10) == 0
    assert ForwardSizing(True, StageSpec(name="One", index=1, cls=IncOrDie, batch_size=1)).entries(10) == 0
    assert ForwardSizing(True, None).entries(10) == 0


def test_the_next_stages_workers_and_cost_come_with_the_heartbeat() -> None:
    packing = ForwardSizing(True, StageSpec(name="Next", index=1, cls=IncOrDie, batch_size=16))
    hook = NextStage(KEYS, 1, packing)
    hook.take([[b"w1", b"w2", b"w3"], [(b"9-0", {b"n": b"16 4", b"ms": b"10.0 2.5"})]])
    assert packing.live == 3 and packing.item_s == pytest.approx(0.0125 / 20)
    hook.take([redis.ConnectionError("gone"), []])  # a failed or empty reply changes nothing
    assert packing.live == 3 and packing.item_s == pytest.approx(0.0125 / 20)
    assert item_time_s({b"n": b"x", b"ms": b"1"}) is None and item_time_s({}) is None


def test_a_burst_of_batch_entries_is_shared_by_whole_entries() -> None:
    def entries(*sizes: int) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        return [(b"%d-0" % n, {}) for n, size in enumerate(sizes) for _ in range(size)]

    assert _groups(entries(1, 1, 1, 1), [2]) == [[b"2-0", b"3-0"]]  # single entries: as before
    assert _groups(entries(8), [4]) == [[]]  # one batch entry: kept whole
    assert _groups(entries(4, 4), [4]) == [[b"1-0"]]
    assert _groups(entries(3, 3, 2), [3, 2]) == [[b"1-0"], [b"2-0"]]


# -- real workers ------------------------------------------------------------------------------------


def _enqueue(client: redis.Redis, values: list[int], reply: bytes) -> None:
    """A backlog on the first stage's stream, as a foreign producer writes it."""
    pipe = client.pipeline(transaction=False)
    for i, x in enumerate(values):
        pipe.xadd(KEYS.stream(0), protocol.entry_fields(b"r-%d" % i, codec.encode(x), reply, None))
    pipe.execute()


def _added(client: redis.Redis, stage: int) -> int:
    """Entries ever added to a stage's stream (XINFO STREAM's entries-added, Redis >= 7)."""
    return int(client.xinfo_stream(KEYS.stream(stage))["entries-added"])


def _drained(client: redis.Redis) -> bool:
    return all(client.xlen(KEYS.stream(i)) == 0 and client.xpending(KEYS.stream(i), GROUP)["pending"] == 0
               for i in (0, 1))


@pytest.mark.system
@pytest.mark.parametrize("on", [True, False], ids=["batch-entries", "no-batch-entries"])
def test_forwards_become_batch_entries_and_every_request_is_answered_once(redis_url: str, redis_client: redis.Redis,
                                                                          on: bool) -> None:
    reply, n = KEYS.reply_prefix + b"t", 64
    _enqueue(redis_client, list(range(n)), reply)
    env = {} if on else {"CONVEYOR_BATCH_ENTRIES": "0"}
    with running_workers(redis_url, APP, ["Pass", "IncOrDie"], **env) as workers:
        wait_for(lambda: sum(answers(redis_client, reply).values()) >= n, T, "every answer", workers.report)
        wait_for(lambda: _drained(redis_client), T, "the streams drained", workers.report)
    assert answers(redis_client, reply) == Counter({(f"r-{i}", i + 1): 1 for i in range(n)})
    added = _added(redis_client, 1)
    if on:  # batches of at most 16 read from a backlog of 64: a few batch entries
        assert 4 <= added < n // 2, f"{added} entries for {n} requests"
    else:
        assert added == n


@pytest.mark.system
def test_a_batch_entry_whose_worker_died_is_split_and_only_the_killer_is_dead_lettered(
        redis_url: str, redis_client: redis.Redis) -> None:
    """16 requests cross to the second stage as one batch entry; one of them kills its worker on every
    delivery. The batch entry, delivered again, is split into single entries; the fifteen others
    (those after the poison too) are answered once each, and only the poison is dead-lettered
    (max_deliveries 2)."""
    reply, n = KEYS.reply_prefix + b"t", 16
    values = list(range(n))
    values[5] = POISON
    _enqueue(redis_client, values, reply)
    with running_workers(redis_url, APP, ["Pass", "IncOrDie"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        wait_for(lambda: sum(answers(redis_client, reply).values()) >= n, T, "every answer", workers.report)
        wait_for(lambda: _drained(redis_client), T, "the streams drained", workers.report)
        log = workers.stage("IncOrDie").log(100_000)
    expected = Counter({(f"r-{i}", i + 1): 1 for i in range(n) if i != 5})
    expected[("r-5", protocol.E_DEAD_LETTER)] = 1
    assert answers(redis_client, reply) == expected
    assert "split into single entries" in log, log
    [letter] = [fields for _, fields in redis_client.xrange(KEYS.dead(1))]
    assert letter[b"id"] == b"r-5" and b"max_deliveries=2" in letter[b"reason"]


@pytest.mark.system
def test_a_batch_entry_left_by_a_dead_consumer_is_claimed_split_and_answered(redis_url: str,
                                                                            redis_client: redis.Redis) -> None:
    """A batch entry read by a consumer that then vanished (never acked): a live worker claims it after
    claim_idle_s, splits it (delivered a second time) and answers each of its requests once."""
    reply, n = KEYS.reply_prefix + b"t", 6
    redis_client.xgroup_create(KEYS.stream(1), GROUP, id="0", mkstream=True)
    flat = [value for i in range(n) for value in _item(i, reply)]
    redis_client.xadd(KEYS.stream(1), {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
    assert redis_client.xreadgroup(GROUP, "ghost", {KEYS.stream(1): ">"}, count=1)  # pending with "ghost"
    with running_workers(redis_url, APP, ["Pass", "IncOrDie"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        wait_for(lambda: sum(answers(redis_client, reply).values()) >= n, T, "every answer", workers.report)
        wait_for(lambda: _drained(redis_client), T, "the streams drained", workers.report)
        log = workers.stage("IncOrDie").log(100_000)
    assert answers(redis_client, reply) == Counter({(f"r-{i}", i + 1): 1 for i in range(n)})
    assert "claimed stale entries" in log and "split into single entries" in log, log
    # Each of those lines names the requests it is about: a grep for a request's id finds them.
    said = [line for line in log.splitlines() if "claimed stale entries" in line or "split into single" in line]
    assert all(f"requests={','.join(f'r-{i}' for i in range(n))}" in line for line in said), said


@pytest.mark.system
def test_predict_never_gets_more_than_its_batch_size(redis_url: str, redis_client: redis.Redis) -> None:
    """A stage of batch_size 4 fed by one of 16, started after a backlog formed, and given a foreign
    batch entry of 10 requests: each predict call holds at most 4 (the stage raises otherwise)."""
    keys, reply, n = Keys("c-small"), Keys("c-small").reply_prefix + b"t", 48
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(keys.stream(0), protocol.entry_fields(b"r-%d" % i, codec.encode(i), reply, None))
    pipe.execute()
    with running_workers(redis_url, "tests.packing_stages:small", ["Pass", "Small"]) as workers:
        workers.wait_ready("c-small", T)
        flat = [value for i in range(n, n + 10) for value in _item(i, reply)]
        redis_client.xadd(keys.stream(1),
                          {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
        wait_for(lambda: sum(answers(redis_client, reply).values()) >= n + 10, T, "every answer", workers.report)
    assert answers(redis_client, reply) == Counter({(f"r-{i}", i + 1): 1 for i in range(n + 10)})


@pytest.mark.system
def test_a_malformed_batch_entry_is_dead_lettered_and_the_stage_goes_on(redis_url: str,
                                                                        redis_client: redis.Redis) -> None:
    reply = KEYS.reply_prefix + b"t"
    with running_workers(redis_url, APP, ["Pass", "IncOrDie"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        workers.wait_ready(PIPELINE, T)
        redis_client.xadd(KEYS.stream(1), {protocol.F_ITEMS: b"\xc1 not msgpack", protocol.F_VERSION: b"1"})
        wait_for(lambda: redis_client.xlen(KEYS.dead(1)) == 1, T, "the dead letter", workers.report)
        _enqueue(redis_client, [1, 2], reply)
        wait_for(lambda: sum(answers(redis_client, reply).values()) >= 2, T, "the answers", workers.report)
    [letter] = [fields for _, fields in redis_client.xrange(KEYS.dead(1))]
    assert b"malformed batch entry" in letter[b"reason"]
    assert answers(redis_client, reply) == Counter({("r-0", 2): 1, ("r-1", 3): 1})


def test_audit_finds_requests_inside_batch_entries(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.xadd(KEYS.stream(0), protocol.entry_fields(b"r-0", codec.encode(0), None, None))
    redis_client.xadd(KEYS.stream(1), {protocol.F_ITEMS: protocol.batch_entry_items([*_item(1), *_item(2)]),
                                       protocol.F_VERSION: b"1"})
    redis_client.set(KEYS.result_key(b"r-3"), b"done")

    async def audit() -> list[bytes]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await forgotten(client, KEYS, 2, [b"r-0", b"r-1", b"r-2", b"r-3", b"r-4"])
        finally:
            await client.aclose()

    assert asyncio.run(audit()) == [b"r-4"]
