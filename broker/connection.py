"""Connection settings and client factories, shared by workers, gateway and CLI.

redis-py 8 defaults to a 5 s socket timeout, which would cut our longer blocking reads;
``socket_timeout_s`` here is always kept above the longest BLOCK we issue.

**Redis Cluster** is named by the URL scheme, ``redis+cluster://host:port[,host:port...]``
(``rediss+cluster://`` with TLS; user and password as in ``redis://``): the same one setting
(``--redis``, ``CONVEYOR_REDIS_URL``) reaches every process (gateway, supervisor, each worker
child, compose services) unchanged, so no process can be started with a flag the others lack,
and the choice is explicit rather than guessed from a first node's ``INFO`` (a plain client on
a cluster node would fail later with ``MOVED`` on some keys only). The hosts are seed nodes;
redis-py's :class:`redis.RedisCluster` (sync) and :class:`redis.asyncio.RedisCluster` discover
the rest and follow MOVED/ASK and failovers.

**Maintenance notifications** are off in every client made here. redis-py 8 (RESP3, its default) sends
``CLIENT MAINT_NOTIFICATIONS ON`` at each TCP connect unless told not to: a feature of Redis
Enterprise/Cloud that conveyor does not use (its reads, held connections and timeouts are its own), that
the ACL rules of ``conveyor acl`` do not grant, and that Redis 6.2 refuses as an ACL matter (in ACL LOG, on
every connection) before finding the subcommand unknown; a server that knows it would refuse it too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from broker.numbers import MAX_TIMEOUT_S, SettingsError, count_problem, number_problem

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_HELP = ("redis://[user:pw@]host:port/db, rediss:// (TLS), unix:///path.sock, or "
                  "redis+cluster://host:port[,host:port...] for a Redis Cluster.")
LONGEST_BLOCK_S = 2.0  # no XREADGROUP/BLPOP of ours blocks longer than this
# The longest a worker's control call to one Redis Cluster node waits, to connect and for its reply: ``CLIENT
# UNBLOCK``, the check before a held connection connects, a heartbeat's round trip (:func:`control_client`). A
# node that hangs (SIGSTOP, a network dropping packets: it accepts connections and never answers) would hold
# each for the socket timeout, and with it the worker's other partitions, on other nodes.
CONTROL_TIMEOUT_S = 1.0


class RedisURLError(ValueError):
    """A Redis URL no client can be made of, or that redis-py would read otherwise than written: the message
    says what is wrong (commands report it as a bad ``--redis``)."""


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is and how to talk to it. AUTH/ACL users and TLS come from the URL
    (``redis://user:pass@host:6379/0``, ``rediss://...``, ``unix:///path/redis.sock``)."""

    url: str
    socket_timeout_s: float = LONGEST_BLOCK_S + 8.0
    connect_timeout_s: float = 5.0
    max_connections: int = 16

    def __post_init__(self) -> None:
        """The URL, and the numbers redis-py would take and fail on later (SettingsError naming the field): a NaN
        or past-the-clock timeout (1e10 s) raised at every connect, from each worker's loop; 0 made the sockets
        non-blocking; ``max_connections`` 0 meant redis-py's default (2**31), not a bound. The timeouts' week is
        conveyor's longest request deadline: no call of ours waits longer."""
        check_redis_url(self.url)
        problems = {name: number_problem(getattr(self, name), 0, MAX_TIMEOUT_S, low_open=True)
                    for name in ("socket_timeout_s", "connect_timeout_s")}
        problems["max_connections"] = count_problem(self.max_connections)
        for name, problem in problems.items():
            if problem is not None:
                raise SettingsError(f"RedisSettings.{name} {problem}")

    @property
    def is_cluster(self) -> bool:
        return urlsplit(self.url).scheme in CLUSTER_SCHEMES

    def sync_client(self, *, retries: bool = True) -> redis.Redis:
        """A client of the server or, for a cluster URL, of the whole cluster.

        Typed as :class:`redis.Redis`: :class:`redis.RedisCluster` offers the same command and
        pipeline methods; code that needs one node's connection asks :func:`node_client`.

        ``retries=False``: the client never sends a command again by itself after a lost connection;
        the failure surfaces instead. A worker's client: a commit whose reply was lost would run
        twice (forwarding its items twice), while re-reading the consumer's pending entries tells
        exactly what was committed and what was not."""
        client = self._sync_client()
        if not retries:
            client.set_retry(Retry(NoBackoff(), 0))
        return client

    def _sync_client(self) -> redis.Redis:
        if self.is_cluster:
            url, seeds = _cluster_url(self.url)
            return cast(redis.Redis, scluster.RedisCluster.from_url(
                url, startup_nodes=[scluster.ClusterNode(h, p) for h, p in seeds],
                socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
                max_connections=self.max_connections, health_check_interval=0,
                **no_maint_notifications(scluster.RedisCluster),
            ))
        return redis.Redis.from_url(
            self.url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
            max_connections=self.max_connections, health_check_interval=0, **no_maint_notifications(redis.Redis),
        )

    def async_client(self, max_connections: int | None = None) -> aredis.Redis:
        """Asyncio twin of :meth:`sync_client` (``max_connections`` is per node on a cluster)."""
        if self.is_cluster:
            url, seeds = _cluster_url(self.url)
            return cast(aredis.Redis, acluster.RedisCluster.from_url(
                url, startup_nodes=[acluster.ClusterNode(h, p) for h, p in seeds],
                socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
                max_connections=max_connections or self.max_connections, health_check_interval=0,
                **no_maint_notifications(acluster.RedisCluster),
            ))
        return aredis.Redis.from_url(
            self.url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
            max_connections=max_connections or self.max_connections, health_check_interval=0,
            **no_maint_notifications(aredis.Redis),
        )


