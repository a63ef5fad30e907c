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

import asyncio
import math
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
    each command itself.

    A call goes straight onto the connection's stream and parser, not through redis-py's
    ``send_packed_command`` and ``read_response``: those run each write as a task of its own under
    ``wait_for`` and each read under a timeout of its own (on Python 3.11 a ``getpid`` syscall and a
    timer each), a few event-loop hops per call where a gateway makes two calls per turn. The whole
    call is bounded instead by the connection's ``socket_timeout`` through one lazily re-armed timer
    per connection (`_Watchdog`), which aborts the connection when a call outlives it."""

    def __init__(self, client: aredis.Redis, keep: Keep = _never) -> None:
        self._client = client
        self._keep = keep
        self._conn: Any = None
        self._used_at = 0.0
        self._watchdog: _Watchdog | None = None

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
        reply = (await self._exchange(packed, 1))[0]
        if isinstance(reply, redis.ResponseError):  # an error reply, read in full
            if not self._keep(reply):
                await self.close()
            raise reply
        return reply

    async def call_many(self, packed: list[bytes]) -> list[Any]:
        """Several commands in one write, their replies in order: an error reply comes back as its
        exception object (one command's refusal does not hide the others' replies)."""
        replies = await self._exchange(b"".join(packed), len(packed))
        if any(isinstance(r, redis.ResponseError) and not self._keep(r) for r in replies):
            await self.close()
        return replies

    async def _exchange(self, data: bytes, count: int) -> list[Any]:
        """Write ``data`` (``count`` packed commands) and read their replies, error replies as
        their exception objects; any failure drops the connection."""
        conn = await self._connection()
        watchdog = self._watchdog
        if watchdog is None:
            watchdog = self._watchdog = _Watchdog(asyncio.get_running_loop(), conn.socket_timeout, self._abort)
        watchdog.start()
        try:
            if not conn.is_connected:
                await conn.connect_check_health(check_health=False)
            writer = conn._writer
            writer.write(data)
            await writer.drain()  # at once, unless the send buffer is over its high-water mark
            parser = conn._parser
            replies = [await parser.read_response() for _ in range(count)]
        except BaseException as exc:
            timed_out = watchdog.fired
            watchdog.stop()
            await self.close()
            if timed_out:
                raise redis.TimeoutError(f"no reply within socket_timeout={conn.socket_timeout}s") from exc
            raise
        watchdog.stop()
        self._used_at = time.monotonic()
        return replies

    def _abort(self) -> None:
        """The watchdog's: the call under way outlived the socket timeout; its read fails at once."""
        writer = getattr(self._conn, "_writer", None)
        if writer is not None:
            writer.transport.abort()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._conn is not None:
            await self._conn.disconnect()
        self._conn = None


class _Watchdog:
    """Bounds each call on one connection by ``timeout_s`` with one timer, re-armed lazily (as the
    HTTP front's connections do): starting a call reads the clock, stopping it is one assignment."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None,
                 on_timeout: Callable[[], None]) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._started = math.inf  # loop time the call under way began (inf: none)
        self._timer: asyncio.TimerHandle | None = None
        self.fired = False

    def start(self) -> None:
        self.fired = False
        if self._timeout_s is None:
            return
        self._started = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._started + self._timeout_s, self._check)

    def stop(self) -> None:
        self._started = math.inf

    def cancel(self) -> None:
        """No call under way and no timer left (the connection is closed)."""
        self._started = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._started == math.inf or self._timeout_s is None:
            return  # idle: the next call arms it again
        due = self._started + self._timeout_s
        if self._loop.time() >= due:
            self.fired = True
            self._on_timeout()
        else:
            self._timer = self._loop.call_at(due, self._check)


async def _ensure(conn: Any) -> None:
    """What the pool's checkout does, when it can matter: reconnect a connection the server closed."""
    try:
        await conn.connect()
        if await conn.can_read():
            raise redis.ConnectionError("connection has data")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        await conn.disconnect()
        await conn.connect()
