"""Batch assembly, on top of ``XREADGROUP COUNT/BLOCK``, under a wait policy.

Two policies (``Stage.batch_policy``): ``"adaptive"`` (:mod:`workers.batching.adaptive`, the default)
dispatches as soon as waiting can no longer pay, ``batch_wait_s`` being only its upper bound;
``"deadline"`` (:class:`FixedWait`) always waits for ``batch_size`` items or the deadline.

Redis only checks BLOCK timeouts every 1/hz (about 100 ms by default), so a batch window of
a few milliseconds cannot be left to BLOCK: the reader sends a blocking XREADGROUP, waits on
its socket for exactly the time left, and if nothing came it ends the read with
``CLIENT UNBLOCK`` from another connection. New items still wake it at once, because a
blocked XREADGROUP returns as soon as an entry arrives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from broker.keys import GROUP
from workers.batching.handoff import is_refusal

Entry = tuple[bytes, dict[bytes, bytes] | None]

EARLY_WAKES_MAX = 4  # a batch window cut short by peers' CLIENT UNBLOCK is resumed at most this often
EARLY_WAKE_MIN_S = 0.001  # ... and only with at least this much of it left


class WaitPolicy(Protocol):
    """How long to keep filling a batch once its first item is in hand. Asked again after every
    read: ``idle_s`` is how long the first read waited, ``waited_s`` the time since it returned."""

    def wait_s(self, idle_s: float, have: int, batch_size: int, waited_s: float) -> float: ...

    def observe_read(self, count: int, now: float) -> None: ...


@dataclass(frozen=True)
class FixedWait:
    """The ``deadline`` policy, seed 000's rule: wait up to ``batch_wait_s`` from the batch's
    first item, except after a long idle (the first item took longer than ``batch_wait_s`` to
    come), when the worker takes what is already queued and goes."""

    batch_wait_s: float

    def wait_s(self, idle_s: float, have: int, batch_size: int, waited_s: float) -> float:
        if have >= batch_size or idle_s >= self.batch_wait_s:
            return 0.0
        return self.batch_wait_s - waited_s

    def observe_read(self, count: int, now: float) -> None:
        """The deadline policy does not learn."""


def _parse(response: Any) -> list[Entry]:
    if not response:
        return []
    # RESP3 (redis-py 8's default) answers a map of streams, RESP2 an array of pairs.
    streams = response.items() if isinstance(response, dict) else response
    entries: list[Entry] = []
    for _stream, items in streams:
        for entry_id, fields in items:
            if fields is None:
                entries.append((entry_id, None))
            else:
                if len(fields) % 2:
                    raise ValueError(f"stream entry {entry_id!r} with an odd number of field items")
                it = iter(fields)
                entries.append((entry_id, dict(zip(it, it, strict=False))))  # an even count, checked above
    return entries


def _server_run_id(conn: Any) -> str | None:
    """The server's run id (``INFO server``), which changes when Redis restarts; None if refused."""
    conn.send_command("INFO", "server")
    try:
        info = conn.read_response()
    except redis.ResponseError:
        return None
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:"):].strip()
    return None


