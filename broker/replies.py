"""A gateway's reply lists: the answers to its requests, popped on a connection of their own.

Workers push the answers of a whole batch as one element onto the reply list of the gateway that
submitted them (docs/protocol.md); the gateway's reader pops them with ``BLPOP`` and, in the same write,
``LPOP key POP_MORE``: Redis runs the second as soon as the first is served, so the elements that came
meanwhile (a stream's chunks come a step at a time) arrive in the same round trip instead of one per
round trip. It is held on a connection of its own (:class:`broker.held.AsyncHeldConnection`; on a Redis Cluster the
client routes it to the list's node). The per-request result key stays the durable record: after a
lost connection, which may have taken a popped element with it, the reader re-reads the result keys
of the requests still in flight (``MGET``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from broker.connection import CONNECTION_ERRORS, is_cluster_client, is_refusal
from broker.families import CANCELS, REPLIES, RESULTS, SHARED_REPLIES
from broker.held import AsyncHeldConnection
from broker.keys import Keys
from broker.operations import GATEWAY, sends
from broker.protocol import as_bytes
from broker.refusals import log_refusal_once
from broker.resp import pack_command

__all__ = ["RESULTS_BATCH", "ReplyList", "answered"]

# Result keys per MGET: one command holds Redis for its lookups; a bounded number keeps each short.
RESULTS_BATCH = 500
# Elements taken by the LPOP that follows each BLPOP: what came while the last ones were handled.
POP_MORE = 255


class ReplyList:
    """One reply list of a gateway, read through ``client`` (made for it alone: closed with it).
    Both reads raise ``broker.errors.CONNECTION_OR_REPLY_ERRORS``; an ACL refusal is logged once,
    with what would allow it."""

    def __init__(self, client: Any, key: bytes, block_s: float) -> None:
        self.client = client
        self.key = key
        self._block_s = block_s
        # An ACL refusal is read in full: the connection stays in step (the LPOP's, below).
        self._conn = None if is_cluster_client(client) else AsyncHeldConnection(client, keep=is_refusal)
        self._closed = False
        self._pop = [pack_command([b"BLPOP", key, b"%r" % block_s]), pack_command([b"LPOP", key, b"%d" % POP_MORE])]

    @sends(GATEWAY, uses={"blpop": (REPLIES, SHARED_REPLIES), "lpop": (REPLIES, SHARED_REPLIES)},
           why="the reply reader, blocking up to reply_block_s, and what came meanwhile")
    async def pop(self) -> list[bytes]:
        """The next elements (each one batch's or one step's answers), in order; none if none came within
        ``block_s``. On a Redis Cluster, one element at a time."""
        try:
            if self._conn is None:
                popped = await self.client.blpop([self.key], timeout=self._block_s)
                return [] if popped is None else [as_bytes(popped[1])]
            first, *rest = await self._conn.call_many(self._pop)
            more = rest[0] if rest else None
        except redis.ResponseError as exc:  # e.g. READONLY after a failover, or an ACL
            log_refusal_once(exc, "blpop", self.key)
            raise
        if isinstance(first, redis.ResponseError):  # call_many returns an error reply as its exception
            log_refusal_once(first, "blpop", self.key)
            raise first
        if isinstance(more, redis.ResponseError):
            if not is_refusal(more):
                raise more
            # An ACL user generated before the gateway took LPOP (`conveyor acl`): one element a round trip,
            # as then, said once, rather than no answers at all.
            log_refusal_once(more, "lpop", self.key)
            self._pop = self._pop[:1]
            more = None
        if first is None:
            return []
        return [as_bytes(first[1]), *(as_bytes(e) for e in more or ())]

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


@sends(GATEWAY, uses={"exists": (RESULTS, CANCELS)},
       why="a caller's own request id: whether it was answered, cancelled or timed out a moment ago")
async def answered(client: Any, keys: Sequence[Keys], request_id: bytes) -> bool:
    """Whether a result of ``request_id`` is held in any of these partitions, or a cancel marker (a
    request under that id then would lose its result's ``SET NX`` and wait out its timeout, or take
    the answer of the earlier run)."""
    for partition in keys:
        name = partition.result_key(request_id)
        try:
            if await client.exists(name, partition.cancel_prefix + request_id):
                return True
        except CONNECTION_ERRORS:  # a partition out of reach (a Cluster node down): a check, not the answer's path
            continue
        except redis.ResponseError as exc:
            log_refusal_once(exc, "exists", name)
            raise
    return False
