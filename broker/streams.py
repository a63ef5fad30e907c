"""Reading a stage's stream as one consumer of its group: ``XREADGROUP``, blocking, unblocking, parsing.

Each reader holds a connection of its own (:class:`broker.held.HeldConnection`), on the node
that serves its stream on a Redis Cluster. Redis checks ``BLOCK`` timeouts only every 1/hz
(about 100 ms by default), so a wait of a few milliseconds (a batch window) cannot be left to
``BLOCK``: :meth:`StreamReader.read_until` sends a blocking read, waits on its socket for exactly
the time left and, if nothing came, ends the read with ``CLIENT UNBLOCK`` from another connection
to the same node. A blocked ``XREADGROUP`` still returns as soon as an entry arrives.

:func:`read_any` blocks on several streams at once (a worker of a partitioned pipeline: one
``XREADGROUP`` can only name streams of one slot) and returns what each has.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from typing import Any

import redis

from broker.families import STREAMS
from broker.held import TIMED_OUT, HeldConnection
from broker.keys import GROUP
from broker.operations import WORKER, sends
from broker.protocol import F_ITEMS, expand
from broker.resp import pack_command

Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields); None: deleted while pending

_UNBLOCK_TRIES = 3
_PACKED_MAX = 64  # packed reads kept per reader (a batch window's reads vary their BLOCK)


def parse_entries(response: Any) -> list[Entry]:
    """The entries of an ``XREADGROUP`` reply (RESP3 answers a map of streams, RESP2 a list of pairs),
    a batch entry as one entry per request (:func:`broker.protocol.expand`)."""
    return _parse_counted(response)[0]


def _parse_counted(response: Any) -> tuple[list[Entry], int]:
    """:func:`parse_entries`, and how many stream entries the reply held."""
    if not response:
        return [], 0
    streams = response.items() if isinstance(response, dict) else response
    entries: list[Entry] = []
    read = 0
    for _stream, items in streams:
        read += len(items)
        for entry_id, fields in items:
            if fields is None:
                entries.append((entry_id, None))
                continue
            if len(fields) % 2:
                raise ValueError(f"stream entry {entry_id!r} with an odd number of field items")
            it = iter(fields)
            one = dict(zip(it, it, strict=False))  # an even count, checked above
            if F_ITEMS in one:
                entries += expand(entry_id, one)
            else:
                entries.append((entry_id, one))
    return entries, read


class UnblockableReader:
    """A reader on a connection of its own whose blocked read another thread can end: its connection's id,
    learnt at each connect (``CLIENT ID``), and :meth:`interrupt`. Subclasses make ``_held`` with
    ``on_connect=self._identify``."""

    _client_id = 0
    _held: HeldConnection

    @sends(WORKER, uses={"client|id": ()}, why="when a stream or level reader connects")
    def _identify(self, conn: Any) -> None:
        conn.send_command("CLIENT", "ID")
        self._client_id = int(conn.read_response())

    @sends(WORKER, uses={"client|unblock": ()}, why="a stopping worker's blocked read ended at once")
    def interrupt(self) -> None:
        """End this reader's blocked read, if one is blocked, from another thread (the heartbeat's, when
        the worker is asked to stop): one ``CLIENT UNBLOCK`` on the reader's server (its node's control client
        on a Redis Cluster: bounded), never its own connection. A read not blocked yet is not waited for: it ends
        at its own timeout."""
        client_id = self._client_id
        if client_id:
            self._held.control("CLIENT", "UNBLOCK", client_id)


class StreamReader(UnblockableReader):
    """Reads one stream as one consumer, on a connection of its own."""

    def __init__(self, client: redis.Redis, stream: str, consumer: str, per_entry: float = 1.0) -> None:
        """``per_entry``: requests per entry to expect until reads tell (a stage fed batch entries:
        its ``batch_size``, their largest, so that its first read is of one entry, not of a batch of them)."""
        self.stream = stream
        self._consumer = consumer
        self._held = HeldConnection(client, stream, on_connect=self._identify, keep=unblocked)
        self._sent = False  # a read was sent and its reply is still to be taken
        self._packed: dict[tuple[int, int | None, str], bytes] = {}
        self.per_entry = per_entry  # requests per stream entry lately (batch entries hold several)

    def close(self) -> None:
        self._held.drop()
        self._sent = False

    @sends(WORKER, uses={"xreadgroup": STREAMS}, why="new entries and its own pending ones")
    def _command(self, count: int, block_ms: int | None, start: str) -> list[Any]:
        cmd: list[Any] = ["XREADGROUP", "GROUP", GROUP, self._consumer, "COUNT", count]
        if block_ms is not None:
            cmd += ["BLOCK", block_ms]
        return [*cmd, "STREAMS", self.stream, start]

    def read(self, count: int, block_ms: int | None = None, start: str = ">") -> list[Entry]:
        """Non-blocking, or blocking with Redis's own (coarse) timeout. ``start="0"``: this
        consumer's own pending entries, from the oldest."""
        self.send_read(count, block_ms, start)
        return self.finish_read()

    def send_read(self, count: int, block_ms: int | None = None, start: str = ">") -> None:
        """Send a read without waiting for its reply (:meth:`finish_read` takes it). The command is
        packed once per (count, block, start): a worker sends the same few reads all day."""
        if self._sent:  # a reply never taken (its caller failed): the connection is out of step
            self.close()
        key = (self.entries_for(count), block_ms, start)
        packed = self._packed.get(key)
        if packed is None:
            packed = pack_command([a if isinstance(a, bytes) else str(a).encode()
                                   for a in self._command(*key)])
            if len(self._packed) >= _PACKED_MAX:
                self._packed.clear()
            self._packed[key] = packed
        self._held.send(packed)
        self._sent = True

    def entries_for(self, count: int) -> int:
        """Stream entries to read for at most about ``count`` requests: fewer where batch entries came
        lately (a read of ``count`` batch entries of 64 would hand one worker 64 batches). Rounded down:
        a read past ``count`` would take entries that an idle peer, blocked on the same stream, would
        have run meanwhile (one at least, which the stage before keeps within this stage's batch)."""
        return count if self.per_entry == 1.0 else max(1, int(count / self.per_entry))

    def parse_reply(self, response: Any) -> list[Entry]:
        """The entries of an ``XREADGROUP`` reply of this reader's stream sent by another (a script's)."""
        return self._parse(response)

    def _parse(self, response: Any) -> list[Entry]:
        entries, read = _parse_counted(response)
        if read and (len(entries) != read or self.per_entry != 1.0):
            per_entry = 0.5 * self.per_entry + 0.5 * len(entries) / read
            self.per_entry = 1.0 if per_entry < 1.05 else per_entry  # single entries again: exactly 1
        return entries

    def finish_read(self) -> list[Entry]:
        self._sent = False
        try:
            return self._parse(self._held.read())
        except redis.ResponseError as exc:
            if unblocked(exc):  # CLIENT UNBLOCK ... ERROR from someone else: an empty read, no more
                return []
            raise

    def finish_within(self, timeout_s: float) -> list[Entry]:
        """The reply of the read sent, waiting at most ``timeout_s`` by the client's clock (Redis
        ends a BLOCK only every 1/hz): past it, the read is ended (``CLIENT UNBLOCK``) and its reply
        taken, nil or entries that won the race with the unblock."""
        try:
            reply = self._held.read_within(max(0.0, timeout_s))
        except redis.ResponseError as exc:
            self._sent = False
            if unblocked(exc):
                return []
            raise
        if reply is TIMED_OUT:
            self.unblock()
            return self.finish_read()
        self._sent = False
        return self._parse(reply)

    def read_until(self, count: int, timeout_s: float) -> list[Entry]:
        """New entries, waiting at most ``timeout_s`` by the client's clock."""
        self.send_read(count, max(1, math.ceil(timeout_s * 1000)))
        return self.finish_within(timeout_s)

    @sends(WORKER, uses={"client|unblock": ()}, why="ends its own blocked read at the batch window's end")
    def unblock(self) -> None:
        """End this reader's blocked read (sent, reply not yet taken). Sent from another connection,
        it may reach the server before the read does (it then answers 0): tried again, briefly. On a
        Redis Cluster a node that does not answer fails it within ``CONTROL_TIMEOUT_S`` (the caller sets
        the lane aside): the reads on other nodes go on."""
        for _ in range(_UNBLOCK_TRIES):
            if self._held.control("CLIENT", "UNBLOCK", self._client_id) or self._held.ready(0.005):
                return

    def finish_waiting(self) -> list[Entry]:
        """Take the reply of a blocking read sent earlier, ending it first if it is still blocked."""
        if not self._held.ready(0):
            self.unblock()
        return self.finish_read()

    def fileno(self) -> int:
        return self._held.fileno()


