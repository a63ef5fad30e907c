"""What a worker needs beyond one stream on one server: a reader bound to the node that owns
its stream on a Redis Cluster, and one lane per partition of a partitioned pipeline.

The batching reader (:class:`workers.batching.StreamReader`) keeps a connection of its own for
XREADGROUP BLOCK and ends a wait early with ``CLIENT UNBLOCK`` sent from the pool: on a
cluster both must go to the one node that serves the stream's slot (redis-py's cluster client
cannot route a raw connection, and ``CLIENT UNBLOCK`` has no key to route by). After a failover
or a slot move the reader's connection fails or answers MOVED: it then re-reads the slot map
and reconnects to the new owner.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from broker.commit import BatchStats, Committer
from broker.connection import is_cluster_client, node_client, refresh_slots
from broker.keys import Keys
from workers.batching import BatchCollector, Entry, StreamReader, _parse


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


def wait_any(lanes: Sequence[Lane], count: int, timeout_s: float) -> list[tuple[Lane, list[Entry]]]:
    """Block on every lane's stream at once; return as soon as one has new entries.

    An idle worker of a partitioned stage must wake for whichever partition gets an item
    first, yet one XREADGROUP can only name streams of one slot. So each lane's reader (its
    own connection, on its stream's node) sends ``XREADGROUP ... BLOCK``; the first socket to
    become readable ends the wait, and the other reads are ended with ``CLIENT UNBLOCK`` on
    their own node. Every reply is read: entries that won the race on another lane are
    returned too (they are delivered to this consumer and must be processed).
    """
    block_ms = max(1, math.ceil(timeout_s * 1000))
    sent: list[tuple[Lane, Any]] = []
    try:
        for lane in lanes:
            reader = lane.reader
            conn = reader._connection()
            conn.send_command(*reader._command(count, block_ms, ">"))
            sent.append((lane, conn))
        readable, _, _ = select.select([conn._sock for _, conn in sent], [], [], timeout_s)
        ready = set(readable)
        for lane, conn in sent:
            if conn._sock not in ready:
                _unblock(lane.reader, conn)
        found = [(lane, _parse(conn.read_response())) for lane, conn in sent]
    except BaseException:
        for lane in lanes:
            lane.reader.close()
        raise
    return [(lane, entries) for lane, entries in found if entries]


def _unblock(reader: StreamReader, conn: Any) -> None:
    """``CLIENT UNBLOCK`` the reader's pending XREADGROUP. It was sent on another connection,
    so in rare races the node has not started blocking yet (UNBLOCK answers 0): try again
    shortly, a bounded number of times, rather than wait out the whole BLOCK."""
    for _ in range(3):
        if reader._client.execute_command("CLIENT", "UNBLOCK", reader._client_id) or conn.can_read(timeout=0.005):
            return
