"""A malformed Redis URL is refused where it is given, in one line, by every command (exit 2), never a traceback
from deep in redis-py, and never read otherwise than written.

``--redis redis://h:abc`` (a port that is no number) was a traceback from each command, and from each worker
process of ``conveyor worker`` (a crash loop); ``redis://h/abc`` silently used database 0; a cluster URL's
``/2`` was dropped. No Redis is needed: every refusal comes before a connection.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from click.testing import CliRunner

from broker.connection import RedisSettings, RedisURLError, check_redis_url, is_transient
from broker.local_runs import choose_redis
from workers.cli import main

pytestmark = pytest.mark.unit

BAD = {
    "redis://h:abc": "could not be cast to integer",
    "rediss://h:x/0": "could not be cast to integer",
    "redis://h:99999/0": "out of range",
    "redis://h/abc": "the database must be a number",
    "redis://h:6379/-1": "the database must be a number",
    "redis://h:6379/0/1": "the database must be a number",
    "redis://h:6379/0?db=x": "the database must be a number",
    "unix:///tmp/r.sock?db=abc": "the database must be a number",
    "unix://": "no socket path",
    "http://h:6379": "unknown scheme 'http'",
    "redis://[::1:6379": "Invalid IPv6 URL",
    "redis+cluster://h:abc": "every seed of a cluster must be host:port",
    "redis+cluster://h:99999": "every seed of a cluster must be host:port",
    "redis+cluster://h/abc": "the database must be a number",
    "rediss+cluster://h:7000/2": "a Redis Cluster has database 0 only",
}
GOOD = ["redis://h:6379/0", "redis://h:6379", "redis://h:6379/", "rediss://u:p@h:6380/3", "unix:///tmp/r.sock",
        "unix:///tmp/r.sock?db=2", "redis+cluster://h:7000,g:7001", "rediss+cluster://u:p@h:7000/0"]


@pytest.mark.parametrize("url, says", BAD.items())
def test_a_malformed_url_is_refused_before_any_client(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=says):
        check_redis_url(url)
    with pytest.raises(RedisURLError, match=says):
        RedisSettings(url)
    with pytest.raises(RedisURLError, match=says):
        choose_redis(url, ["p"])


@pytest.mark.parametrize("url", GOOD)
def test_good_urls_are_taken(url: str) -> None:
    check_redis_url(url)
    assert choose_redis(url, ["p"]).url == url


def test_a_password_never_shows_in_the_refusal() -> None:
    for url in ("redis://u:sesame@h:abc/0", "redis://u:sesame@[::1:6379/0"):
        with pytest.raises(RedisURLError) as caught:
            check_redis_url(url)
        assert "sesame" not in str(caught.value)


COMMANDS = {
    "worker": ["worker", "examples.scale_shift:pipeline", "--stage", "scale"],
    "run": ["run", "examples.scale_shift:pipeline", "--port", "0"],
    "gateway": ["gateway", "scale-shift", "--port", "0"],
    "status": ["status", "scale-shift"],
    "k8s": ["k8s", "examples.scale_shift:pipeline", "--image", "i:1", "--redis-version", "7"],
    "acl": ["acl", "--pipeline", "scale-shift"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("url", ["redis://h:abc", "redis://h/abc", "redis+cluster://h/abc"])
def test_every_command_says_a_malformed_url_in_one_line(command: str, url: str, gateway_served: list[Any]) -> None:
    result = CliRunner().invoke(main, [*COMMANDS[command], "--redis", url])
    assert result.exit_code == 2 and not gateway_served, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "Redis URL" in errors[0] and ("--redis" in errors[0] or command == "k8s"), errors[0]


@pytest.mark.parametrize(("reply", "transient"), [
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", True),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", True),
    ("ERR Error running script (call to f_0): @user_script:1: OOM command not allowed", True),
    ("BUSYGROUP Consumer Group name already exists", False),
    ("BUSYKEY Target key name already exists.", False),
    ("ERR unknown command 'XOOMX'", False),
])
def test_a_reply_is_transient_only_for_a_code_as_a_word(reply: str, transient: bool) -> None:
    """BUSYGROUP (a group created twice) or BUSYKEY read as BUSY: waited for, as if Redis were busy."""
    assert is_transient(redis.ResponseError(reply)) is transient
