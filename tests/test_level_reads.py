"""A worker's first read on a stage with priority levels (broker.levels.LevelReader): every level read
in one round trip, the highest level's entries handed out first, the room left filled from the levels
below, and what a lower level's read brought beyond that room carried to the next read, where it comes
first. Against a real redis-server: nothing handed out twice, nothing skipped, stream order kept; the
carry handed back to its stream when the worker stops, and forgotten when a lane is lost (its recovery
reads those entries again)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.commit import Committer, Ttls
from broker.keys import GROUP, Keys
from broker.levels import LevelReader
from broker.streams import StreamReader
from workers.embedded.server import EmbeddedRedis
from workers.loop.lanes import ReadLane
from workers.loop.priorities import LevelTurns

CONSUMER = "w1"


@pytest.fixture
def client(private_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(private_redis.url)
    yield c
    c.close()


def streams(client: redis.Redis, keys: Keys) -> list[str]:
    """The first stage's level streams, highest first, each with its group."""
    names = [k.stream(0) for k in keys.levels(2)]
    for name in names:
        client.xgroup_create(name, GROUP, id="0", mkstream=True)
    return names


def add(client: redis.Redis, stream: str, count: int, tag: str) -> list[bytes]:
    return [client.xadd(stream, {"id": f"{tag}{n}", "data": b"x", "v": b"1"}) for n in range(count)]


def ids(picked: list[tuple[int, Any]]) -> list[tuple[int, list[bytes]]]:
    return [(i, [entry[0] for entry in reply[0][1]]) for i, reply in picked]


def pending(client: redis.Redis, stream: str) -> int:
    return int(client.xpending(stream, GROUP)["pending"])


def level_lanes(client: redis.Redis, keys: Keys, levels: int, partitions: int = 1) -> list[ReadLane]:
    """A worker's lanes on the first stage, each partition's levels together, highest first, each with its
    group (and no recovery to run first)."""
    lanes = [ReadLane(k, StreamReader(client, k.stream(0), CONSUMER), Committer(client, k, 0, "S", False, Ttls()))
             for part in keys.partitions(partitions) for k in part.levels(levels)]
    for lane in lanes:
        client.xgroup_create(lane.stream, GROUP, id="0", mkstream=True)
        lane.recover = False
    return lanes


def test_the_room_left_is_filled_and_the_rest_leads_the_next_read(client: redis.Redis) -> None:
    urgent, default = streams(client, Keys("t-lr-fill"))
    u = add(client, urgent, 3, "u")
    d = add(client, default, 10, "d")
    reader = LevelReader(client, [urgent, default], CONSUMER)
    try:
        assert ids(reader.read([0, 1], [4, 4])) == [(0, u), (1, d[:1])]  # one place left for the default level
        assert reader.carried == 3  # the default level's read brought 4
        assert pending(client, default) == 4
        assert ids(reader.read([0, 1], [4, 4])) == [(1, d[1:5])]  # the carry first, then one more read
        assert reader.carried == 0
        u2 = add(client, urgent, 2, "v")
        assert ids(reader.read([0, 1], [4, 4])) == [(0, u2), (1, d[5:7])]
        assert ids(reader.read([1, 0], [4, 4])) == [(1, d[7:10])]  # the starvation guard's order: lowest first
        assert reader.read([0, 1], [4, 4]) == [] and reader.carried == 0
        assert pending(client, default) == 10 and pending(client, urgent) == 5  # each read once, none skipped
    finally:
        reader.close()


def test_without_fill_only_the_first_level_with_entries_is_handed_out(client: redis.Redis) -> None:
    urgent, default = streams(client, Keys("t-lr-nofill"))
    u = add(client, urgent, 2, "u")
    d = add(client, default, 3, "d")
    reader = LevelReader(client, [urgent, default], CONSUMER, fill=False)
    try:
        assert ids(reader.read([0, 1], [4, 4])) == [(0, u)]
        assert ids(reader.read([0, 1], [4, 4])) == [(1, d)]
    finally:
        reader.close()


