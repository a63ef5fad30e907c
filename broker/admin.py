"""What an administrator's connection does for ``conveyor acl``: read the server's version, and load
users (``ACL SETUSER``) on every node. Not an operation of a conveyor role: it runs with the
administrator's credentials given in the URL."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from broker.connection import RedisSettings, is_cluster_client
from broker.server_info import parse_version

__all__ = ["server_version", "set_users"]


def server_version(url: str, timeout_s: float = 5.0) -> tuple[int, int, int]:
    """The Redis version at ``url`` (on a cluster, the lowest of its nodes': the rules must load on each)."""
    client = RedisSettings(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s).sync_client()
    try:
        if is_cluster_client(client):
            infos = client.info("server", target_nodes="all")
            versions = [parse_version(str(info["redis_version"])) for info in infos.values()]
            return min(versions)
        return parse_version(str(client.info("server")["redis_version"]))
    finally:
        client.close()


def set_users(url: str, users: Sequence[tuple[str, Sequence[str]]], timeout_s: float = 5.0) -> int:
    """``ACL SETUSER name *rules`` for each user, on every node of a cluster; the nodes reached."""
    client = RedisSettings(url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s).sync_client()
    try:
        nodes: list[redis.Redis] = ([node.redis_connection for node in client.get_nodes()  # type: ignore[attr-defined]
                                     if node.redis_connection is not None]
                                    if is_cluster_client(client) else [client])
        for node in nodes:
            pipe = node.pipeline(transaction=False)
            for name, rules in users:
                pipe.execute_command("ACL", "SETUSER", name, *rules)
            pipe.execute()
        return len(nodes)
    finally:
        client.close()
