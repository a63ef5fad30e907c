"""One rule for which Redis a command reads: the URL given, else a ``conveyor run`` of the named pipeline
on this machine (its socket in /tmp/conveyor-<pipeline>), else the default; each command says which.
``conveyor status NAME`` exits 1 for a name not registered there, with the names closest to it."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.keys import Keys
from broker.local_runs import choose_redis, run_dir
from broker.spec import StageInfo, encode_spec
from tests.helpers import REPO_ROOT, conveyor_argv, conveyor_env, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.redis

T = 60.0


def _register(client: redis.Redis, name: str) -> None:
    client.set(Keys(name).spec, encode_spec([StageInfo(0, "Scale", 1, 0.0, None)]))
    client.sadd(Keys(name).registry, name)


@pytest.fixture
def local_run() -> Iterator[tuple[str, redis.Redis]]:
    """A Redis where `conveyor run` of a fresh pipeline name would put it, that pipeline registered."""
    name = f"which-{secrets.token_hex(3)}"
    server = EmbeddedRedis(directory=run_dir(name))
    server.start()
    client = redis.Redis(unix_socket_path=str(server.socket_path))
    try:
        _register(client, name)
        yield name, client
    finally:
        client.close()
        server.stop()


def test_a_command_without_a_url_finds_the_conveyor_run_of_its_pipeline(local_run: tuple[str, redis.Redis]) -> None:
    name, _ = local_run
    chosen = choose_redis(None, [name])
    assert chosen.url == f"unix://{run_dir(name)}/redis.sock" and "conveyor run" in chosen.why
    assert choose_redis("redis://elsewhere:6379/0", [name]).url == "redis://elsewhere:6379/0"  # given: as it is
    assert choose_redis(None, [f"{name}-not-running"]).url == "redis://127.0.0.1:6379/0"
    done = subprocess.run(conveyor_argv("status", name), cwd=REPO_ROOT, env=conveyor_env(), capture_output=True,
                          text=True, timeout=T)
    assert done.returncode == 0, done.stderr
    assert f"Redis at unix://{run_dir(name)}/redis.sock (the Redis of `conveyor run` of {name!r}" in done.stderr
    assert f"pipeline {name}:" in done.stdout


def test_status_of_a_name_not_registered_exits_1_with_the_closest(local_run: tuple[str, redis.Redis]) -> None:
    name, client = local_run
    _register(client, "scale-shift")
    url = f"unix://{run_dir(name)}/redis.sock"
    done = subprocess.run(conveyor_argv("status", "scale-shfit"), cwd=REPO_ROOT, env=conveyor_env(url),
                          capture_output=True, text=True, timeout=T)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "pipeline 'scale-shfit' is not registered in this Redis; did you mean 'scale-shift'?" in done.stderr
    assert "conveyor status: Redis at" not in done.stderr  # a URL given is not announced


def test_acl_apply_without_a_url_loads_into_the_conveyor_run_of_its_pipeline(
        local_run: tuple[str, redis.Redis]) -> None:
    name, client = local_run
    done = subprocess.run(conveyor_argv("acl", "--role", "monitor", "--pipeline", name, "--apply", "--password-stdin"),
                          cwd=REPO_ROOT, env=conveyor_env(), input="m-pw\n", capture_output=True, text=True, timeout=T)
    assert done.returncode == 0, done.stderr
    assert "the Redis of `conveyor run`" in done.stderr and "loaded 1 user(s) (conveyor-monitor)" in done.stderr
    assert any(line.split()[1] == b"conveyor-monitor" for line in client.execute_command("ACL", "LIST"))


@pytest.mark.system
def test_a_run_of_a_modules_pipelines_is_found_by_each_pipelines_name(tmp_path: Path) -> None:
    """`conveyor run MODULE` puts its Redis in /tmp/conveyor-<module>: `conveyor status <a pipeline of it>`
    looked only in /tmp/conveyor-<pipeline>, fell back to 127.0.0.1:6379 and read another Redis (or none).
    The run lists its pipelines in its directory (removed at its end), and commands find it by them."""
    redis_dir = run_dir(f"which-module-{secrets.token_hex(3)}")
    log = (tmp_path / "run.log").open("wb")
    run = subprocess.Popen(conveyor_argv("run", "tests.two_pipelines", "--port", "0", "--redis-dir", str(redis_dir)),
                           cwd=REPO_ROOT, env=conveyor_env(), stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    sock = redis_dir / "redis.sock"
    try:
        wait_for(lambda: run.poll() is not None or (sock.exists() and b"negate" in _listing(redis_dir)), T,
                 "the run's Redis and its listing", lambda: (tmp_path / "run.log").read_text())
        assert choose_redis(None, ["two-negate"]).url == f"unix://{sock}"
        done = subprocess.run(conveyor_argv("status", "two-negate"), cwd=REPO_ROOT, env=conveyor_env(),
                              capture_output=True, text=True, timeout=T)
        assert f"Redis at unix://{sock} (the Redis of `conveyor run` of 'two-negate'" in done.stderr, done.stderr
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(T)
        log.close()
    assert not redis_dir.exists()  # the listing went with the rest: nothing left to find


def _listing(directory: Path) -> bytes:
    try:
        return (directory / "pipelines").read_bytes()
    except OSError:
        return b""
