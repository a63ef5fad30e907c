"""Priority levels: which stream a request of a given priority goes to, and a worker's first read
that takes the highest level with entries, and lower levels' into the room left.

A pipeline of ``priority_levels`` N (Triton's meaning: 1 is the highest level, N the lowest, and
priority 0 the default) keeps one stream per level at every stage: the default level, N, is the
stage's stream of every pipeline (``P:stream:<i>``, so nothing changes for a producer that sends no
priority), and each level L < N has ``P:stream:<i>:p<L>`` (:meth:`broker.keys.Keys.at_level`), in the
same hash slot. A worker forwards a batch read from one level into the same level of the next
stage, so a request's priority travels with it to the last stage.

**The first read** (:meth:`LevelReader.read`) sends one ``XREADGROUP ... >`` per level, all in one
round trip, and hands out the highest level's entries first, then the lower levels' into the room
the batch has left (``fill``). What a lower level's read brought beyond that room stays with the
reader (its *carry*, delivered to this consumer and pending) and leads that level's part of the next
read, which asks Redis for that much less. So a batch never takes more than its room, no entry is
read twice, and Redis hands its replies straight to the worker (a script doing the same would convert
every entry into Lua and back: docs/decisions.md). A carry is at most one read of its level;
it is dropped when its lane is lost (the lane's recovery reads those entries again,
as this consumer's pending ones) or once older than half the stage's ``claim_idle_s`` (left pending
for the claim: a peer may have claimed it while a slow batch ran), and handed back to its stream when
the worker stops (:meth:`LevelReader.hand_back`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from broker.families import STREAMS
from broker.held import HeldConnection
from broker.keys import GROUP
from broker.operations import WORKER, sends
from broker.resp import pack_command
from broker.share import Sharer
from broker.streams import UnblockableReader
from broker.streams import unblocked as _unblocked

__all__ = ["MAX_LEVELS", "LevelReader", "stream_level"]

MAX_LEVELS = 8  # a handful: every level is a stream, a read and a lane at every worker


def stream_level(priority: int, levels: int) -> int:
    """The stream level (:attr:`broker.keys.Keys.level`) of a request of ``priority`` in a pipeline of
    ``levels`` priority levels: L for 1 <= L < levels, else 0, the default level's streams. As Triton
    does, 0 and a priority past the pipeline's levels mean the default level (the lowest)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise ValueError(f"priority must be an integer >= 0 (1 the highest, 0 the default), got {priority!r}")
    return priority if 0 < priority < levels else 0


