"""Redis refusing writes (maxmemory reached with noeviction) is overload, not a crash; a gateway started
while Redis refuses for now (BUSY running a script) waits for it, as for a Redis it cannot reach."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from gateway import Gateway, GatewaySettings, Overloaded
from gateway.cli import status as status_command
from gateway.client.pipelines import Pipelines
from gateway.serve import start_when_reachable
from tests.helpers import running_workers
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "examples.scale_shift:pipeline"


def test_out_of_memory_refuses_requests_then_service_resumes(private_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    with running_workers(private_redis.url, APP, ["Scale", "Shift"]) as workers:
        workers.wait_ready("scale-shift")
        pids = {c.pid for p in workers.procs for c in p.children()}

        async def scenario() -> None:
            async with Gateway(private_redis.url, "scale-shift", GatewaySettings(timeout_s=10)) as gw:
                assert await gw.predict(1) == 5
                admin.config_set("maxmemory", 1)  # every write is refused with OOM from now on
                with pytest.raises(Overloaded, match=r"memory"):
                    await asyncio.wait_for(gw.predict(2), 5)  # refused at once, well before its deadline
                admin.config_set("maxmemory", 0)
                answers = await asyncio.wait_for(asyncio.gather(*(gw.predict(v) for v in range(20))), 20)
                assert answers == [v * 2 + 3 for v in range(20)]
                assert (await gw.pipeline_status()).reachable, "the gateway's tasks survived the refusals"

        asyncio.run(scenario())
        workers.check_alive()
        assert {c.pid for p in workers.procs for c in p.children()} == pids, "no worker crashed"
    admin.close()


@contextlib.contextmanager
def _busy(url: str) -> Iterator[redis.Redis]:
    """Redis running a script that loops until SCRIPT KILL (on a connection of its own), answering BUSY to
    everyone else; yields an admin's client once it does, and kills the script (if still running) after."""
    admin = redis.Redis.from_url(url)
    admin.config_set("lua-time-limit", 100)  # BUSY after 0.1 s of script (busy-reply-threshold on Redis 7)
    blocker = redis.Redis.from_url(url)

    def run() -> None:
        with contextlib.suppress(redis.ResponseError):  # "Script killed by user"
            blocker.eval("while true do end", 0)
        blocker.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not _answers_busy(admin):
            assert time.monotonic() < deadline, "Redis never answered BUSY"
            time.sleep(0.02)
        yield admin
    finally:
        with contextlib.suppress(redis.ResponseError):  # no script left to kill
            admin.script_kill()
        thread.join(10)
        admin.close()


def _answers_busy(admin: redis.Redis) -> bool:
    try:
        admin.ping()
    except redis.ResponseError as exc:
        return "BUSY" in str(exc)
    return False


def test_a_gateway_started_while_redis_runs_a_long_script_waits_for_it(private_redis: EmbeddedRedis,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A gateway (re)started while Redis answers BUSY (a long script, or MASTERDOWN, ...) retries, as the
    workers do, and starts once Redis serves again: not a traceback and exit 1 (a crash loop under a
    restart policy)."""

    async def scenario(admin: redis.Redis) -> None:
        backend = Pipelines(private_redis.url, ["scale-shift"])
        started = asyncio.ensure_future(start_when_reachable(backend, private_redis.url))
        deadline = time.monotonic() + 10
        while "answers but cannot serve now" not in caplog.text:
            assert not started.done(), "the start did not wait for the busy Redis"
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.02)
        admin.script_kill()
        assert await asyncio.wait_for(started, 20), "not started"
        await backend.close()

    with _busy(private_redis.url) as admin, caplog.at_level(logging.WARNING, "gateway.serve"):
        asyncio.run(scenario(admin))


def test_status_of_a_busy_redis_is_one_line_and_exit_2(private_redis: EmbeddedRedis) -> None:
    """`conveyor status` against a Redis that answers BUSY says so in one line and exits 2, as for one it
    cannot reach; not a traceback."""
    with _busy(private_redis.url):
        out = CliRunner().invoke(status_command, ["scale-shift", "--redis", private_redis.url])
    assert out.exit_code == 2, (out.output, out.exception)
    assert "answers but cannot serve now (BUSY" in out.output and out.output.count("\n") == 1, out.output
