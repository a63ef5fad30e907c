"""AUTH with minimal ACL users, TLS from a rediss:// URL, and tenants separated by prefix."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway import Gateway, GatewaySettings
from tests.helpers import running_workers
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "examples.scale_shift:pipeline"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def documented_acls() -> dict[str, list[str]]:
    """The ACL rules exactly as docs/security.md gives them, so the docs cannot drift."""
    text = DOCS.read_text()
    block = text.split("```\n", 2)[1].split("```")[0]
    users: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in block.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[:2] == ["ACL", "SETUSER"]:
            current = users.setdefault(words[2], [])
            current += words[3:]
        elif current is not None:
            current += words
    return users


async def scale_shift(url: str, values: range) -> list[int]:
    async with Gateway(url, "scale-shift", GatewaySettings(timeout_s=20)) as gw:
        return list(await asyncio.gather(*(gw.predict(v) for v in values)))


@pytest.fixture
def acl_redis() -> Iterator[tuple[str, str, str]]:
    port = free_port()
    server = EmbeddedRedis(extra_args=["--port", str(port), "--bind", "127.0.0.1"])
    server.start()
    admin = redis.Redis.from_url(server.url)
    urls = {}
    try:
        for user, rules in documented_acls().items():
            password = f"{user}-secret"
            rules = [f">{password}" if rule.startswith(">") else rule for rule in rules]
            admin.execute_command("ACL", "SETUSER", user, *rules)
            urls[user] = f"redis://{user}:{password}@127.0.0.1:{port}/0"
        admin.execute_command("ACL", "SETUSER", "default", "off")  # this admin connection stays authenticated
        yield urls["conveyor-worker"], urls["conveyor-gateway"], f"redis://127.0.0.1:{port}/0"
    finally:
        admin.close()
        server.stop()


def test_minimal_acl_users_run_the_pipeline(acl_redis: tuple[str, str, str]) -> None:
    worker_url, gateway_url, anonymous_url = acl_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(anonymous_url).ping()
    with running_workers(worker_url, APP, ["Scale", "Shift"]) as workers:
        workers.wait_ready("scale-shift")
        assert asyncio.run(scale_shift(gateway_url, range(50))) == [v * 2 + 3 for v in range(50)]
    gateway_only = redis.Redis.from_url(gateway_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway_only.xreadgroup("workers", "intruder", {"conveyor:{scale-shift}:stream:0": ">"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway_only.set("other-tenant:key", b"x")
    gateway_only.close()


def make_certs(directory: Path) -> tuple[Path, Path, Path]:
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "redis.key", directory / "redis.csr", directory / "redis.crt"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cmd in (
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_crt,
         "-days", "1", "-subj", "/CN=conveyor-test-ca"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
         "-days", "1", "-extfile", ext],
    ):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=60)
    return ca_crt, crt, key


def test_tls_from_a_rediss_url(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    ca, crt, key = make_certs(tmp_path)
    port = free_port()
    server = EmbeddedRedis(extra_args=["--tls-port", str(port), "--port", "0", "--tls-cert-file", str(crt),
                                       "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                                       "--tls-auth-clients", "no"])
    try:
        server.start()
    except Exception as exc:  # a redis-server built without TLS
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        with running_workers(url, APP, ["Scale", "Shift"]) as workers:
            workers.wait_ready("scale-shift")
            assert asyncio.run(scale_shift(url, range(20))) == [v * 2 + 3 for v in range(20)]
    finally:
        server.stop()


def test_tenants_under_different_prefixes_do_not_meet(redis_url: str, redis_client: redis.Redis) -> None:
    with running_workers(redis_url, APP, ["Scale", "Shift"], CONVEYOR_PREFIX="tenant-a"):

        async def main() -> tuple[list[int], bool]:
            async with Gateway(redis_url, "scale-shift", GatewaySettings(prefix="tenant-a", timeout_s=20)) as a:
                for _ in range(300):
                    if (await a.pipeline_status()).ready:
                        break
                    await asyncio.sleep(0.05)
                answers = list(await asyncio.gather(*(a.predict(v) for v in range(10))))
            async with Gateway(redis_url, "scale-shift", GatewaySettings(prefix="conveyor", timeout_s=0.5)) as b:
                try:
                    await b.predict(1)
                    crossed = True
                except TimeoutError:
                    crossed = False
            return answers, crossed

        answers, crossed = asyncio.run(main())
    assert answers == [v * 2 + 3 for v in range(10)]
    assert not crossed, "a gateway under another prefix was answered by tenant-a's workers"
    assert all(k.startswith(b"tenant-a:") or k.startswith(b"conveyor:") for k in redis_client.keys("*"))
    assert redis_client.keys("tenant-a:{scale-shift}:stream:*")
