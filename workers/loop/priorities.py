"""A worker's turn on a stage with priority levels: the highest level with entries first, FIFO
within a level, and a guard that keeps the lowest level from starving.

Each level of each partition is a lane of its own (:mod:`workers.loop.lanes`: its stream reader,
its committer, its recovery), so a batch is read from one level, committed in one call and
forwarded into the same level of the next stage: the priority travels with the request. What
differs is the first read of a batch. ``levels.lua`` (:class:`broker.levels.LevelReader`) reads
the first level stream, highest first, that has new entries, and no other: a worker never holds a
lower level's entries while it serves a higher one, and within a level entries come in stream
order (first in, first out). Only when every level of every partition is empty does the worker
block, on every lane at once (the worker's ordinary read, lanes highest level first), and run
whatever came.

A batch read from a level above the lowest runs at once: waiting for more of its level (the
stage's wait policy, ``batch_wait_s``) would hold the lower levels' backlog behind a few requests
that want their answer soonest; the lowest level's batch is filled as any stage's.

Starvation: after ``fair_after`` batches in a row from levels above the lowest (in one
partition), the next first read tries the levels in the other order, lowest first: while the
default level has a backlog it gets at least one batch in ``fair_after + 1`` of every worker,
and a higher level waits at most one batch more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.errors import SyncClient
from broker.levels import LevelReader
from broker.streams import Entry
from workers.loop.lanes import ReadLane

__all__ = ["LevelTurns", "level_turns"]

RunBatch = Callable[[ReadLane, list[Entry], int, float, bool], None]  # lane, entries, asked, when read, wait


@dataclass
class _Partition:
    """One partition's level lanes, highest level first, and their first reads' state."""

    reader: LevelReader
    lanes: list[ReadLane]
    streak: int = 0  # first reads in a row served from a level above the lowest

    def order(self, fair_after: int) -> list[int]:
        """The levels to try, as indexes of ``lanes``: highest first, or lowest first when due."""
        ahead = list(range(len(self.lanes)))
        return ahead[::-1] if self.streak >= fair_after else ahead


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

    def ahead(self, lane: ReadLane, count: int) -> tuple[ReadLane, list[Entry], bool]:
        """The read that does not block after a full batch (one partition): ``lane``'s, or with levels the
        highest level's with entries; the lane read, its entries, and whether its batch may wait to fill."""
        if not self.partitions:
            return lane, lane.reader.read(count), True
        picked = self._pick(self.partitions[0], count)
        return picked if picked is not None else (lane, [], True)

    def _pick(self, part: _Partition, count: int) -> tuple[ReadLane, list[Entry], bool] | None:
        """``levels.lua`` on one partition: the lane read, its entries, and whether it is the lowest level."""
        order = part.order(self.fair_after)
        picked = part.reader.read(order, [lane.reader.entries_for(count) for lane in part.lanes])
        if picked is None:
            part.streak = 0
            return None
        index, reply = picked
        lane = part.lanes[index]
        lowest = index == len(part.lanes) - 1
        part.streak = 0 if lowest or order[0] != 0 else part.streak + 1
        return lane, lane.reader.parse_reply(reply), lowest

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
                run(*picked[:2], count, time.monotonic(), picked[2])
        if not served:
            block(up)

    def close(self) -> None:
        for part in self.partitions:
            part.reader.close()


def level_turns(lanes: Sequence[ReadLane], levels: int, fair_after: int, client: SyncClient,
                consumer: str) -> LevelTurns:
    """The worker's level turns; for a pipeline of one level, none: each turn is its blocking read."""
    return LevelTurns(lanes, levels, fair_after, lambda streams: LevelReader(client, streams, consumer))
