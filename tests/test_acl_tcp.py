"""conveyor's clients on the generated ACL users over TCP (the other ACL tests use the Unix socket, where
redis-py sends nothing at connect beyond HELLO and CLIENT SETINFO): no connection of any role's client is
refused anything, so ACL LOG stays empty, as docs/security.md promises.

What TCP adds: redis-py 8 sends ``CLIENT MAINT_NOTIFICATIONS ON`` at each TCP connect (RESP3) unless the client
says not to; the generated rules do not grant it, and Redis 6.2 checks the ACL before finding the subcommand
unknown: one refusal in ACL LOG per connection (broker/connection.py turns the notifications off).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.acl import ROLE_NAMES, Scope, role_rules
from broker.connection import RedisSettings
from broker.held import AsyncHeldConnection, HeldConnection
from broker.keys import Keys
from tests.acl_stages import AclServer, redis_binaries, start_acl_server
from tests.cluster import free_ports
from tests.ops_stages import free_port

pytestmark = pytest.mark.redis

STREAM = Keys("t-tcp").stream(0)  # a key every role may XLEN


def binary(version: str) -> str:
    found = redis_binaries().get(version)
    if found is None:
        pytest.skip(f"no Redis {version} server on this machine")
    return found


def tcp_url(acl: AclServer, role: str, port: int, scheme: str = "redis") -> str:
    user = f"conveyor-{role}"
    return f"{scheme}://{user}:{acl.passwords[user]}@127.0.0.1:{port}" + ("" if "cluster" in scheme else "/0")


def connects(acl: AclServer) -> int:
    return int(acl.admin.info("stats")["total_connections_received"])


def every_client_runs_a_command(url: str) -> None:
    """Each kind of client conveyor makes: sync (with and without retries), asyncio, and the held
    connections (sync and asyncio) made from their pools; each connects anew and sends XLEN."""
    settings = RedisSettings(url)
    for retries in (True, False):
        client = settings.sync_client(retries=retries)
        try:
            assert client.xlen(STREAM) == 0
            if not settings.is_cluster:
                held = HeldConnection(client)
                try:
                    held.send_command("XLEN", STREAM)
                    assert held.read() == 0
                finally:
                    held.drop()
        finally:
            client.close()

    async def main() -> None:
        client = settings.async_client()
        try:
            assert await client.xlen(STREAM) == 0
            if not settings.is_cluster:
                held = AsyncHeldConnection(client)
                try:
                    assert await held.call(b"*2\r\n$4\r\nXLEN\r\n$%d\r\n%s\r\n" % (len(STREAM), STREAM.encode())) == 0
                finally:
                    await held.close()
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.fixture(params=["6.2", "7"])
def tcp_acl(request: pytest.FixtureRequest) -> Iterator[tuple[AclServer, int]]:
    port = free_port()
    acl = start_acl_server(binary(request.param), extra_args=["--port", str(port), "--bind", "127.0.0.1"])
    try:
        yield acl, port
    finally:
        acl.stop()


def test_no_role_is_refused_anything_at_connect_over_tcp(tcp_acl: tuple[AclServer, int]) -> None:
    acl, port = tcp_acl
    before = connects(acl)
    for role in ROLE_NAMES:
        every_client_runs_a_command(tcp_url(acl, role, port))
    assert connects(acl) - before >= 4 * len(ROLE_NAMES)  # they did connect, over TCP
    assert acl.acl_log() == []


@pytest.mark.system  # a (one-node) Redis Cluster
@pytest.mark.parametrize("version", ["6.2", "7"])
def test_cluster_clients_are_not_refused_anything_at_connect(version: str) -> None:
    port = free_ports(1)[0]  # its cluster bus (port + 10000) free and in range too
    acl = start_acl_server(binary(version), roles=(), extra_args=[
        "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"])
    try:
        acl.admin.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in acl.admin.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.05)
        for role in ROLE_NAMES:
            user = f"conveyor-{role}"
            line = role_rules(role, [Scope()], acl.version, cluster=True).setuser(user, f">{user}-secret")
            acl.admin.execute_command(*line.split())
            acl.passwords[user] = f"{user}-secret"
        acl.admin.execute_command("ACL", "LOG", "RESET")
        for role in ROLE_NAMES:
            every_client_runs_a_command(tcp_url(acl, role, port, "redis+cluster"))
        log: list[Any] = acl.acl_log()
        assert log == []
    finally:
        acl.stop()