def no_maint_notifications(client_class: type) -> dict[str, Any]:
    """The keyword that turns redis-py's maintenance notifications off for ``client_class`` (module
    docstring); none where the class does not take it (redis-py 8.0's asyncio clients, which never send
    them). Connections a pool makes, and held connections made from its ``connection_kwargs``
    (broker/held.py), follow their pool; a cluster's node clients follow the cluster client."""
    if not _takes_maint_config(client_class):
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


@functools.cache
def _takes_maint_config(client_class: type) -> bool:
    return "maint_notifications_config" in inspect.signature(client_class).parameters


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)


def check_redis_url(url: str) -> None:
    """Raise `RedisURLError` for a URL that made a traceback deep in redis-py (``redis://h:abc``, an unknown
    scheme, ``?db=x``) or was read otherwise than written: ``redis://h/abc`` was database 0, ``/0/1`` database
    1, ``/-1`` an error at each command, a cluster URL's ``/2`` dropped (a cluster has database 0 only)."""
    try:
        parts = urlsplit(url)
        port = None if parts.scheme in CLUSTER_SCHEMES else parts.port
    except ValueError as exc:  # "Port could not be cast to integer value as 'abc'", "Invalid IPv6 URL", ...
        raise RedisURLError(f"Redis URL {_shown(url)}: {exc} (write {REDIS_URL_HELP})") from None
    if parts.scheme not in _SCHEMES:
        raise RedisURLError(f"Redis URL {_shown(url)}: unknown scheme {parts.scheme!r}; write {REDIS_URL_HELP}")
    db = parts.path.strip("/") if parts.scheme != "unix" else ""
    dbs = [db, *(v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "db")]
    if any(d and not _DIGITS.fullmatch(d) for d in dbs):
        raise RedisURLError(f"Redis URL {_shown(url)}: the database must be a number (redis://host:{port or 6379}/0),"
                            f" got {next(d for d in dbs if d and not _DIGITS.fullmatch(d))!r}")
    if parts.scheme in CLUSTER_SCHEMES:
        if any(d not in ("", "0") for d in dbs):
            raise RedisURLError(f"Redis URL {_shown(url)}: a Redis Cluster has database 0 only (no /N path)")
        _cluster_url(url)
    elif parts.scheme == "unix" and not parts.path:
        raise RedisURLError(f"Redis URL {_shown(url)}: no socket path (unix:///path/to/redis.sock)")


_DIGITS = re.compile(r"[0-9]+")


def _shown(url: str) -> str:
    """``url`` for a message, its password hidden even where it does not parse."""
    try:
        return safe_url(url)
    except ValueError:
        return re.sub(r"//[^@/]*@", "//***@", url)


