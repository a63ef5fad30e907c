"""What a worker needs beyond one stream on one server: a reader bound to the node that owns
its stream on a Redis Cluster.

The batching reader (:class:`workers.batching.StreamReader`) keeps a connection of its own for
XREADGROUP BLOCK and ends a wait early with ``CLIENT UNBLOCK`` sent from the pool: on a
cluster both must go to the one node that serves the stream's slot (redis-py's cluster client
cannot route a raw connection, and ``CLIENT UNBLOCK`` has no key to route by). After a failover
or a slot move the reader's connection fails or answers MOVED: it then re-reads the slot map
and reconnects to the new owner.
"""

from __future__ import annotations

from typing import Any

import redis

from broker.connection import is_cluster_client, node_client, refresh_slots
from workers.batching import StreamReader


class NodeStreamReader(StreamReader):
    """A :class:`StreamReader` whose connection and ``CLIENT UNBLOCK`` go to the stream's node."""

    def __init__(self, cluster: redis.Redis, stream: str, consumer: str) -> None:
        super().__init__(node_client(cluster, stream), stream, consumer)
        self._cluster = cluster
        self._stale = False

    def _connection(self) -> Any:
        if self._conn is None:
            if self._stale:
                refresh_slots(self._cluster)
                self._stale = False
            self._client = node_client(self._cluster, self._stream)
        return super()._connection()

    def close(self) -> None:
        if self._conn is not None:
            self._stale = True  # closed after an error (or at the end): look the owner up again
        super().close()


def stream_reader(client: redis.Redis, stream: str, consumer: str) -> StreamReader:
    """The reader for ``stream``: node-bound on a cluster, the plain one otherwise."""
    if is_cluster_client(client):
        return NodeStreamReader(client, stream, consumer)
    return StreamReader(client, stream, consumer)
