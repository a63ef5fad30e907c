"""Priority levels: which stream a request of a given priority goes to, and a worker's first read
that takes the highest level with entries, and lower levels' into the room left (``levels.lua``).

A pipeline of ``priority_levels`` N (Triton's meaning: 1 is the highest level, N the lowest, and
priority 0 the default) keeps one stream per level at every stage: the default level, N, is the
stage's stream of every pipeline (``P:stream:<i>``, so nothing changes for a producer that sends no
priority), and each level L < N has ``P:stream:<i>:p<L>`` (:meth:`broker.keys.Keys.at_level`), in the
same hash slot. A worker forwards a batch read from one level into the same level of the next
stage, so a request's priority travels with it to the last stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from broker.families import STREAMS
from broker.held import HeldConnection
from broker.keys import GROUP
from broker.operations import WORKER, Script, sends
from broker.resp import pack_command
from broker.streams import UnblockableReader
from broker.streams import unblocked as _unblocked

__all__ = ["LEVELS", "MAX_LEVELS", "LevelReader", "stream_level"]

MAX_LEVELS = 8  # a handful: every level is a stream, a read and a lane at every worker
LEVELS_LUA = resources.files("broker").joinpath("levels.lua").read_text()
LEVELS = Script("levels.lua", (STREAMS,), (("xreadgroup", (STREAMS,)),))


def stream_level(priority: int, levels: int) -> int:
    """The stream level (:attr:`broker.keys.Keys.level`) of a request of ``priority`` in a pipeline of
    ``levels`` priority levels: L for 1 <= L < levels, else 0, the default level's streams. As Triton
    does, 0 and a priority past the pipeline's levels mean the default level (the lowest)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise ValueError(f"priority must be an integer >= 0 (1 the highest, 0 the default), got {priority!r}")
    return priority if 0 < priority < levels else 0


class LevelReader(UnblockableReader):
    """Runs ``levels.lua`` for one partition's level streams of one stage, as one consumer, on a
    connection of its own."""

    def __init__(self, client: redis.Redis, streams: Sequence[str], consumer: str, fill: bool = True) -> None:
        """``fill``: a batch read from one level takes the room left from the levels after it."""
        self.streams = list(streams)
        self._client = client
        self._sha = client.register_script(LEVELS_LUA).sha
        self._consumer = consumer
        self._fill = b"1" if fill else b"0"
        self._held = HeldConnection(client, self.streams[0], on_connect=self._identify, keep=_unblocked)

    @sends(WORKER, scripts=(LEVELS,), why="a batch's first read on a stage with priority levels")
    def read(self, order: Sequence[int], counts: Sequence[int]) -> list[tuple[int, Any]]:
        """The first of ``streams[i] for i in order`` with new entries (``counts[i]`` at most), then with
        ``fill`` the next ones in ``order`` for the room left: each stream read, as its index in
        ``streams`` and its ``XREADGROUP`` reply, in ``order``; none when no level has entries."""
        keys = [self.streams[i] for i in order]
        args = [b"EVALSHA", self._sha.encode(), b"%d" % len(keys), *(k.encode() for k in keys), GROUP.encode(),
                self._consumer.encode(), self._fill, *(b"%d" % counts[i] for i in order)]
        try:
            reply = self._held.call(pack_command(args))
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
            self._client.script_load(LEVELS_LUA)
            reply = self._held.call(pack_command(args))
        if not reply:
            return []
        return [(order[int(reply[k]) - 1], reply[k + 1]) for k in range(0, len(reply), 2)]

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
        self._held.drop()