def _cluster_url(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis+cluster://u:p@h1:7000,h2:7001`` -> (``redis://u:p@h1:7000``, [(h1, 7000), (h2, 7001)])."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":")
        if not name or not _DIGITS.fullmatch(port) or int(port) > 65535:
            raise RedisURLError(f"Redis URL {_shown(url)}: every seed of a cluster must be host:port (a port from "
                                f"0 to 65535), got {host!r}")
        seeds.append((name.strip("[]"), int(port)))
    first = f"{userinfo}@{hosts.split(',')[0]}" if userinfo else hosts.split(",")[0]
    return urlunsplit((CLUSTER_SCHEMES[parts.scheme], first, "", parts.query, "")), seeds


def is_cluster_client(client: Any) -> bool:
    return isinstance(client, scluster.RedisCluster | acluster.RedisCluster)


def node_client(client: redis.Redis, key: str | bytes) -> redis.Redis:
    """The client of the one node that serves ``key``: the client itself unless on a cluster.

    For what redis-py cannot route: a connection of our own (the batching reader's), and
    ``CLIENT UNBLOCK``, which must reach the node where that connection blocks."""
    if isinstance(client, scluster.RedisCluster):
        node = client.get_node_from_key(key)
        if node.redis_connection is None:
            client.nodes_manager.initialize()
            node = client.get_node_from_key(key)
        return cast(redis.Redis, node.redis_connection)
    return client


def refresh_slots(client: redis.Redis, failed_key: str | bytes | None = None) -> None:
    """After MOVED or a lost node on a connection of our own, re-read the slot map; the node that served
    ``failed_key`` is asked last (one that hangs would hold the refresh for the socket timeout)."""
    if isinstance(client, scluster.RedisCluster):
        failed = None
        if failed_key is not None:
            with contextlib.suppress(redis.exceptions.RedisClusterException):  # its slot not in the map
                failed = client.get_node_from_key(failed_key).name
        client.nodes_manager.initialize(last_failed_node_name=failed)


def async_node_client(cluster: Any, name: str) -> aredis.Redis | None:
    """A plain asyncio client of the node ``name`` (``host:port``) of the asyncio Redis Cluster client ``cluster``'s
    slot map, made as ``cluster`` connects to it (credentials, TLS, timeouts): one connection, no command sent again
    by itself; None where the map has no such node. For reads that must fail apart per node: redis-py's cluster
    client meets one node's lost connection by closing every connection it holds to re-read the slot map, the
    connections of its reads under way on the other nodes too. Its owner closes it (``aclose``)."""
    node = cluster.get_node(node_name=name)
    if node is None:
        return None
    kwargs = dict(node.connection_kwargs)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    pool = aredis.ConnectionPool(connection_class=node.connection_class, max_connections=1, **kwargs)
    return aredis.Redis.from_pool(pool)


async def refresh_slots_async(client: Any, failed_node: str | None = None) -> None:
    """:func:`refresh_slots` of an asyncio cluster client (nothing elsewhere): the node named ``failed_node`` is
    asked last. Raises ``RedisClusterException`` when no node answers."""
    if isinstance(client, acluster.RedisCluster):
        await client.nodes_manager.initialize(last_failed_node_name=failed_node)


_controls: weakref.WeakKeyDictionary[redis.Redis, redis.Redis] = weakref.WeakKeyDictionary()
_controls_lock = threading.Lock()


def control_client(client: redis.Redis) -> redis.Redis:
    """A client of the server ``client`` talks to (a Redis Cluster node's client: :func:`node_client`) whose
    calls are bounded by ``CONTROL_TIMEOUT_S``, to connect and for each reply, and never sent again: a node
    that hangs fails them fast. One per ``client``, made as its pool makes connections (from its public
    ``connection_class`` and ``connection_kwargs``), shared by the threads and holders of a process."""
    with _controls_lock:
        control = _controls.get(client)
        if control is None:
            pool = client.connection_pool
            kwargs = dict(pool.connection_kwargs)
            for name in ("socket_timeout", "socket_connect_timeout"):
                kwargs[name] = min(CONTROL_TIMEOUT_S, kwargs.get(name) or CONTROL_TIMEOUT_S)
            kwargs["retry"] = Retry(NoBackoff(), 0)
            control = _controls[client] = redis.Redis(
                connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))
        return control


