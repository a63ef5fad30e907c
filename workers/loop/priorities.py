"""A worker's turn on a stage with priority levels: the highest level with entries first, FIFO
within a level, and a guard that keeps the lowest level from starving.

Each level of each partition is a lane of its own (:mod:`workers.loop.lanes`: its stream reader,
its committer, its recovery), so a batch is read from one level, committed in one call and
forwarded into the same level of the next stage: the priority travels with the request. What
differs is the first read of a batch (:class:`broker.levels.LevelReader`): every level read in one
round trip, the highest level with entries handed out first, and within a level entries in stream
order (first in, first out); what a lower level's read brought beyond the batch's room waits, read,
for the next batch (its carry), which it leads. Only when every level of every partition is empty does the worker
block, on every lane at once (the worker's ordinary read, lanes highest level first), and run
whatever came.

A batch read from a level above the lowest runs at once, whether read here or by the worker's
blocking read on an idle worker (``Worker._read``): waiting for more of its level (the
stage's wait policy, ``batch_wait_s``) would hold the lower levels' backlog behind a few requests
that want their answer soonest; the lowest level's batch is filled as any stage's. The room a
higher level leaves in a batch is filled from the levels below it, in the same read (``fill``, on
by default): under load a lone urgent request then rides at the head of a batch of the default
level's backlog, one ``predict`` call, instead of costing every stage a batch of its own. Each
level's part of such a batch is acked and forwarded in its own level's streams, in the batch's one commit
(:func:`one_commit`), so it still moves on at its own level.

Starvation: after ``fair_after`` batches in a row from levels above the lowest (in one
partition), the next first read (the guard's turn) tries the levels below the highest, the one
served longest ago first (the lowest first at the start), then the highest: level 1 waits at most
one batch more, and each level below it that has a backlog is served within its share of the guard's
turns. With two levels, or with the default level the only one starved (a middle level served by the
ordinary turns, or empty), that is one batch in ``fair_after + 1``; the guard's turns taken by the
default level alone would starve a middle level under a level-1 load, while less urgent requests ran.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from broker.commit import BatchStats, Commit
from broker.errors import CONNECTION_OR_REPLY_ERRORS, SyncClient, error_text
from broker.levels import LevelReader
from broker.streams import Entry, ReadOutcome, read_any
from workers.loop.ahead import ReadAhead, Settled
from workers.loop.batch_entries import ForwardSizing
from workers.loop.cancels import CancelWatch
from workers.loop.heartbeat import Lease
from workers.loop.lanes import ReadLane
from workers.loop.routing import EntryRouter, Work
from workers.loop.runner import Outcome

__all__ = ["LevelBatch", "LevelTurns", "Segments", "level_turns", "one_commit"]

log = logging.getLogger("conveyor.worker")

Segments = list[tuple[ReadLane, list[Entry]]]  # one batch's entries, by level, in the order read
RunBatch = Callable[[Segments, int, float, bool], None]  # segments, asked, when read, wait
Predict = Callable[[Work, BatchStats], "list[Outcome | None]"]
Committed = Callable[[list[bytes], int, float, "float | None"], None]  # acks, items, predict_s, commit_s


@dataclass
class _Partition:
    """One partition's level lanes, highest level first, and their first reads' state."""

    reader: LevelReader
    lanes: list[ReadLane]
    streak: int = 0  # first reads in a row served from a level above the lowest
    # Each lane's losses the reader's carry knows of (one more: that lane's recovery reads its carry again).
    losses: list[int] = field(init=False)
    waited: list[int] = field(init=False)  # the levels below the highest, served longest ago first

    def __post_init__(self) -> None:
        self.losses = [lane.losses for lane in self.lanes]
        self.waited = list(range(len(self.lanes) - 1, 0, -1))  # none served yet: the lowest first

    def order(self, fair_after: int) -> list[int]:
        """The levels to try, as indexes of ``lanes``: highest first, or when the guard is due the levels
        below it served longest ago first (so the default level's backlog does not starve a middle one)."""
        return [*self.waited, 0] if self.streak >= fair_after else list(range(len(self.lanes)))

    def served(self, levels: list[int]) -> None:
        """``levels`` had a part in the batch: they go to the end of the guard's order, lowest first."""
        if len(self.waited) > 1:  # with two levels the guard's order is always the same
            self.waited = [i for i in self.waited if i not in levels] + sorted(
                (i for i in levels if i), reverse=True)


class LevelTurns:
    """The first reads of a worker whose pipeline has priority levels (``Pipeline(priority_levels=N)``, N > 1).

    ``lanes``: the worker's lanes, each partition's levels together, highest level first (the order
    :meth:`broker.keys.Keys.levels` gives); ``levels``: how many per partition."""

    def __init__(self, lanes: Sequence[ReadLane], levels: int, fair_after: int,
                 reader: Callable[[Sequence[str]], LevelReader]) -> None:
        self.fair_after = fair_after
        self.partitions = [] if levels == 1 else [
            _Partition(reader([lane.stream for lane in part]), list(part))
            for part in (lanes[i:i + levels] for i in range(0, len(lanes), levels))]
        # Every lane on one node (one partition): a commit's reply may be taken after the next read
        # (workers.loop.ahead), whose failure is then the same node's.
        self.one_node = len(lanes) == levels

    def ahead(self, lane: ReadLane, count: int) -> tuple[Segments, bool]:
        """The read that does not block after a full batch (one partition): ``lane``'s, or with levels the
        highest level's with entries and the room it leaves; the entries read by lane, and whether their
        batch may wait to fill."""
        if not self.partitions:
            return [(lane, lane.reader.read(count))], True
        part = self.partitions[0]
        try:
            picked = self._pick(part, count)
        except Exception:  # the failed read dropped every level's carry: each lane's recovery reads its own
            for other in part.lanes:
                if other is not lane:  # ``lane``'s failure is the caller's to handle
                    other.lost()
            raise
        return picked if picked is not None else ([], True)

    def _pick(self, part: _Partition, count: int) -> tuple[Segments, bool] | None:
        """The first read on one partition: the entries read by lane, and whether the batch may wait to
        fill (the lowest level's alone)."""
        losses = [lane.losses for lane in part.lanes]
        if losses != part.losses:  # a lane lost since: its recovery runs what its carry held (only its own:
            # another level's carry is still this consumer's, and nothing else would run it before the claim)
            part.reader.drop_carry([i for i, (now, was) in enumerate(zip(losses, part.losses, strict=True))
                                    if now != was])
            part.losses = losses
        order = part.order(self.fair_after)
        picked = part.reader.read(order, [lane.reader.entries_for(count) for lane in part.lanes])
        if not picked:
            part.streak = 0
            return None
        lowest = len(part.lanes) - 1
        levels_read = [i for i, _ in picked]
        part.streak = 0 if lowest in levels_read or order[0] != 0 else part.streak + 1
        part.served(levels_read)
        segments = [(part.lanes[i], part.lanes[i].reader.parse_reply(reply)) for i, reply in picked]
        return segments, levels_read == [lowest]

    def turn(self, up: list[ReadLane], count: int, run: RunBatch, failed: Callable[[ReadLane, Exception], None],
             block: Callable[[list[ReadLane]], None]) -> None:
        """A batch from the highest level with entries of each partition whose lanes are all ``up``;
        if none had any, ``block(up)``: the worker's blocking read on every lane."""
        served = False
        for part in self.partitions:
            if not all(lane in up for lane in part.lanes):
                continue  # a lane set aside: its node is down, the blocking read skips it
            try:
                picked = self._pick(part, count)
            except Exception as exc:  # every level of a partition is on one node: each lane is told
                for lane in part.lanes:
                    failed(lane, exc)
                continue
            if picked is not None:
                served = True
                run(picked[0], count, time.monotonic(), picked[1])
        if not served:
            block(up)

    def read_any(self, lanes: list[ReadLane], count: int, timeout_s: float) -> list[ReadOutcome]:
        """The blocking first read on ``lanes``, an outcome per lane: with one partition's levels, all up,
        one ``XREADGROUP`` naming every level (:meth:`broker.levels.LevelReader.block`); else a read per
        lane (:func:`broker.streams.read_any`)."""
        if len(self.partitions) != 1 or len(lanes) != len(self.partitions[0].lanes) or any(
                a is not b for a, b in zip(lanes, self.partitions[0].lanes, strict=True)):
            return read_any([lane.reader for lane in lanes], count, timeout_s)
        reader = self.partitions[0].reader
        try:
            replies = reader.block(max(lane.reader.entries_for(count) for lane in lanes),
                                   max(1, math.ceil(timeout_s * 1000)))
        except Exception as exc:  # the caller tells a lost node from a bug
            reader.close()
            return [exc for _ in lanes]
        return [lane.reader.parse_reply(replies[i]) if i in replies else [] for i, lane in enumerate(lanes)]

    def interrupt(self) -> None:
        """End a blocked :meth:`read_any` (from another thread: the worker is stopping)."""
        for part in self.partitions:
            part.reader.interrupt()

    def close(self) -> None:
        """The worker stops: the carries go back to their streams, for the workers that go on."""
        for part in self.partitions:
            try:
                part.reader.hand_back()
            except CONNECTION_OR_REPLY_ERRORS as exc:  # left pending: a peer claims them after claim_idle_s
                log.warning("read entries not handed back streams=%s error=%s", part.reader.streams, error_text(exc))
            part.reader.close()


class LevelBatch:
    """A batch of several levels' new entries (the first read's fill): one ``predict`` on them all, in
    the order read, each level's part admitted and routed in its own lane, then all of them committed in one
    call (:func:`one_commit`; where that cannot be, a commit per lane, sent together and their replies
    taken together). Without hand-off (it gives entries back to one stream)."""

    def __init__(self, router: EntryRouter, cancels: CancelWatch, lease: Lease, sizing: ForwardSizing,
                 ahead: ReadAhead, predict: Predict, committed: Committed,
                 lane_error: Callable[[ReadLane, Exception], None]) -> None:
        self._router, self._cancels, self._lease, self._sizing = router, cancels, lease, sizing
        self._ahead, self._predict, self._committed, self._lane_error = ahead, predict, committed, lane_error

    def run(self, segments: Segments) -> None:
        """Every level of a partition is on one node: a failure is told to each of its lanes."""
        try:
            self._run(segments)
        except Exception as exc:  # the worker tells a lost node from a bug (and raises a bug)
            for lane, _ in segments:
                self._lane_error(lane, exc)

    def _run(self, segments: Segments) -> None:
        parts = []
        for lane, entries in segments:
            commit = Commit(acks=list(dict.fromkeys(e[0] for e in entries)))  # a batch entry's items share its id
            parts.append((lane, commit, self._cancels.drop(self._router.admit(entries, None, commit, lane.keys),
                                                           lane.keys)))
        self._lease.hold_all([(lane.stream, commit.acks) for lane, commit, _ in parts])
        stats = max(parts, key=lambda part: len(part[2]))[0].stats  # the batch's figures go with its largest part
        work = [item for _, _, part_work in parts for item in part_work]
        started = time.perf_counter()
        outcomes = cast("list[Outcome]", self._predict(work, stats) if work else [])
        ran, now, start = time.perf_counter(), time.monotonic(), 0
        for lane, commit, part_work in parts:
            self._router.route_all(part_work, outcomes[start:start + len(part_work)], commit, lane.keys)
            start += len(part_work)
            if lane.stats.due(now):
                commit.stats = lane.stats.take(now)
            commit.forward_entries = self._sizing.entries(len(commit.forwards) // 4)
        self._ahead.settle()  # the last batch's commit first: if it failed, this one stays pending
        self._lease.release()
        acks = [entry_id for _, commit, _ in parts for entry_id in commit.acks]
        settled: Settled = functools.partial(self._committed, acks, len(work), ran - started)
        commits = [(lane, commit) for lane, commit, _ in parts]
        one = one_commit(commits)
        if one is None:
            self._ahead.commit_all(commits, settled)
        else:
            self._ahead.commit(*one, False, settled)


def one_commit(parts: list[tuple[ReadLane, Commit]]) -> tuple[ReadLane, Commit] | None:
    """A batch's levels' commits as one call of one lane's committer (``commit.lua``'s level parts:
    the others' acks and forwards in their own streams, their results and dead letters with its own),
    or None where each must go on its own: when more than one carries stats (a call writes one stats
    entry), or one puts items back on its stream. One call, where a commit per level cost the worker
    and Redis a command each (docs/decisions.md)."""
    with_stats = [part for part in parts if part[1].stats[0]]
    if len(with_stats) > 1 or any(commit.back for _, commit in parts):
        return None
    lane, main = with_stats[0] if with_stats else parts[-1]  # else the lowest level's
    for other, commit in parts:
        if commit is not main:
            main.results += commit.results
            main.dead += commit.dead
            main.level_parts.append((*other.committer.streams, commit))
    return lane, main


def level_turns(lanes: Sequence[ReadLane], levels: int, fair_after: int, client: SyncClient,
                consumer: str, fill: bool = True, max_carry_s: float = 30.0) -> LevelTurns:
    """The worker's level turns; for a pipeline of one level, none: each turn is its blocking read.
    ``max_carry_s``: :class:`broker.levels.LevelReader`'s (half the stage's ``claim_idle_s``)."""
    return LevelTurns(lanes, levels, fair_after,
                      lambda streams: LevelReader(client, streams, consumer, fill, max_carry_s))
