"""A continuous batch's life beyond its first items: its joiners read, its ended items acked as they end.

A live batch (a streaming stage with ``continuous = True``, :mod:`workers.loop.streaming`) takes new items
between steps and, under a steady load, runs for as long as they keep coming. Its entries are therefore
acked as their streams end (:class:`EndedAcks`), not at the batch's end: an entry left in its stream would
count against the first stage's ``max_backlog`` (the submit script counts the stream's length) and refuse
callers with ``Overloaded`` while the stage keeps up, would hold its result key back, and would run again,
to nobody, if the worker died.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from broker import protocol
from broker.commit import Commit
from workers.loop.cancels import CancelWatch
from workers.loop.heartbeat import Lease
from workers.loop.lanes import ReadLane
from workers.loop.routing import EntryRouter, Work

__all__ = ["EndedAcks", "EndedStream", "answer_at_once", "read_more"]


class EndedStream(Protocol):
    """What :func:`ack_ended` reads of an item's stream (workers.loop.streaming)."""

    item: protocol.Item
    final: bytes | None  # its result record, once it ended with one
    acked: bool

    @property
    def running(self) -> bool: ...


def read_more(lane: ReadLane, router: EntryRouter, cancels: CancelWatch, lease: Lease, commit: Commit,
              settle: Callable[[], None], stopping: Callable[[], bool], count: int) -> Work:
    """A continuous batch's joiners: up to ``count`` new entries of ``lane`` (a read that does not block),
    those with items to run admitted into the running batch's ``commit`` (acked as they end:
    :class:`EndedAcks`) and held by its lease. Items answered at admission (past their deadline, refused)
    are written and pushed at once, and the entries with nothing left to run acked with them: the batch
    may run long after. None once the worker is ``stopping`` (a stop, a scale-down): the batch ends with
    what it holds, else under load it never would."""
    if stopping():
        return []
    entries = lane.reader.read(count)
    if not entries:
        return []
    joined = Commit()
    work = cancels.drop(router.admit(entries, None, joined, lane.keys), lane.keys)
    commit.acks += answer_at_once(lane, settle, joined, list(dict.fromkeys(e[0] for e in entries)), work)
    lease.hold(lane.stream, commit.acks)
    return work


def answer_at_once(lane: ReadLane, settle: Callable[[], None], answered: Commit, read: list[bytes],
                   work: Work) -> list[bytes]:
    """Commit now ``answered`` (the records of items answered at admission: past their deadline, refused) with
    the acks of the entries of ``read`` that have no item in ``work``; the others, returned, are acked as their
    streams end. For a live batch's first read as for its joiners: the batch may run long after."""
    running = {item.entry_id for item, _ in work}
    answered.acks = [entry_id for entry_id in read if entry_id not in running]
    if answered.acks or answered.results or answered.dead:
        settle()  # a commit under way first: the committer holds one at a time
        lane.committer(answered)
    return [entry_id for entry_id in read if entry_id in running]


class EndedAcks:
    """A live batch's entries whose every item's stream ended (:meth:`take`), acked in a commit of their own
    that writes their result keys and pushes their end records (:meth:`ack`), after the step's chunks: a
    caller never sees its answer while its entry still counts against ``max_backlog``, nor an entry acked
    whose end was not pushed. The batch's ``commit`` no longer holds them. Incremental: the batch's streams
    only grow, and those already acked are not looked at again."""

    def __init__(self, lane: ReadLane, lease: Lease, settle: Callable[[], None], commit: Commit) -> None:
        self._lane, self._lease, self._settle, self._commit = lane, lease, settle, commit
        self._seen = 0  # streams of the batch looked at so far
        self._open: dict[bytes, list[EndedStream]] = {}  # not yet acked, by entry

    def admitted(self, work: Work) -> EndedAcks:
        """Commit at once what the batch's first read answered at admission (past their deadline, refused),
        as :func:`read_more` does its joiners', with the acks of its entries of which nothing runs (``work``:
        the items that run); the others stay in the batch's ``commit``, acked as their streams end."""
        commit = self._commit
        answered, commit.results, commit.dead = Commit(results=commit.results, dead=commit.dead), [], []
        commit.acks = answer_at_once(self._lane, self._settle, answered, commit.acks, work)
        self._lease.hold(self._lane.stream, commit.acks)
        return self

    def take(self, streams: Sequence[EndedStream]) -> list[EndedStream]:
        """Of ``streams`` (the batch's so far), those of the entries whose every item's stream ended."""
        for stream in streams[self._seen:]:
            self._open.setdefault(stream.item.entry_id, []).append(stream)
        self._seen = len(streams)
        ended = [entry_id for entry_id, group in self._open.items() if not any(s.running for s in group)]
        return [stream for entry_id in ended for stream in self._open.pop(entry_id)]

    def ack(self, streams: Sequence[EndedStream], held: set[int]) -> None:
        """Ack the entries of ``streams`` (from :meth:`take`), their end records written, and pushed where
        ``held`` (the ids of the records this step kept back): an item that ended in an earlier step, while
        another item of its entry still ran, had its end pushed then."""
        acks = list(dict.fromkeys(s.item.entry_id for s in streams))
        early, keys = Commit(acks=acks), self._lane.keys
        for stream in streams:
            if stream.final is not None:
                reply = stream.item.reply if id(stream.final) in held else None
                early.publish(keys.result_key(stream.item.request_id), stream.final, reply)
        self._settle()  # a commit under way first: the committer holds one at a time
        self._lane.committer(early)
        for stream in streams:
            stream.acked = True
        gone = set(acks)
        self._commit.acks = [entry_id for entry_id in self._commit.acks if entry_id not in gone]
        self._lease.hold(self._lane.stream, self._commit.acks)
