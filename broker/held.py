"""One Redis connection held across calls, outside redis-py's pool: the one place that does it.

Why hold one: a worker's commits and stream reads, a gateway's submit turns and reply pops each
go out one at a time from one caller, and redis-py's checkout per command (a lock, a readiness
check, event hooks, then the same on release) cost more than packing the command. Why outside the
pool: a connection checked out of it for good would take one of its ``max_connections`` from the
commands sent through the client (a gateway's reply client has one), and ``pool.make_connection()``
never gives its slot back, so a holder that reconnects often would exhaust the pool. A held
connection is made as the pool makes its own, from its public ``connection_class`` and
``connection_kwargs``, and used through the connection's public methods (but for the socket's
descriptor: :meth:`HeldConnection.fileno`).

The same rules for every holder:

- it connects lazily; on a Redis Cluster, to the node that serves ``key`` (looked up again after
  a failure: a failover or a slot move), once that node has answered a control call (bounded by
  ``CONTROL_TIMEOUT_S``: a node that hangs fails the connect fast, rather than after the socket
  timeout of the handshake);
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
import weakref
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis

from broker.connection import CONTROL_TIMEOUT_S, control_client, is_cluster_client, node_client, refresh_slots
from broker.operations import WORKER, sends

# A held connection idle longer than this is checked before it carries a command.
IDLE_CHECK_S = 1.0
TIMED_OUT = object()  # read_within: no reply yet
# The Cluster nodes (their clients) that left a control call unanswered, and when (HeldConnection.control).
_unanswered: weakref.WeakKeyDictionary[redis.Redis, float] = weakref.WeakKeyDictionary()

Keep = Callable[[redis.ResponseError], bool]  # an error reply that leaves the connection in use


def _never(exc: redis.ResponseError) -> bool:
    return False


def _new_connection(client: Any) -> Any:
    """A connection of ``client``'s server, made as its pool makes one, but not counted by it."""
    pool = client.connection_pool
    return pool.connection_class(**pool.connection_kwargs)


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

    def control(self, *args: Any) -> Any:
        """One command on the server (node) this connection talks to, not on this connection (``CLIENT
        UNBLOCK`` of a read blocked here). On a Redis Cluster it is bounded by ``CONTROL_TIMEOUT_S``
        (:func:`broker.connection.control_client`), and fails at once on a node that left one unanswered
        less than ``CONTROL_TIMEOUT_S`` ago (the holders of its other partitions and levels wait no more):
        a node that hangs holds its caller that long, not the socket timeout, and the caller's partitions
        on other nodes go on. On one Redis, the client itself: every partition is on that server."""
        if self._cluster is None or self._key is None:
            return self._client.execute_command(*args)
        node = self._client
        since = time.monotonic() - _unanswered.get(node, -math.inf)
        if since < CONTROL_TIMEOUT_S:
            raise redis.TimeoutError(f"the node left a control call unanswered {since:.1f}s ago")
        try:
            reply = control_client(node).execute_command(*args)
        except redis.TimeoutError:
            _unanswered[node] = time.monotonic()
            raise
        _unanswered.pop(node, None)
        return reply

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
                    refresh_slots(self._cluster, self._key)  # the node that failed asked last
                self._client = node_client(self._cluster, self._key)
                try:
                    self._check_node()
                except BaseException:
                    self._stale = True
                    raise
            conn = _new_connection(self._client)
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

    @sends(WORKER, uses={"client|id": ()}, why="on a Redis Cluster, before a held connection connects (bounded)")
    def _check_node(self) -> None:
        """The node answers a control call before this connection connects to it: redis-py's handshake
        (``HELLO``), then ``on_connect``'s command, would each wait the socket timeout on a node that hangs."""
        self.control("CLIENT", "ID")

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
        """The socket's descriptor, for a ``select`` over several held connections (connected only).

        redis-py has no public way to the socket of a synchronous connection, and its readiness
        check (a ``poll`` of one socket, a millisecond at the finest) cannot wait on several at once:
        a reply on one would wait for the poll of another to end. So this reads the connection's
        private socket attribute, here only."""
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
        return not conn.is_connected or bool(conn.can_read(timeout=0))
    except (redis.exceptions.ConnectionError, OSError):
        return True