def unblocked(exc: redis.ResponseError) -> bool:
    """A read ended by ``CLIENT UNBLOCK <id> ERROR``: the connection is in step, nothing was read."""
    return str(exc).startswith("UNBLOCKED")


ReadOutcome = list[Entry] | Exception  # a reader's entries, or what went wrong with it


def read_any(readers: Sequence[StreamReader], count: int, timeout_s: float) -> list[ReadOutcome]:
    """Block on every reader's stream at once and return, for each reader, its new entries (or
    the error it met) as soon as one has entries, or after ``timeout_s``. Every reply is read:
    entries that won the race on another stream are returned too (they are this consumer's now)."""
    block_ms = max(1, math.ceil(timeout_s * 1000))
    if len(readers) == 1:  # one lane (every pipeline of one partition): no fan-out to set up
        return [_read_one(readers[0], count, block_ms)]
    outcomes: list[ReadOutcome] = [[] for _ in readers]
    sent: list[int] = []
    for i, reader in enumerate(readers):
        try:
            reader.send_read(count, block_ms)
            sent.append(i)
        except Exception as exc:  # the caller tells a lost node from a bug
            reader.close()
            outcomes[i] = exc
    if sent:
        fds = {readers[i].fileno(): i for i in sent}
        readable, _, _ = select.select(list(fds), [], [], timeout_s)
        answered = {fds[fd] for fd in readable}
        for i in sent:
            outcomes[i] = _finish(readers[i], i in answered)
    return outcomes


def _read_one(reader: StreamReader, count: int, block_ms: int) -> ReadOutcome:
    """One lane: Redis's own BLOCK ends the wait, and the reply is read as it comes (one poll and
    one recv). A client-side deadline would cost a ``select``, or two ``ioctl`` to set and restore
    the socket's timeout, on every read: at 1 in flight a read per request at every stage. What
    it would buy is an idle wait ended on time rather than up to 1/hz (~100 ms) late; the idle
    wait is not a deadline (stats, heartbeat and the stop flag are looked at after it)."""
    try:
        reader.send_read(count, block_ms)
        return reader.finish_read()
    except Exception as exc:  # the caller tells a lost node from a bug
        reader.close()
        return exc


def _finish(reader: StreamReader, answered: bool) -> ReadOutcome:
    """Its reply: at once when its socket had bytes (the reply is under way: no readiness check,
    which costs a poll, a recv and redis-py's overhead on every read of an idle worker), else after
    ending the read if it is still blocked."""
    try:
        return reader.finish_read() if answered else reader.finish_waiting()
    except Exception as exc:  # the caller tells a lost node from a bug
        reader.close()
        return exc
