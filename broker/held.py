"""One Redis connection held across calls, outside redis-py's pool: the one place that does it.

Why hold one: a worker's commits and stream reads, a gateway's submit turns and reply pops each
go out one at a time from one caller, and redis-py's checkout per command (a lock, a readiness
check, event hooks, then the same on release) cost more than packing the command. Why outside the
pool: ``pool.make_connection()`` counts against ``max_connections`` and never gives the slot back,
so a holder that reconnects often (Redis restarts, dropped connections) would exhaust the pool.

The same rules for every holder:

- it connects lazily; on a Redis Cluster, to the node that serves ``key`` (looked up again after
  a failure: a failover or a slot move);
- a connection idle for ``IDLE_CHECK_S`` is checked before it carries a command, and replaced if
  the server closed it (its ``timeout``, a restart, a proxy): nothing was sent, so that is safe;
- any failure while a command is under way drops the connection (its state is unknown), except
  the error replies the holder declares harmless (read in full, the connection is in step);
- it never retries: a command whose reply was lost may have run (a commit would forward twice).
  The caller decides what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis

from broker.connection import is_cluster_client, node_client, refresh_slots

# A held connection idle longer than this is checked before it carries a command.
IDLE_CHECK_S = 1.0
TIMED_OUT = object()  # read_within: no reply yet

Keep = Callable[[redis.ResponseError], bool]  # an error reply that leaves the connection in use


def _never(exc: redis.ResponseError) -> bool:
    return False


class HeldConnection:
    """A synchronous held connection (worker side). ``on_connect(conn)`` runs once per new
    connection, before its first command (the stream reader asks for its client id there)."""

    def __init__(self, client: redis.Redis, key: str | None = None,
                 on_connect: Callable[[Any], None] | None = None, keep: Keep = _never) -> None:
        self._cluster = client if is_cluster_client(client) else None
        self._key = key
        self._client = client if self._cluster is None or key is None else node_client(client, key)
        self._on_connect = on_connect
        self._keep = keep
        self._conn: Any = None
        self._stale = False  # the node of ``key`` must be looked up again
        self._used_at = 0.0

    @property
    def server(self) -> redis.Redis:
        """A client of the server (node) this connection talks to, for commands that must reach it
        but not on this connection (``CLIENT UNBLOCK`` of a read blocked here)."""
        return self._client

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def _connection(self) -> Any:
        conn = self._conn
        if conn is not None and time.monotonic() - self._used_at > IDLE_CHECK_S and _closed_by_server(conn):
            self.drop()
            conn = None
        if conn is None:
            if self._cluster is not None and self._key is not None:
                if self._stale:
                    refresh_slots(self._cluster)
                self._client = node_client(self._cluster, self._key)
            pool = self._client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            try:
                if self._on_connect is not None:
                    self._on_connect(conn)
                    self._used_at = time.monotonic()
            except BaseException:
                conn.disconnect()
                self._stale = True
                raise
            self._conn, self._stale = conn, False
        return conn

    def send(self, packed: bytes) -> None:
        """Send an already packed command (or several); the replies are read with :meth:`read`."""
        conn = self._connection()
        try:
            conn.send_packed_command([packed], check_health=False)  # a list: the sync client iterates it
        except BaseException:
            self.drop()
            raise

    def send_command(self, *args: Any) -> None:
        conn = self._connection()
        try:
            conn.send_command(*args, check_health=False)
        except BaseException:
            self.drop()
            raise

    def _sent_on(self) -> Any:
        if self._conn is None:
            raise redis.ConnectionError("nothing was sent on this held connection (dropped since)")
        return self._conn

    def read(self) -> Any:
        """The next reply; waits for it (up to the socket timeout)."""
        return self._read(None)

    def read_within(self, timeout_s: float) -> Any:
        """The next reply if it comes within ``timeout_s``, else `TIMED_OUT` with the connection kept
        in step (the reply is still to come). One poll and one recv when it comes: a ``select``
        first, or redis-py's readiness check, would cost a syscall or two more per read."""
        return self._read(timeout_s)

    def _read(self, timeout_s: float | None) -> Any:
        conn = self._sent_on()
        try:
            if timeout_s is None:
                reply = conn.read_response()
            else:
                reply = conn.read_response(timeout=timeout_s, disconnect_on_error=False)
        except redis.TimeoutError:
            if timeout_s is None:
                self.drop()
                raise
            return TIMED_OUT
        except redis.ResponseError as exc:
            if not self._keep(exc):
                self.drop()
            raise
        except BaseException:
            self.drop()
            raise
        self._used_at = time.monotonic()
        return reply

    def call(self, packed: bytes) -> Any:
        """One round trip: send ``packed``, return its reply."""
        self.send(packed)
        return self.read()

    def ready(self, timeout_s: float) -> bool:
        """Whether a reply can be read within ``timeout_s`` (0: now)."""
        try:
            return bool(self._sent_on().can_read(timeout=timeout_s))
        except BaseException:
            self.drop()
            raise

    def fileno(self) -> int:
        """The socket's descriptor, for a ``select`` over several held connections (connected only)."""
        return int(self._sent_on()._sock.fileno())

    def drop(self) -> None:
        """Disconnect; the next command connects again (to the key's node as it is then)."""
        if self._conn is not None:
            self._conn.disconnect()
            self._stale = True
        self._conn = None

    close = drop