class AsyncHeldConnection:
    """The asyncio twin (gateway side), of a plain (non-cluster) client: a cluster client routes
    each command itself.

    A call goes through the connection's ``send_packed_command`` and ``read_response``. redis-py
    bounds each write of a connection that has a socket timeout by a task of its own under
    ``wait_for``, and each read by a timeout of its own (on Python 3.11 a ``getpid`` syscall and a
    timer each): a few event-loop hops per call, where a gateway makes two calls per turn. So a held
    connection has no socket timeout of its own; the whole call is bounded instead by the client's
    ``socket_timeout`` through one lazily re-armed timer per connection (`_Watchdog`), which
    cancels a call that outlives it (the caller sees ``TimeoutError``, the connection is dropped)."""

    def __init__(self, client: aredis.Redis, keep: Keep = _never) -> None:
        self._client = client
        self._keep = keep
        self._conn: Any = None
        self._used_at = 0.0
        self._watchdog = _Watchdog()

    def _connection(self) -> Any:
        """The held connection: made at first use, connected by its first call."""
        conn = self._conn
        if conn is None:
            conn = self._conn = _new_connection(self._client)
            self._watchdog.arm(asyncio.get_running_loop(), conn.socket_timeout)
            conn.socket_timeout = None  # the watchdog bounds each call instead
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
        conn = self._connection()
        watchdog = self._watchdog
        task = asyncio.current_task()
        watchdog.start(task)
        replies: list[Any] = []
        try:
            if time.monotonic() - self._used_at > IDLE_CHECK_S:
                await _ensure(conn)
            await conn.send_packed_command(data, check_health=False)
            for _ in range(count):
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:  # read in full: the connection is in step
                    replies.append(exc)
        except BaseException as exc:
            timed_out = watchdog.stop() and watchdog.took_back(task, exc)
            await self.close()
            if timed_out:
                raise redis.TimeoutError(f"no reply within socket_timeout={watchdog.timeout_s}s") from exc
            raise
        watchdog.stop()
        self._used_at = time.monotonic()
        return replies

    async def close(self) -> None:
        self._watchdog.cancel()
        if self._conn is not None:
            await self._conn.disconnect()
        self._conn = None


class _Watchdog:
    """Bounds each call on one connection by ``timeout_s`` with one timer, re-armed lazily (as the
    HTTP front's connections do): starting a call reads the clock, stopping it is one assignment.
    A call that outlives it is cancelled; the caller takes that cancellation back (`took_back`)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.timeout_s: float | None = None  # None: calls are not bounded
        self._started = math.inf  # loop time the call under way began (inf: none)
        self._task: asyncio.Task[Any] | None = None  # the call's
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    def arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> None:
        """For the calls of a new connection: its loop and its socket timeout."""
        self._loop, self.timeout_s = loop, timeout_s

    def start(self, task: asyncio.Task[Any] | None) -> None:
        self._fired = False
        loop = self._loop
        if self.timeout_s is None or loop is None:
            return
        self._task = task
        self._started = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._started + self.timeout_s, self._check)

    def stop(self) -> bool:
        """The call is over; whether the watchdog cancelled it."""
        self._started = math.inf
        self._task = None
        return self._fired

    @staticmethod
    def took_back(task: asyncio.Task[Any] | None, exc: BaseException) -> bool:
        """Take back the cancellation the watchdog sent ``task``; whether ``exc`` was its doing alone
        (False when the task was cancelled from elsewhere too: that cancellation goes on)."""
        return task is not None and task.uncancel() == 0 and isinstance(exc, asyncio.CancelledError)

    def cancel(self) -> None:
        """No call under way and no timer left (the connection is closed)."""
        self.stop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        loop = self._loop
        if self._started == math.inf or self.timeout_s is None or loop is None:
            return  # idle: the next call arms it again
        due = self._started + self.timeout_s
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check)
        elif self._task is not None:
            self._fired = True
            self._task.cancel()


async def _ensure(conn: Any) -> None:
    """What the pool's checkout does, when it can matter: reconnect a connection the server closed."""
    try:
        await conn.connect()
        if await conn.can_read():
            raise redis.ConnectionError("connection has data")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        await conn.disconnect()
        await conn.connect()
