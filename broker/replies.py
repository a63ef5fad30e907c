"""A gateway's reply lists: the answers to its requests, popped on a connection of their own.

Workers push the answers of a whole batch as one element onto the reply list of the gateway that
submitted them (docs/protocol.md); the gateway's reader pops one element at a time with ``BLPOP``,
held on a connection of its own (:class:`broker.held.AsyncHeldConnection`; on a Redis Cluster the
client routes it to the list's node). The per-request result key stays the durable record: after a
lost connection, which may have taken a popped element with it, the reader re-reads the result keys
of the requests still in flight (``MGET``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from broker.connection import is_cluster_client
from broker.families import REPLIES, RESULTS, SHARED_REPLIES
from broker.held import AsyncHeldConnection
from broker.keys import Keys
from broker.operations import GATEWAY, sends
from broker.protocol import as_bytes
from broker.refusals import log_refusal_once
from broker.resp import pack_command

__all__ = ["RESULTS_BATCH", "ReplyList"]

# Result keys per MGET: one command holds Redis for its lookups; a bounded number keeps each short.
RESULTS_BATCH = 500


class ReplyList:
    """One reply list of a gateway, read through ``client`` (made for it alone: closed with it).
    Both reads raise ``broker.errors.CONNECTION_OR_REPLY_ERRORS``; an ACL refusal is logged once,
    with what would allow it."""

    def __init__(self, client: Any, key: bytes, block_s: float) -> None:
        self.client = client
        self.key = key
        self._block_s = block_s
        self._conn = None if is_cluster_client(client) else AsyncHeldConnection(client)
        self._closed = False
        self._pop = pack_command([b"BLPOP", key, b"%r" % block_s])

    @sends(GATEWAY, uses={"blpop": (REPLIES, SHARED_REPLIES)}, why="the reply reader, blocking up to reply_block_s")
    async def pop(self) -> bytes | None:
        """The next element (one batch's answers), or None if none came within ``block_s``."""
        try:
            if self._conn is None:
                popped = await self.client.blpop([self.key], timeout=self._block_s)
            else:
                popped = await self._conn.call(self._pop)
        except redis.ResponseError as exc:  # e.g. READONLY after a failover, or an ACL
            log_refusal_once(exc, "blpop", self.key)
            raise
        return None if popped is None else as_bytes(popped[1])

    @sends(GATEWAY, uses={"mget": RESULTS}, why="after a lost reply connection: the answers it may have carried")
    async def results(self, keys: Keys, request_ids: Sequence[bytes]) -> list[bytes]:
        """The result records there are of ``request_ids`` (requests of the partition of ``keys``)."""
        found: list[bytes] = []
        for start in range(0, len(request_ids), RESULTS_BATCH):
            names = [keys.result_key(i) for i in request_ids[start:start + RESULTS_BATCH]]
            try:
                values = await self.client.mget(names)
            except redis.ResponseError as exc:
                log_refusal_once(exc, "mget", names[0])
                raise
            found += [as_bytes(v) for v in values if v is not None]
        return found

    async def close(self) -> None:
        """Disconnect (the held connection and ``client``); may be called again."""
        if self._closed:
            return
        self._closed = True
        if self._conn is not None:
            await self._conn.close()
        await self.client.aclose()