class LevelReader(UnblockableReader):
    """The first reads of one consumer on one partition's level streams of one stage, on a connection of
    its own, with each level's carry (see the module's docstring)."""

    def __init__(self, client: redis.Redis, streams: Sequence[str], consumer: str, fill: bool = True,
                 max_carry_s: float = 30.0) -> None:
        """``fill``: a batch read from one level takes the room left from the levels after it.
        ``max_carry_s``: a carry read longer ago is not handed out but left pending, for the stage's
        claim (a peer may have claimed it meanwhile: half the stage's ``claim_idle_s``)."""
        self.streams = list(streams)
        self._client = client
        self._consumer = consumer
        self._fill = fill
        self._carry: list[list[Any]] = [[] for _ in self.streams]  # per level: entries read, not handed out
        self._carried_at = [0.0 for _ in self.streams]  # per level: when its carry's oldest entries were read
        self._max_carry_s = max_carry_s
        self._read_head = [b"XREADGROUP", b"GROUP", GROUP.encode(), consumer.encode(), b"COUNT"]
        self._held = HeldConnection(client, self.streams[0], on_connect=self._identify, keep=_unblocked)

    @property
    def carried(self) -> int:
        """Entries read and not handed out yet, all levels together."""
        return sum(len(entries) for entries in self._carry)

    @sends(WORKER, uses={"xreadgroup": STREAMS}, why="a batch's first read on a stage with priority levels")
    def read(self, order: Sequence[int], counts: Sequence[int]) -> list[tuple[int, Any]]:
        """The first of ``streams[i] for i in order`` with entries (``counts[i]`` at most), then with
        ``fill`` the next ones in ``order`` for the room left: each stream's part, as its index in
        ``streams`` and an ``XREADGROUP`` reply of its own, in ``order``; none when no level has entries.
        Each level's carry comes first within its part (it was read first)."""
        now = time.monotonic()
        for i in order:  # too old: while the batch before ran (a slow predict), a peer may have claimed it
            if self._carry[i] and now - self._carried_at[i] > self._max_carry_s:
                self._carry[i] = []
        asked = [(i, counts[i] - len(self._carry[i])) for i in order]
        asked = [(i, count) for i, count in asked if count > 0]
        if asked:
            try:
                self._held.send(b"".join(pack_command([*self._read_head, b"%d" % count, b"STREAMS",
                                                       self.streams[i].encode(), b">"]) for i, count in asked))
                replies = [self._held.read() for _ in asked]
            except Exception:  # no reply left for the next read; the lanes' recovery reads the carry again
                self.close()
                raise
            for (i, _), reply in zip(asked, replies, strict=True):
                if reply:
                    if not self._carry[i]:
                        self._carried_at[i] = now
                    self._carry[i] += _entries(reply)
        return self._hand_out(order, counts)

    def _hand_out(self, order: Sequence[int], counts: Sequence[int]) -> list[tuple[int, Any]]:
        """The batch's parts, from the carries: the first level with entries up to its count, then each
        next one up to the room left."""
        out: list[tuple[int, Any]] = []
        room: int | None = None
        for i in order:
            carry = self._carry[i]
            if not carry:
                continue
            count = counts[i] if room is None else min(room, counts[i])
            taken, self._carry[i] = carry[:count], carry[count:]
            out.append((i, [[self.streams[i].encode(), taken]]))
            room = count - len(taken)
            if not self._fill or room <= 0:
                break
        return out

    def drop_carry(self, levels: Sequence[int] | None = None) -> None:
        """Forget the carries of ``levels`` (indexes of ``streams``; None: all), whose lanes were lost:
        their recovery reads them again."""
        for i in range(len(self.streams)) if levels is None else levels:
            self._carry[i] = []

    def hand_back(self) -> None:
        """Give the carries back to their streams (the worker stops): each entry added again under a new
        id and acked, in one step (``share.lua``), for the workers that go on; what Redis cannot take
        now stays pending, for a peer to claim after ``claim_idle_s``."""
        sharer = Sharer(self._client, self._consumer)
        for i, carry in enumerate(self._carry):
            if carry:
                sharer.give_back(self.streams[i], [[entry[0] for entry in carry]])
        self.drop_carry()

    @sends(WORKER, uses={"xreadgroup": STREAMS}, why="an idle worker's wait on every level of its stage at once")
    def block(self, count: int, block_ms: int) -> dict[int, Any]:
        """One ``XREADGROUP ... BLOCK`` naming every level's stream (they share a node and a hash slot):
        the streams that had new entries, by index in ``streams``, each as an ``XREADGROUP`` reply of
        its own. Where one blocking read per level would take a call per level to start and end the
        others' reads (``CLIENT UNBLOCK``) at every wake-up. Levels that all got entries during the
        wait (rare: all were empty) give up to ``count`` each."""
        args = [b"XREADGROUP", b"GROUP", GROUP.encode(), self._consumer.encode(), b"COUNT", b"%d" % count,
                b"BLOCK", b"%d" % block_ms, b"STREAMS", *(s.encode() for s in self.streams),
                *([b">"] * len(self.streams))]
        reply = self._held.call(pack_command(args))  # nil when ended by :meth:`interrupt` (CLIENT UNBLOCK)
        if not reply:
            return {}
        index = {s.encode(): i for i, s in enumerate(self.streams)}
        items = reply.items() if isinstance(reply, dict) else reply
        return {index[bytes(name)]: [[name, entries]] for name, entries in items}

    def close(self) -> None:
        self.drop_carry()
        self._held.drop()


def _entries(reply: Any) -> list[Any]:
    """The entries of an ``XREADGROUP`` reply naming one stream (RESP2 list or RESP3 map)."""
    return next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
