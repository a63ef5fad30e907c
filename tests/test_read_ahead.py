"""Read-ahead (``workers.loop.ahead``): after a full batch a worker reads the next one before taking
its commit's reply. Real ``conveyor worker`` processes on a private Redis, fed by a foreign producer's
``XADD`` (docs/protocol.md) so that a backlog is waiting before the workers start.

What is checked: the worker really reads ahead (a ``XREADGROUP`` without ``BLOCK`` on the wire,
seen by ``MONITOR``) and not with ``--no-read-ahead``; every request gets exactly one correct answer
when every client connection is dropped while a commit's reply is still to be taken.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from broker import codec
from broker.keys import GROUP, Keys
from broker.protocol import entry_fields
from tests.chaos_stages import AHEAD_HOLD
from tests.helpers import running_workers, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.chaos_stages:ahead"
PIPELINE = "c-ahead"
REQUESTS = 40  # ten full batches of 4 waiting before the workers start
T = 30.0  # bound of any single wait here


def f(x: int) -> int:
    return 2 * x + 1


def enqueue(client: redis.Redis, keys: Keys, reply: str, urgent_every: int = 0) -> None:
    """A backlog of REQUESTS entries on the first stage's stream, as a foreign producer writes them;
    with ``urgent_every`` N, every Nth at priority level 1 (the pipeline has two levels)."""
    pipe = client.pipeline(transaction=False)
    for x in range(REQUESTS):
        level = 1 if urgent_every and x % urgent_every == 0 else 0
        pipe.xadd(keys.at_level(level).stream(0), entry_fields(b"r-%d" % x, codec.encode(x), reply.encode(), None))
    pipe.execute()


def answers(client: redis.Redis, reply: str | bytes) -> Counter[tuple[str, object]]:
    """(id, value, or error type) of every record pushed to the reply list so far (it is left in place)."""
    seen: Counter[tuple[str, object]] = Counter()
    for element in client.lrange(reply, 0, -1):
        for record in codec.decode(element):
            seen[(record["id"], record["value"] if record["ok"] else record["error"]["type"])] += 1
    return seen


def expected() -> Counter[tuple[str, int]]:
    return Counter({(f"r-{x}", f(x)): 1 for x in range(REQUESTS)})


def drained(client: redis.Redis, keys: Keys, levels: int = 1) -> bool:
    return all(client.xlen(k.stream(i)) == 0 and client.xpending(k.stream(i), GROUP)["pending"] == 0
               for k in keys.levels(levels) for i in (0, 1))


@contextmanager
def monitored(url: str) -> Iterator[list[list[str]]]:
    """Every command Redis runs while the block runs, as its arguments (``MONITOR``). The listener
    blocks on its socket; closing the connection ends it."""
    seen: list[list[str]] = []
    client = redis.Redis.from_url(url)
    monitor = client.monitor()
    monitor.__enter__()  # sends MONITOR and reads its OK: nothing is missed from here on

    def listen() -> None:
        try:
            while True:
                seen.append(str(monitor.next_command()["command"]).split())
        except (redis.ConnectionError, OSError, ValueError):  # the test closed the connection
            return

    thread = threading.Thread(target=listen, name="monitor", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        monitor.connection.disconnect()
        thread.join(5)
        client.close()


def reads(commands: list[list[str]], blocking: bool) -> int:
    """``XREADGROUP ... STREAMS <stream> >`` sent with ``BLOCK`` or without: only read-ahead sends
    new reads without it (a consumer's re-read of its own pending entries ends with ``0``)."""
    return sum(1 for c in commands if c and c[0].upper() == "XREADGROUP" and c[-1] == ">"
               and ("BLOCK" in (a.upper() for a in c)) == blocking)


@pytest.mark.parametrize("read_ahead", [True, False], ids=["on", "off"])
def test_a_backlog_is_read_ahead_only_when_on(private_redis: EmbeddedRedis, read_ahead: bool) -> None:
    url, keys = private_redis.url, Keys(PIPELINE)
    client = redis.Redis.from_url(url)
    reply = keys.reply("test")
    client.set("t:c-ahead:held", 1)  # no batch waits in this test
    enqueue(client, keys, reply)
    env = {"CONVEYOR_READ_AHEAD": "1" if read_ahead else "0"}
    with monitored(url) as commands, running_workers(url, APP, ["Holds", "Inc"], **env) as workers:
        wait_for(lambda: sum(answers(client, reply).values()) >= REQUESTS, T, "every answer", workers.report)
        wait_for(lambda: drained(client, keys), T, "the streams to drain", workers.report)
    assert answers(client, reply) == expected()
    assert reads(list(commands), blocking=True) > 0, "MONITOR saw none of the workers' reads"
    reads_ahead = reads(list(commands), blocking=False)
    if read_ahead:
        assert reads_ahead > 0, "a backlog of full batches was never read ahead"
    else:
        assert reads_ahead == 0, f"{reads_ahead} reads without BLOCK with --no-read-ahead"
    client.close()


@pytest.mark.parametrize("app, pipeline, urgent_every",
                         [(APP, PIPELINE, 0), (APP + "_levels", PIPELINE + "-levels", 3)],
                         ids=["one-level", "two-levels"])
def test_connections_dropped_while_a_commit_is_ahead_lose_and_repeat_nothing(
        private_redis: EmbeddedRedis, app: str, pipeline: str, urgent_every: int) -> None:
    """The batch holding AHEAD_HOLD waits in ``predict`` with a backlog behind it (the batches before
    it were full, so it was most likely read ahead, the commit before it sent and its reply perhaps
    not yet taken). Every client connection is dropped then: the reply of that commit (or the next
    commit, sent on a dead connection) fails late, the lane is set aside and recovered, and every
    request still gets exactly one correct answer, and no worker failed. With two priority levels
    (every third request urgent), a batch holds both levels, each committed in its own lane."""
    url, keys = private_redis.url, Keys(pipeline)
    client = redis.Redis.from_url(url)
    reply = keys.reply("test")
    enqueue(client, keys, reply, urgent_every)
    levels = 2 if urgent_every else 1
    with running_workers(url, app, ["Holds", "Inc"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        wait_for(lambda: client.exists("t:c-ahead:held"), T, f"the batch of {AHEAD_HOLD} to wait", workers.report)
        before = {record_id for record_id, _ in answers(client, reply)}
        assert f"r-{AHEAD_HOLD}" not in before
        dropped = int(client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))
        assert dropped > 0
        client.set("t:c-ahead:go", 1)
        wait_for(lambda: sum(answers(client, reply).values()) >= REQUESTS, T, "every answer", workers.report)
        wait_for(lambda: drained(client, keys, levels), T, "the streams to drain", workers.report)
        workers.check_alive()
        assert "Traceback" not in workers.report(), "a worker failed (its supervisor ran a new one)"
    assert answers(client, reply) == expected()
    client.close()