class StreamReader:
    """Reads one stage stream as one consumer, on a connection of its own."""

    def __init__(self, client: redis.Redis, stream: str, consumer: str) -> None:
        self._client = client
        self._stream = stream
        self._consumer = consumer
        self._conn: Any = None
        self._client_id: int | None = None
        self._run_id: str | None = None
        self._pending: int | None = None  # a read sent ahead (send_read): its CLIENT UNBLOCKs before it
        self.sent_count = 0  # COUNT of the last read sent
        self.sent_at = 0.0  # and when (monotonic): a read sent ahead waits from then
        self.unblock_refused: str | None = None
        self.idle_peers = 0  # peers whose blocked read the last read's CLIENT UNBLOCKs ended (idle then)

    def _connection(self) -> Any:
        if self._conn is None:
            # A connection of our own, outside the pool: pool.make_connection() counts every call
            # against max_connections and never gives it back, so after that many reconnects
            # (dropped connections, Redis restarts) the worker could never read again.
            pool = self._client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            try:
                conn.send_command("CLIENT", "ID")
                self._client_id = int(conn.read_response())
                self._run_id = _server_run_id(conn)
            except BaseException:
                conn.disconnect()
                raise
            self._conn = conn  # only once its id is known: CLIENT UNBLOCK needs it
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
        self._conn = None
        self._client_id = None
        self._run_id = None
        self._pending = None

    def _command(self, count: int, block_ms: int | None, start: str) -> list[Any]:
        cmd: list[Any] = ["XREADGROUP", "GROUP", GROUP, self._consumer, "COUNT", count]
        if block_ms is not None:
            cmd += ["BLOCK", block_ms]
        return [*cmd, "STREAMS", self._stream, start]

    @property
    def run_id(self) -> str | None:
        """The run id of the server the reading connection is on (None until connected)."""
        return self._run_id

    @property
    def client_id(self) -> int | None:
        """The reading connection's client id (None until connected): what a peer unblocks."""
        return self._client_id

    @property
    def identity(self) -> str | None:
        """``<server run id>:<client id>`` of the reading connection, or None (not connected, or
        the server's run id unknown). Client ids start again from 1 when Redis restarts: a peer
        only unblocks ids of the server it reads from itself (:mod:`workers.batching.handoff`)."""
        run_id, client_id = self._run_id, self._client_id
        return None if run_id is None or client_id is None else f"{run_id}:{client_id}"

    @property
    def read_pending(self) -> bool:
        """A read was sent ahead (:meth:`send_read`) and its reply is still to be taken."""
        return self._pending is not None

    def read(self, count: int, block_ms: int | None = None, start: str = ">",
             unblock: Sequence[int] = ()) -> list[Entry]:
        """Plain read: non-blocking, or blocking with Redis's own (coarse) timeout. ``unblock``:
        client ids to send ``CLIENT UNBLOCK`` first, in the same write (:mod:`workers.batching.handoff`);
        an error reply to one of them is kept in ``unblock_refused``, and the read goes on."""
        self.send_read(count, block_ms, start, unblock)
        return self.finish_read()

    def send_read(self, count: int, block_ms: int | None = None, start: str = ">",
                  unblock: Sequence[int] = ()) -> None:
        """Send a read (and the ``CLIENT UNBLOCK``s before it) without waiting for its reply:
        a worker queues itself on the stream before its commit makes anything visible that
        could bring the next entry (:mod:`workers.batching.handoff`). :meth:`finish_read` takes the reply.

        A read sent ahead whose reply was never taken (the commit after it failed) has its
        connection dropped here: whatever it took is pending for this consumer, which is what
        recovery reads next (``start="0"``)."""
        if self._pending is not None:
            self.close()
        conn = self._connection()
        try:
            read = self._command(count, block_ms, start)
            if unblock:
                conn.send_packed_command(conn.pack_commands([*(("CLIENT", "UNBLOCK", i) for i in unblock), read]))
            else:
                conn.send_command(*read)
        except BaseException:
            self.close()
            raise
        self._pending = len(unblock)
        self.sent_count, self.sent_at = count, time.monotonic()

    def finish_read(self) -> list[Entry]:
        """The entries of the read sent by :meth:`send_read` (waiting for them if it blocks)."""
        unblocks, conn = self._pending or 0, self._conn
        self._pending = None
        self.idle_peers = 0
        try:
            for _ in range(unblocks):
                try:
                    self.idle_peers += conn.read_response() == 1  # 1: it was blocked, so idle
                except redis.ResponseError as exc:  # an error reply: the connection is still in step
                    if is_refusal(exc):
                        self.unblock_refused = str(exc)
            return _parse(conn.read_response())
        except BaseException:
            self.close()
            raise

    def read_until(self, count: int, timeout_s: float) -> list[Entry]:
        """Blocking read that returns within ``timeout_s`` by the client's clock."""
        conn = self._connection()
        deadline = time.monotonic() + timeout_s
        try:
            for _ in range(EARLY_WAKES_MAX + 1):
                left_s = deadline - time.monotonic()
                conn.send_command(*self._command(count, max(1, math.ceil(left_s * 1000)), ">"))
                if not conn.can_read(timeout=max(0.0, left_s)):
                    # The reply to XREADGROUP is read either way: nil, or entries that won the race.
                    self._client.execute_command("CLIENT", "UNBLOCK", self._client_id)
                    return _parse(conn.read_response())
                entries = _parse(conn.read_response())
                if entries or deadline - time.monotonic() < EARLY_WAKE_MIN_S:
                    return entries
                # Nothing, well before the deadline: a peer's CLIENT UNBLOCK (workers.batching.handoff) put
                # itself ahead of this read, which waits on for the time it has left.
            return []
        except BaseException:
            self.close()
            raise