class Backoff:
    """Exponential backoff with full jitter, so a fleet reconnecting after a Redis restart
    does not stampede it in lockstep."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 5.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._attempt = 0

    def next_delay_s(self) -> float:
        delay = min(self.cap_s, self.base_s * (2 ** self._attempt))
        self._attempt = min(self._attempt + 1, 30)
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._attempt = 0


# A cluster client raises ClusterError when its retries over a failover ran out, and
# SlotNotCoveredError while no live node serves a slot: both mean "the server is not there now".
# InvalidResponse: what answers at the URL does not speak Redis's protocol (a wrong port: an HTTP
# server, say); redis-py drops that connection, and the server is not there either.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError,
    redis.exceptions.ClusterError, redis.exceptions.SlotNotCoveredError, redis.exceptions.InvalidResponse,
)
CONNECTION_OR_REPLY_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, redis.ResponseError)


# Error replies that say "Redis cannot take this write right now" rather than "this command is wrong":
# out of memory, a read-only replica after a failover, a failing disk (MISCONF), a busy script,
# a loading dataset. Callers back off and retry them like a dropped connection.
# On a cluster also MOVED/ASK seen on a connection of our own (a slot moved or failed over) and
# CLUSTERDOWN (a master lost, its replica not yet promoted).
TRANSIENT_REPLY_CODES = ("OOM", "READONLY", "MISCONF", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")
# One of them as a word (a script's error quotes the reply's code after its own): BUSYGROUP is not BUSY.
_TRANSIENT_CODE = re.compile(r"\b(?:" + "|".join(TRANSIENT_REPLY_CODES) + r")\b")
_TRANSIENT_CLASSES = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                      redis.exceptions.AskError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)


def is_transient(exc: redis.ResponseError) -> bool:
    if isinstance(exc, _TRANSIENT_CLASSES):
        return True
    return _TRANSIENT_CODE.search(str(exc)) is not None


def is_transient_reply(exc: BaseException) -> bool:
    """An error reply that says "not now" (:func:`is_transient`); False for any other exception."""
    return isinstance(exc, redis.ResponseError) and is_transient(exc)


def is_absent(exc: BaseException) -> bool:
    """The error reply of a command on a stream or consumer group that is not there (yet, or any more)."""
    return isinstance(exc, redis.ResponseError) and ("NOGROUP" in str(exc) or "no such key" in str(exc))


def is_nogroup(exc: BaseException) -> bool:
    """The error reply of a command on a consumer group that is not there (Redis restarted empty)."""
    return isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)


def is_refusal(exc: redis.ResponseError) -> bool:
    """A refusal that will not go away (an ACL, a renamed command), unlike BUSY, OOM or LOADING."""
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.NoPermissionError) or "no permissions" in text or "unknown" in text


def safe_url(url: str) -> str:
    """The URL without its password (in the user part or a ``password=`` query), for messages."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    hidden_query = any(k == "password" for k, _ in query)
    if parts.password is None and not hidden_query:
        return url  # as given (urlunsplit would turn unix:///path into unix:/path)
    if parts.password is not None:
        userinfo, _, hosts = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}")
    if hidden_query:
        parts = parts._replace(query=urlencode([(k, "***" if k == "password" else v) for k, v in query], safe="*/"))
    text = urlunsplit(parts)
    return text.replace(":/", ":///", 1) if url.startswith(f"{parts.scheme}:///") and not parts.netloc else text


def error_text(exc: BaseException) -> str:
    """An error as conveyor's log lines say it: its type and its message. redis-py 8's exceptions write
    their category and type alone as ``repr`` (``network:ConnectionError``), without the message that tells
    a refused connection from a timeout, WRONGPASS from NOPERM, or BUSY from READONLY."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# What Redis says to a client without the right password or user (as a status's text carries it too).
_AUTH_REFUSALS = ("NOAUTH", "WRONGPASS", "HELLO must be called with the client already authenticated",
                  "invalid username-password pair")


def _has_credentials(url: str) -> bool:
    """Whether ``url`` gives a user or a password (in its user part or a ``password=`` query)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    return bool(parts.username or parts.password or query.get("username") or query.get("password"))


def unreachable(url: str, exc: BaseException) -> str:
    """One line for a Redis that cannot be reached, or that refused our credentials: where, why, and
    what to check."""
    text = str(exc)
    if isinstance(exc, redis.AuthenticationError) or any(m in text for m in _AUTH_REFUSALS):  # reached, refused
        if _has_credentials(url):
            return (f"Redis at {safe_url(url)} refused the connection's credentials ({exc}): the user is unknown "
                    "there or off, or its password differs. Users loaded with `conveyor acl --apply` (ACL SETUSER) "
                    "live in the server's memory: a Redis restarted without them in its aclfile lost them; load "
                    "them again (docs/security.md, \"When Redis restarts\")")
        return (f"Redis at {safe_url(url)} refused the connection's credentials ({exc}): give its password "
                "in the URL, redis://:PASSWORD@host:port or redis://USER:PASSWORD@host:port (--redis or "
                "CONVEYOR_REDIS_URL)")
    if is_transient_reply(exc) or text.split(" ", 1)[0] in TRANSIENT_REPLY_CODES:  # reached, not serving now
        return f"Redis at {safe_url(url)} answers but cannot serve now ({exc})"
    return (f"cannot reach Redis at {safe_url(url)} ({exc}): is the server running, and is the URL right "
            "(--redis or CONVEYOR_REDIS_URL)?")
