"""Runs ``submit.lua``: the only write path of a gateway, the twin of :mod:`broker.commit`.

One call admits a whole turn of requests against the first stage's ``max_backlog`` (read in
Redis, from the key workers write at registration), adds the admitted ones to the first
stage's stream and unlinks the result keys the gateway has consumed, in one round trip. The
command is packed here from bytes (:func:`broker.resp.pack_command`), not through redis-py's
encoder: on the gateway's hot path that packing was the largest single cost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aredis

from broker.connection import is_cluster_client
from broker.families import FIRST_STREAM, MAX_BACKLOG, RESULTS
from broker.held import AsyncHeldConnection
from broker.keys import Keys
from broker.operations import GATEWAY, Script, sends
from broker.resp import LARGE_ARG_BYTES, pack_command

SUBMIT_LUA = resources.files("broker").joinpath("submit.lua").read_bytes()
SUBMIT_SHA = hashlib.sha1(SUBMIT_LUA).hexdigest().encode()
SUBMIT = Script("submit.lua", (FIRST_STREAM, MAX_BACKLOG, RESULTS), (
    ("get", (MAX_BACKLOG,)), ("xlen", (FIRST_STREAM,)), ("xadd", (FIRST_STREAM,)), ("unlink", (RESULTS,))))

# request id, encoded data, deadline (Unix ms, ASCII), and the RESP of the four ARGV of its entry
# (``Submitter.entry``: packed once as it is queued, not per turn; b"" for a large payload, packed
# at the turn's join so that its bytes are copied once).
Submission = tuple[bytes, bytes, bytes, bytes]

OVERLOADED = "OVERLOADED"  # the script's error reply when it admitted none of the entries offered


def is_overloaded(exc: redis.ResponseError) -> bool:
    """The submit script refused every entry: the first stage's backlog is at its limit."""
    return str(exc).startswith(OVERLOADED)


def keeps_connection(exc: redis.ResponseError) -> bool:
    """Admission's refusal and a missing script leave a submit connection in use; other error
    replies (READONLY after a failover, OOM...) drop it, and the next turn reconnects."""
    return is_overloaded(exc) or isinstance(exc, redis.exceptions.NoScriptError)


def submit_connection(client: aredis.Redis) -> AsyncHeldConnection:
    return AsyncHeldConnection(client, keep=keeps_connection)


class Submitter:
    """Packs ``submit.lua``'s calls for one gateway (one reply key) of one pipeline partition.
    :meth:`__call__` runs one on its own; a gateway serving several pipelines writes the packed
    calls of all of them in one round trip (:meth:`broker.held.AsyncHeldConnection.call_many`)."""

    def __init__(self, client: aredis.Redis, keys: Keys, reply_key: bytes, max_backlog: int | None = None) -> None:
        self._client = client
        self._stream = keys.stream(0).encode()
        self._limit_key = keys.max_backlog.encode()
        self._reply_key = reply_key
        self._own_limit = b"" if max_backlog is None else b"%d" % max_backlog
        reply = b"$%d\r\n%b\r\n" % (len(reply_key), reply_key.replace(b"%", b"%%"))
        self._entry_format = b"$%d\r\n%b\r\n$%d\r\n%b\r\n" + reply + b"$%d\r\n%b\r\n"
        # Turns come one at a time (the gateway's flusher), on one held connection (broker.held).
        self._held = submit_connection(client)

    async def load(self) -> None:
        """Load the script once at start, so that the first turn pays no NOSCRIPT round trip."""
        await self._client.script_load(SUBMIT_LUA)

    def entry(self, request_id: bytes, data: bytes, deadline: bytes) -> Submission:
        """One request, ready for a turn: its four ARGV (id, data, reply key, deadline) packed now."""
        if len(data) >= LARGE_ARG_BYTES:
            return request_id, data, deadline, b""
        return request_id, data, deadline, self._entry_format % (len(request_id), request_id, len(data), data,
                                                                 len(deadline), deadline)

    def _head(self, batch: Sequence[Submission], unlink: Sequence[bytes]) -> list[bytes]:
        return [b"EVALSHA", SUBMIT_SHA, b"%d" % (2 + len(unlink)), self._stream, self._limit_key, *unlink,
                b"%d" % len(batch), self._own_limit]

    def _args(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0) -> list[bytes]:
        args = self._head(batch, unlink)
        for request_id, data, deadline, _ in batch:
            args += (request_id, data, self._reply_key, deadline)
        return args + _tail(batch, entries)

    def pack(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0) -> bytes:
        """The turn's command: its head packed here, each entry as packed by :meth:`entry`.
        ``entries``: split the turn into this many batch entries (``broker.packing``; 0: single
        entries; the script makes single entries anyway where a ``max_backlog`` is in force)."""
        if not all(s[3] for s in batch):  # a large payload: one join, its bytes copied once
            return pack_command(self._args(batch, unlink, entries))
        head = self._head(batch, unlink)
        tail = _tail(batch, entries)
        parts = [b"*%d\r\n" % (len(head) + 4 * len(batch) + len(tail))]
        parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in head]
        parts += [s[3] for s in batch]
        parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in tail]
        return b"".join(parts)

    @sends(GATEWAY, scripts=(SUBMIT,), why="once per turn of submissions")
    async def __call__(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0) -> int:
        """Submit ``batch``, unlink ``unlink``; returns how many of ``batch`` (its head, in order)
        were admitted. Raises ``redis.ResponseError`` (see :func:`is_overloaded`) if none was."""
        try:
            return int(await self._run(batch, unlink, entries))
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts, or a failover
            await self.load()
            return int(await self._run(batch, unlink, entries))

    async def _run(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int) -> Any:
        if is_cluster_client(self._client):  # no single pool to write to: redis-py routes by the first key
            return await self.run_routed(batch, unlink, entries)
        return await self._held.call(self.pack(batch, unlink, entries))

    async def run_routed(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0) -> Any:
        """The call through redis-py's routing (a cluster client), not a held connection."""
        return await self._client.execute_command("EVALSHA", *self._args(batch, unlink, entries)[1:])

    async def close(self) -> None:
        await self._held.close()


def _tail(batch: Sequence[Submission], entries: int) -> list[bytes]:
    """The script's optional last argument: into how many batch entries to split the turn (none:
    single entries). A turn with a large payload stays single entries: a batch entry would copy it
    once more in Redis and again in the worker, for a saving of a few microseconds per request."""
    if entries < 1 or entries >= len(batch) or not all(s[3] for s in batch):
        return []
    return [b"%d" % entries]