class BatchCollector:
    """Collects up to ``batch_size`` new entries, waiting as the policy allows."""

    def __init__(self, reader: StreamReader, batch_size: int, policy: WaitPolicy, idle_block_ms: int | None) -> None:
        """``idle_block_ms`` None: the first read does not block (a caller that waits elsewhere)."""
        self._reader = reader
        self._batch_size = batch_size
        self._policy = policy
        self._idle_block_ms = idle_block_ms
        self.first_wait_s = 0.0  # how long the last batch's first read waited for an entry
        self.asked = batch_size  # COUNT of the last batch's first read
        self._first_at = 0.0  # when that read returned (monotonic)

    def collect(self, count: int | None = None, idle_block_ms: int | None = None) -> list[Entry]:
        """Up to ``count`` (default ``batch_size``) entries: what is queued at once, then more
        for as long as the policy says waiting pays. Empty after ``idle_block_ms`` with nothing."""
        entries = self.first_read(count, idle_block_ms)
        return self.fill(entries) if entries else entries

    def first_read(self, count: int | None = None, idle_block_ms: int | None = None,
                   unblock: Sequence[int] = ()) -> list[Entry]:
        """The batch's first read: the reply of one sent ahead (read_ahead), or a new one, going
        ahead of the peers in ``unblock`` (workers.batching.handoff). Sets ``asked`` (its COUNT) and
        ``first_wait_s`` (how long it waited for an entry)."""
        if not self._reader.read_pending:
            self.read_ahead(count, idle_block_ms, unblock)
        self.asked, started = self._reader.sent_count, self._reader.sent_at
        entries = self._reader.finish_read()
        if entries:
            self._first_at = time.monotonic()
            self.first_wait_s = self._first_at - started
        return entries

    def fill(self, entries: list[Entry], wait: bool = True) -> list[Entry]:
        """More entries after the first read, up to ``asked``, while the policy says waiting pays
        (``wait`` false: none, the first read's entries only counted for the policy)."""
        first_at = self._first_at
        self._policy.observe_read(len(entries), first_at)
        while wait and len(entries) < self.asked:
            now = time.monotonic()
            wait_s = self._policy.wait_s(self.first_wait_s, len(entries), self.asked, now - first_at)
            if wait_s <= 0:
                break
            more = self._reader.read_until(self.asked - len(entries), wait_s)
            if not more:
                break
            self._policy.observe_read(len(more), time.monotonic())
            entries += more
        return entries

    def read_ahead(self, count: int | None, idle_block_ms: int | None, unblock: Sequence[int]) -> None:
        """Send the next batch's first read now; :meth:`first_read` takes its reply."""
        self._reader.send_read(count or self._batch_size, idle_block_ms or self._idle_block_ms, ">", unblock)