def _closed_by_server(conn: Any) -> bool:
    """Whether an idle connection has something to read (with nothing asked: EOF or an error from
    the server) or is already closed: it must not carry the next command."""
    try:
        return conn._sock is not None and bool(conn.can_read(timeout=0))
    except (redis.exceptions.ConnectionError, OSError):
        return True


class AsyncHeldConnection:
    """The asyncio twin (gateway side), of a plain (non-cluster) client: a cluster client routes
    each command itself."""

    def __init__(self, client: aredis.Redis, keep: Keep = _never) -> None:
        self._client = client
        self._keep = keep
        self._conn: Any = None
        self._used_at = 0.0

    async def _connection(self) -> Any:
        """The held connection: made at first use, checked after an idle spell."""
        conn = self._conn
        if conn is None:
            pool = self._client.connection_pool
            conn = self._conn = pool.connection_class(**pool.connection_kwargs)
        elif time.monotonic() - self._used_at > IDLE_CHECK_S:
            await _ensure(conn)
        return conn

    async def call(self, packed: bytes) -> Any:
        """One round trip: send ``packed`` (an already packed command), return its reply."""
        conn = await self._connection()
        try:
            await conn.send_packed_command(packed, check_health=False)
            reply = await conn.read_response()
        except redis.ResponseError as exc:  # an error reply, read in full
            if not self._keep(exc):
                await self.close()
            raise
        except BaseException:
            await self.close()
            raise
        self._used_at = time.monotonic()
        return reply

    async def call_many(self, packed: list[bytes]) -> list[Any]:
        """Several commands in one write, their replies in order: an error reply comes back as its
        exception object (one command's refusal does not hide the others' replies)."""
        conn = await self._connection()
        replies: list[Any] = []
        try:
            await conn.send_packed_command(b"".join(packed), check_health=False)
            for _ in packed:
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:  # read in full: the connection is in step
                    replies.append(exc)
        except BaseException:
            await self.close()
            raise
        if any(isinstance(r, redis.ResponseError) and not self._keep(r) for r in replies):
            await self.close()
        self._used_at = time.monotonic()
        return replies

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.disconnect()
        self._conn = None


async def _ensure(conn: Any) -> None:
    """What the pool's checkout does, when it can matter: reconnect a connection the server closed."""
    try:
        await conn.connect()
        if await conn.can_read():
            raise redis.ConnectionError("connection has data")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        await conn.disconnect()
        await conn.connect()