def test_a_stopping_worker_hands_its_carry_back(client: redis.Redis) -> None:
    urgent, default = streams(client, Keys("t-lr-back"))
    add(client, urgent, 4, "u")
    add(client, default, 4, "d")
    reader = LevelReader(client, [urgent, default], CONSUMER)
    try:
        reader.read([0, 1], [4, 4])  # the urgent level fills the batch: the default level's 4 are carried
        assert reader.carried == 4
        reader.hand_back()
        assert reader.carried == 0
    finally:
        reader.close()
    assert pending(client, default) == 0  # none left with the stopped consumer
    again = client.xreadgroup(GROUP, "w2", {default: ">"}, count=10)
    assert [fields[b"id"] for _, fields in again[0][1]] == [b"d0", b"d1", b"d2", b"d3"]


def test_an_error_reply_leaves_no_reply_behind_for_the_next_read(client: redis.Redis) -> None:
    urgent, default = streams(client, Keys("t-lr-error"))
    client.xgroup_destroy(default, GROUP)  # the default level's read fails (NOGROUP), the urgent one's not
    add(client, urgent, 1, "u")
    reader = LevelReader(client, [urgent, default], CONSUMER)
    try:
        with pytest.raises(redis.ResponseError, match="NOGROUP"):
            reader.read([1, 0], [4, 4])  # the failing read first: the urgent level's reply comes after it
        client.xgroup_create(default, GROUP, id="0", mkstream=True)
        d = add(client, default, 2, "d")
        # Were that reply left on the connection, this read would take it for its own first one.
        assert ids(reader.read([0, 1], [4, 4])) == [(1, d)]
        assert pending(client, urgent) == 1  # read by the failed call: the lane's recovery runs it
    finally:
        reader.close()


def test_a_lost_lane_drops_the_partitions_carry(client: redis.Redis, private_redis: EmbeddedRedis) -> None:
    keys = Keys("t-lr-lost")
    urgent, default = streams(client, keys)
    add(client, urgent, 4, "u")
    add(client, default, 4, "d")
    lanes = [ReadLane(k, StreamReader(client, k.stream(0), CONSUMER), Committer(client, k, 0, "S", False, Ttls()))
             for k in keys.levels(2)]
    for lane in lanes:
        lane.recover = False
    turns = LevelTurns(lanes, 2, 8, lambda names: LevelReader(client, names, CONSUMER))
    try:
        segments, _ = turns.ahead(lanes[0], 4)
        assert [len(entries) for _, entries in segments] == [4]  # the default level's 4 carried
        lanes[1].lost()  # its recovery reads this consumer's pending entries there, the carried ones too
        assert turns.ahead(lanes[0], 4) == ([], True)  # so the carry is not handed out as well
        assert pending(client, default) == 4
    finally:
        turns.close()
        for lane in lanes:
            lane.close()


def test_a_lost_lane_leaves_the_other_levels_carry(client: redis.Redis) -> None:
    """Only the lost lane's recovery reads its entries again: another level's carry, still this consumer's and
    read by no one else (its lane recovers nothing), is handed out, not left pending until the claim."""
    keys = Keys("t-lr-lost-other")
    lanes = level_lanes(client, keys, 2)
    urgent, default = (lane.stream for lane in lanes)
    add(client, urgent, 4, "u")
    d = add(client, default, 4, "d")
    turns = LevelTurns(lanes, 2, 8, lambda names: LevelReader(client, names, CONSUMER))
    try:
        segments, _ = turns.ahead(lanes[0], 4)
        assert [lane.stream for lane, _ in segments] == [urgent]  # the default level's 4 carried
        lanes[0].lost()  # say its commit failed: its recovery reads the urgent entries again
        segments, _ = turns.ahead(lanes[0], 4)
        assert [(lane.stream, [e[0] for e in entries]) for lane, entries in segments] == [(default, d)]
    finally:
        turns.close()
        for lane in lanes:
            lane.close()


