"""What a worker needs beyond one stream on one server: a reader bound to the node that owns
its stream on a Redis Cluster, and one lane per partition of a partitioned pipeline.

The batching reader (:class:`workers.batching.collector.StreamReader`) keeps a connection of its own for
XREADGROUP BLOCK and ends a wait early with ``CLIENT UNBLOCK`` sent from the pool: on a
cluster both must go to the one node that serves the stream's slot (redis-py's cluster client
cannot route a raw connection, and ``CLIENT UNBLOCK`` has no key to route by). After a failover
or a slot move the reader's connection fails or answers MOVED: it then re-reads the slot map
and reconnects to the new owner.
"""

from __future__ import annotations

import functools
import logging
import math
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from broker.commit import BatchStats, Committer
from broker.connection import CONNECTION_ERRORS, Backoff, is_cluster_client, is_transient, node_client, refresh_slots
from broker.keys import Keys
from workers.batching.collector import BatchCollector, Entry, StreamReader, _parse

log = logging.getLogger("conveyor.worker")


class NodeStreamReader(StreamReader):
    """A :class:`StreamReader` whose connection and ``CLIENT UNBLOCK`` go to the stream's node."""

    def __init__(self, cluster: redis.Redis, stream: str, consumer: str) -> None:
        super().__init__(node_client(cluster, stream), stream, consumer)
        self._cluster = cluster
        self._stale = False

    def _connection(self) -> Any:
        if self._conn is not None:
            return self._conn
        try:
            if self._stale:
                refresh_slots(self._cluster)
            self._client = node_client(self._cluster, self._stream)
            conn = super()._connection()
        except BaseException:
            self._stale = True  # e.g. the node is dead: ask the cluster again next time
            raise
        self._stale = False
        return conn

    def close(self) -> None:
        if self._conn is not None:
            self._stale = True  # closed after an error (or at the end): look the owner up again
        super().close()


def stream_reader(client: redis.Redis, stream: str, consumer: str) -> StreamReader:
    """The reader for ``stream``: node-bound on a cluster, the plain one otherwise."""
    if is_cluster_client(client):
        return NodeStreamReader(client, stream, consumer)
    return StreamReader(client, stream, consumer)


@dataclass
class Lane:
    """One partition of a worker's stage: its keys, stream, reader, collector and committer."""

    keys: Keys
    stream: str
    reader: StreamReader
    collector: BatchCollector
    committer: Committer
    stats: BatchStats
    # With several partitions each lane recovers on its own: one whose node is unreachable (a
    # master failing over) is set aside and retried after a backoff while the others keep serving.
    recover: bool = True  # drain this consumer's own pending entries here before reading new ones
    first_drain: bool = True  # that drain is the one at start, not a re-read after losing Redis
    retry_at: float = 0.0  # monotonic time before which the lane is left alone
    backoff: Backoff = field(default_factory=Backoff)


def lane_failure(exc: BaseException) -> bool:
    """Errors that put one lane aside (its node unreachable, failing over, refusing writes);
    anything else is the worker's business."""
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    return isinstance(exc, redis.ResponseError) and is_transient(exc)


def set_aside(lane: Lane, exc: BaseException) -> None:
    log.warning("partition unavailable stream=%s error=%r", lane.stream, exc)
    lane.reader.close()
    lane.recover = True
    lane.retry_at = time.monotonic() + lane.backoff.next_delay_s()


def on_lane(lane: Lane, drain: Callable[[bool], None], action: Callable[[], bool]) -> bool:
    """Run ``action`` on a lane that is up, first draining what this consumer holds there if the
    lane is recovering; a lane failure sets the lane aside. Returns what ``action`` returned
    (False when the lane was skipped or failed)."""
    if time.monotonic() < lane.retry_at:
        return False
    try:
        if lane.recover:
            drain(not lane.first_drain)
            lane.recover = lane.first_drain = False
        done = action()
    except Exception as exc:  # only lane failures are handled here; the rest is re-raised as is
        if not lane_failure(exc):
            raise
        set_aside(lane, exc)
        return False
    lane.backoff.reset()
    return done


def wait_any(lanes: Sequence[Lane], count: int, timeout_s: float) -> list[tuple[Lane, list[Entry]]]:
    """Block on every lane's stream at once; return as soon as one has new entries.

    An idle worker of a partitioned stage must wake for whichever partition gets an item
    first, yet one XREADGROUP can only name streams of one slot. So each lane's reader (its
    own connection, on its stream's node) sends ``XREADGROUP ... BLOCK``; the first socket to
    become readable ends the wait, and the other reads are ended with ``CLIENT UNBLOCK`` on
    their own node. Every reply is read: entries that won the race on another lane are
    returned too (they are delivered to this consumer and must be processed). A lane that
    fails (its node unreachable) is set aside; the others are still served.
    """
    block_ms = max(1, math.ceil(timeout_s * 1000))
    sent: list[tuple[Lane, Any]] = []
    for lane in lanes:
        conn = _guarded(lane, functools.partial(_send, lane, count, block_ms))
        if conn is not None:
            sent.append((lane, conn))
    if not sent:
        return []
    readable, _, _ = select.select([conn._sock for _, conn in sent], [], [], timeout_s)
    ready = set(readable)
    found: list[tuple[Lane, list[Entry]]] = []
    for lane, conn in sent:
        entries = _guarded(lane, functools.partial(_finish, lane, conn, conn._sock in ready))
        if entries:
            found.append((lane, entries))
    return found


def _finish(lane: Lane, conn: Any, readable: bool) -> list[Entry]:
    if not readable:
        _unblock(lane.reader, conn)
    return _parse(conn.read_response())


def _send(lane: Lane, count: int, block_ms: int) -> Any:
    conn = lane.reader._connection()
    conn.send_command(*lane.reader._command(count, block_ms, ">"))
    return conn


def _guarded(lane: Lane, step: Callable[[], Any]) -> Any:
    """``step()``, or None if it failed with a lane failure (the lane is then set aside)."""
    try:
        return step()
    except BaseException as exc:
        lane.reader.close()  # its read may be half done: never reuse that connection
        if not lane_failure(exc):
            raise
        set_aside(lane, exc)
        return None


def _unblock(reader: StreamReader, conn: Any) -> None:
    """``CLIENT UNBLOCK`` the reader's pending XREADGROUP. It was sent on another connection,
    so in rare races the node has not started blocking yet (UNBLOCK answers 0): try again
    shortly, a bounded number of times, rather than wait out the whole BLOCK."""
    for _ in range(3):
        if reader._client.execute_command("CLIENT", "UNBLOCK", reader._client_id) or conn.can_read(timeout=0.005):
            return
