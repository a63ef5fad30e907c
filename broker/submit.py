"""Runs ``submit.lua``: the only write path of a gateway, the twin of :mod:`broker.commit`.

One call admits a whole turn of requests against the first stage's ``max_backlog`` (read in
Redis, from the key workers write at registration), adds the admitted ones to the first
stage's stream and unlinks the result keys the gateway has consumed, in one round trip. The
command is packed here from bytes (:func:`broker.resp.pack_command`), not through redis-py's
encoder, whose per-argument work a gateway would pay on every turn (:mod:`broker.resp` says why).

A :class:`Submitter` packs the calls of one pipeline partition; :class:`Submissions` sends a
turn of them, one per partition, in one round trip, and says of each what became of it
(:data:`Outcome`): how many requests were admitted, a refusal, or a lost call.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aredis

from broker.connection import CONNECTION_ERRORS, error_text, is_cluster_client, is_transient
from broker.families import FIRST_LEVELS, FIRST_STREAM, MAX_BACKLOG, RESULTS
from broker.held import AsyncHeldConnection
from broker.keys import Keys
from broker.operations import GATEWAY, Script, sends
from broker.refusals import log_refusal_once
from broker.resp import LARGE_ARG_BYTES, pack_command

__all__ = ["OVERLOADED", "SUBMIT", "SUBMIT_LUA", "SUBMIT_SHA", "Call", "Lost", "Outcome", "Refused", "Submission",
           "Submissions", "Submitter"]

SUBMIT_LUA = resources.files("broker").joinpath("submit.lua").read_bytes()
SUBMIT_SHA = hashlib.sha1(SUBMIT_LUA).hexdigest().encode()
SUBMIT = Script("submit.lua", (FIRST_STREAM, FIRST_LEVELS, MAX_BACKLOG, RESULTS), (
    ("get", (MAX_BACKLOG,)), ("xlen", (FIRST_STREAM, FIRST_LEVELS)), ("xadd", (FIRST_STREAM, FIRST_LEVELS)),
    ("unlink", (RESULTS,))))

# request id, encoded data, deadline (Unix ms, ASCII), and the RESP of the four ARGV of its entry
# (``Submitter.entry``: packed once as it is queued, not per turn; b"" for a large payload, packed
# at the turn's join so that its bytes are copied once).
Submission = tuple[bytes, bytes, bytes, bytes]

OVERLOADED = "OVERLOADED"  # the script's error reply when it admitted none of the entries offered


@dataclass(frozen=True, slots=True)
class Refused:
    """Redis refused a call: none of its requests was added. ``overloaded``: the script's admission
    (the first stage's backlog is at its max_backlog), the consumed keys were unlinked; else Redis's
    own refusal (``transient``: one that passes, as OOM or READONLY; else an ACL, a renamed
    command...), and the script may not have run."""

    reason: str
    overloaded: bool
    transient: bool


@dataclass(frozen=True, slots=True)
class Lost:
    """A call to send again later: the connection failed under it (it may or may not have run), or the
    script was missing again right after it was loaded (a failover under way)."""

    reason: str


# What became of one call: how many of its requests (the head of its batch, in order) were admitted.
Outcome = int | Refused | Lost


def is_overloaded(exc: redis.ResponseError) -> bool:
    """The submit script refused every entry: the first stage's backlog is at its limit."""
    return str(exc).startswith(OVERLOADED)


def keeps_connection(exc: redis.ResponseError) -> bool:
    """Admission's refusal and a missing script leave a submit connection in use; other error
    replies (READONLY after a failover, OOM...) drop it, and the next turn reconnects."""
    return is_overloaded(exc) or isinstance(exc, redis.exceptions.NoScriptError)


class Submitter:
    """Packs ``submit.lua``'s calls for one gateway (one reply key) of one pipeline partition and
    priority level (``keys.level``); :class:`Submissions` sends them. ``above``: the first stage's
    streams of the levels above this one, counted in its backlog (set as the pipeline's spec tells)."""

    def __init__(self, keys: Keys, reply_key: bytes, max_backlog: int | None = None) -> None:
        self.stream = keys.stream(0)
        self.above: list[bytes] = []
        self._stream = self.stream.encode()
        self._limit_key = keys.max_backlog.encode()
        self._reply_key = reply_key
        self._own_limit = b"" if max_backlog is None else b"%d" % max_backlog
        reply = b"$%d\r\n%b\r\n" % (len(reply_key), reply_key.replace(b"%", b"%%"))
        self._entry_format = b"$%d\r\n%b\r\n$%d\r\n%b\r\n" + reply + b"$%d\r\n%b\r\n"

    def entry(self, request_id: bytes, data: bytes, deadline: bytes) -> Submission:
        """One request, ready for a turn: its four ARGV (id, data, reply key, deadline) packed now."""
        if len(data) >= LARGE_ARG_BYTES:
            return request_id, data, deadline, b""
        return request_id, data, deadline, self._entry_format % (len(request_id), request_id, len(data), data,
                                                                 len(deadline), deadline)

    def _head(self, batch: Sequence[Submission], unlink: Sequence[bytes]) -> list[bytes]:
        return [b"EVALSHA", SUBMIT_SHA, b"%d" % (2 + len(unlink) + len(self.above)), self._stream, self._limit_key,
                *unlink, *self.above, b"%d" % len(batch), self._own_limit]

    def _tail(self, batch: Sequence[Submission], entries: int, traces: Sequence[tuple[int, bytes]]) -> list[bytes]:
        return _tail(batch, entries, traces, len(self.above))

    def arguments(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0,
                  traces: Sequence[tuple[int, bytes]] = ()) -> list[bytes]:
        """The call's command and arguments, unpacked (for a client that routes it, or packs it itself)."""
        args = self._head(batch, unlink)
        for request_id, data, deadline, _ in batch:
            args += (request_id, data, self._reply_key, deadline)
        return args + self._tail(batch, entries, traces)

    def pack(self, batch: Sequence[Submission], unlink: Sequence[bytes], entries: int = 0,
             traces: Sequence[tuple[int, bytes]] = ()) -> bytes:
        """The turn's command: its head packed here, each entry as packed by :meth:`entry`.
        ``entries``: split the turn into this many batch entries (``broker.batch_entries``; 0: single
        entries; the script makes single entries anyway where a ``max_backlog`` is in force).
        ``traces``: (index in ``batch``, ``trace`` value) of the few requests that carry one."""
        if not all(s[3] for s in batch):  # a large payload: one join, its bytes copied once
            return pack_command(self.arguments(batch, unlink, entries, traces))
        head = self._head(batch, unlink)
        tail = self._tail(batch, entries, traces)
        parts = [b"*%d\r\n" % (len(head) + 4 * len(batch) + len(tail))]
        parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in head]
        parts += [s[3] for s in batch]
        parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in tail]
        return b"".join(parts)