def test_a_failed_read_ahead_has_every_level_recover_its_carry(client: redis.Redis) -> None:
    """The read after a full batch fails (the node is lost): the reader drops every level's carry, so every
    lane of the partition recovers its pending entries, not only the lane the worker is told of."""
    keys = Keys("t-lr-ahead-fails")
    lanes = level_lanes(client, keys, 2)
    urgent, default = (lane.stream for lane in lanes)
    add(client, urgent, 4, "u")
    add(client, default, 4, "d")
    reader = LevelReader(client, [urgent, default], CONSUMER)
    turns = LevelTurns(lanes, 2, 8, lambda names: reader)
    try:
        turns.ahead(lanes[0], 4)
        assert reader.carried == 4  # the default level's

        def lost(*args: Any, **kwargs: Any) -> None:
            raise redis.ConnectionError("node lost")

        reader._held.send = lost  # type: ignore[method-assign]
        with pytest.raises(redis.ConnectionError):
            turns.ahead(lanes[0], 4)
        assert reader.carried == 0 and lanes[1].recover  # the default lane reads its pending entries again
    finally:
        turns.close()
        for lane in lanes:
            lane.close()


def test_a_carry_older_than_its_bound_is_left_pending_for_the_claim(client: redis.Redis) -> None:
    """A carry read longer ago than ``max_carry_s`` (half the stage's ``claim_idle_s``: the batch before ran
    that long) may have been claimed by a peer meanwhile: it is not handed out, but left pending."""
    urgent, default = streams(client, Keys("t-lr-old"))
    u = add(client, urgent, 3, "u")
    d = add(client, default, 10, "d")
    reader = LevelReader(client, [urgent, default], CONSUMER, max_carry_s=0.0)  # every carry is old at once
    try:
        assert ids(reader.read([0, 1], [4, 4])) == [(0, u), (1, d[:1])]
        assert reader.carried == 3
        assert ids(reader.read([0, 1], [4, 4])) == [(1, d[4:8])]  # not d[1:4]: those wait for the claim
        assert pending(client, default) == 8
    finally:
        reader.close()


def test_the_starvation_guard_serves_the_lowest_level_with_entries(client: redis.Redis) -> None:
    """Three levels, ``fair_after`` 2, the default level empty: each guard's turn goes to the middle level (the
    lowest that has entries), not to the highest, which would starve the middle level under a level-1 load."""
    lanes = level_lanes(client, Keys("t-lr-guard"), 3)  # level 1, level 2, the default level
    add(client, lanes[0].stream, 6, "a")
    add(client, lanes[1].stream, 2, "b")
    assert _served(client, lanes, 8) == [0, 0, 1, 0, 0, 1, 0, 0]


def test_the_guard_takes_turns_among_the_levels_below_the_highest(client: redis.Redis) -> None:
    """Three levels, ``fair_after`` 2, a level-1 load and a backlog at level 2 and at the default level. The
    guard's turn used to try the levels lowest first, so it always went to the default level: level 2 was
    never served for as long as level 1 and the default level had entries, and users saw priority-2 requests
    time out while less urgent ones were answered. Its turns now go to the level served longest ago; a
    middle level served by the ordinary turns (level 1 empty) leaves every guard's turn to the default level."""
    lanes = level_lanes(client, Keys("t-lr-rotate"), 3)  # level 1, level 2, the default level
    for lane, count, tag in zip(lanes, (8, 12, 12), "abc", strict=True):
        add(client, lane.stream, count, tag)
    assert _served(client, lanes, 18) == [0, 0, 2, 0, 0, 1, 0, 0, 2, 0, 0, 1,  # level 1's 8 served: level 2 leads
                                          1, 1, 2, 1, 1, 2]


def _served(client: redis.Redis, lanes: list[ReadLane], turns_taken: int) -> list[int]:
    """The level (index in ``lanes``) of each batch that ``turns_taken`` turns of three levels (``fair_after`` 2,
    batches of one) serve; the lanes closed after."""
    turns = LevelTurns(lanes, 3, 2, lambda names: LevelReader(client, names, CONSUMER, fill=False))
    try:
        served = []
        for _ in range(turns_taken):
            segments, _ = turns.ahead(lanes[0], 1)
            served += [lanes.index(lane) for lane, entries in segments if entries]
        return served
    finally:
        turns.close()
        for lane in lanes:
            lane.close()

