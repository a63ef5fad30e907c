"""broker.probe: whether a Redis server answers on a Unix socket (the embedded server's readiness,
and ``claim_dir``'s check that a socket directory is not in use)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from broker.probe import answers, probe
from workers.embedded.directory import claim_dir
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.redis  # servers of their own


def test_a_live_server_answers(private_redis: EmbeddedRedis) -> None:
    assert probe(private_redis.socket_path) is None
    assert answers(private_redis.socket_path)


def test_a_server_that_asks_for_a_password_is_up() -> None:
    with EmbeddedRedis(extra_args=("--requirepass", "not-given")) as server:
        assert answers(server.socket_path)


def test_a_stale_socket_refuses_at_once_and_its_directory_is_reused(tmp_path: Path) -> None:
    """A socket file left by a killed server: refused, without retries (a probe is asked again by
    its caller, or wants an answer now)."""
    directory = tmp_path / "r"
    directory.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(directory / "redis.sock"))
    stale.close()  # the file stays, nobody listens
    t0 = time.monotonic()
    reason = probe(directory / "redis.sock")
    assert reason is not None and "refused" in str(reason).lower()
    assert time.monotonic() - t0 < 0.5
    assert claim_dir(directory) == directory


def test_no_socket_is_no_server(tmp_path: Path) -> None:
    assert not answers(tmp_path / "nothing.sock", timeout_s=0.2)