def _tail(batch: Sequence[Submission], entries: int, traces: Sequence[tuple[int, bytes]] = (),
          above: int = 0) -> list[bytes]:
    """The script's optional last arguments, each present only if it or one after it is: into how many
    batch entries to split the turn (none: single entries), how many level streams above count in the
    backlog (``above``), then the trace values of the requests that carry one. A turn with a large
    payload stays single entries: a batch entry would copy it once more in Redis and again in the
    worker, which costs more than the per-entry work it saves."""
    split = not (entries < 1 or entries >= len(batch) or not all(s[3] for s in batch))
    k = b"%d" % entries if split else b""
    if traces:
        tail = [k, b"%d" % above if above else b"", b"%d" % len(traces)]
        for index, value in traces:
            tail += (b"%d" % (index + 1), value)
        return tail
    if above:
        return [k, b"%d" % above]
    return [k] if split else []


# One call of a turn: whose (its partition's packer), which requests, which consumed result keys to
# unlink, into how many batch entries to split them (0: single entries), and the trace values of the
# requests that carry one (index in the turn, value; most turns: none).
Call = (tuple[Submitter, Sequence[Submission], Sequence[bytes], int]
        | tuple[Submitter, Sequence[Submission], Sequence[bytes], int, Sequence[tuple[int, bytes]]])


def _traces(call: Call) -> Sequence[tuple[int, bytes]]:
    return call[4] if len(call) > 4 else ()


class Submissions:
    """A gateway's turns of submissions. On one Redis every call of a turn goes out in one write on
    one held connection (:class:`broker.held.AsyncHeldConnection`: turns come one at a time, from the
    gateway's flusher); on a Redis Cluster each call is routed to its slot's node by the client.
    A missing script (Redis restarted or flushed its scripts, or a failover) is loaded and the calls
    it refused are sent again, once."""

    def __init__(self, client: aredis.Redis) -> None:
        self._client = client
        self._held = None if is_cluster_client(client) else AsyncHeldConnection(client, keep=keeps_connection)

    @sends(GATEWAY, uses={"script|load": ()}, why="at start, so that the first turn pays no NOSCRIPT round trip")
    async def load(self) -> None:
        await self._client.script_load(SUBMIT_LUA)

    @sends(GATEWAY, scripts=(SUBMIT,), why="once per turn of submissions: every partition's call in one round trip")
    async def send(self, calls: Sequence[Call]) -> list[Outcome]:
        """Each call's outcome, in order. Raises only what is neither a connection failure nor an
        error reply (a bug)."""
        replies = await self._replies(calls)
        again = [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
        if again:
            try:
                await self.load()
                retried = await self._replies([calls[i] for i in again])
            except CONNECTION_ERRORS as exc:
                retried = [exc] * len(again)
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        return [_outcome(call, reply) for call, reply in zip(calls, replies, strict=True)]

    async def _replies(self, calls: Sequence[Call]) -> list[Any]:
        """Each call's reply, or the exception it met (error replies as their exception objects)."""
        if self._held is not None:
            try:
                return await self._held.call_many([call[0].pack(call[1], call[2], call[3], _traces(call))
                                                   for call in calls])
            except CONNECTION_ERRORS as exc:
                return [exc] * len(calls)
        return list(await asyncio.gather(
            *(self._client.execute_command("EVALSHA", *call[0].arguments(call[1], call[2], call[3],
                                                                         _traces(call))[1:])
              for call in calls), return_exceptions=True))

    async def close(self) -> None:
        if self._held is not None:
            await self._held.close()


# To send again later: a lost connection (the call may have run), or NOSCRIPT again after a load (a failover).
_LOST: tuple[type[Exception], ...] = (redis.exceptions.NoScriptError, *CONNECTION_ERRORS)


def _outcome(call: Call, reply: Any) -> Outcome:
    if type(reply) is int:
        return reply
    if isinstance(reply, _LOST):
        return Lost(error_text(reply))
    if isinstance(reply, redis.ResponseError):
        if is_overloaded(reply):
            return Refused(str(reply), True, True)
        log_refusal_once(reply, "submit.lua", call[0].stream)
        return Refused(str(reply), False, is_transient(reply))
    if isinstance(reply, BaseException):
        raise reply
    return int(reply)
