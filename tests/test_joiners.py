"""A continuous batch's entries acked as their items' streams end (workers.loop.joiners), without Redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import redis

from broker import codec, protocol
from broker.commit import BatchStats, Commit
from broker.keys import Keys
from tests.stream_stages import Growing
from workers import Pipeline
from workers.loop.joiners import EndedAcks
from workers.loop.problems import Problems
from workers.loop.streaming import StreamRunner

pytestmark = pytest.mark.unit


@dataclass
class _Chunks:
    item: protocol.Item
    final: bytes | None = None
    acked: bool = False

    @property
    def running(self) -> bool:
        return self.final is None


@dataclass
class _Lane:
    keys: Keys = field(default_factory=lambda: Keys("p"))
    stream: str = "p:stream:0"
    commits: list[Commit] = field(default_factory=list)

    def committer(self, commit: Commit) -> None:
        self.commits.append(commit)


class _Lease:
    def hold(self, stream: str, acks: list[bytes]) -> None:
        pass


def _item(entry_id: bytes, request_id: bytes) -> protocol.Item:
    return protocol.Item(entry_id, request_id, b"", b"reply:" + request_id, None)


def test_an_item_ended_in_an_earlier_step_is_not_pushed_again_when_its_entry_is_acked() -> None:
    """A batch entry of two items: the first ended (its end pushed with that step) while the second ran;
    when the second ends, the entry is acked with both results written, and only the second's end pushed."""
    lane, batch = _Lane(), Commit(acks=[b"1-0"])
    acks = EndedAcks(cast(Any, lane), cast(Any, _Lease()), lambda: None, batch)
    first, second = _Chunks(_item(b"1-0", b"a")), _Chunks(_item(b"1-0", b"b"))
    first.final = b"end-a"
    assert acks.take([first, second]) == []  # the entry still runs: its first item's end goes with the step
    second.final = b"end-b"
    ended = acks.take([first, second])
    assert ended == [first, second]
    acks.ack(ended, {id(second.final)})  # this step kept back only the second's end
    (commit,) = lane.commits
    assert commit.acks == [b"1-0"] and batch.acks == []
    assert commit.results == [(Keys("p").result_key(b"a"), b"end-a", None),
                               (Keys("p").result_key(b"b"), b"end-b", b"reply:b")]
    assert first.acked and second.acked


def test_a_batch_entrys_item_that_ended_first_has_its_end_pushed_once() -> None:
    """Through the stream runner: a batch entry of two items, the first ending two steps before the
    second. Its end goes out with its step; the entry's ack, when the second ends, writes its result
    key without pushing that end again (every ended item's end was pushed again)."""
    keys, pushed = Keys("p"), []

    def publish(pushes: list[tuple[bytes, bytes]], markers: list[bytes]) -> list[bool]:
        pushed.extend(record for _, element in pushes for record in codec.decode(element))
        return [False] * len(markers)

    spec = Pipeline("p").add(Growing).stages[0]
    runner = StreamRunner(Growing(), spec, redis.Redis(port=9), 60_000, 1 << 20, Problems("c", keys.counts(0)),
                          None)
    runner._publish = publish  # type: ignore[assignment]
    lane, batch = _Lane(), Commit(acks=[b"1-0"])
    acks = EndedAcks(cast(Any, lane), cast(Any, _Lease()), lambda: None, batch)
    work = [(_item(b"1-0", b"a"), 1), (_item(b"1-0", b"b"), 3)]
    runner.run(work, None, keys, batch, BatchStats(), lambda n: [], acks)
    (commit,) = lane.commits
    pushed += [codec.decode(record) for _, record, reply in commit.results if reply is not None]
    ends = [record["id"] for record in pushed if "seq" not in record]
    assert sorted(ends) == ["a", "b"], ends
    assert commit.acks == [b"1-0"] and batch.acks == [] and batch.results == []
