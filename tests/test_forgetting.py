"""Nothing lost when Redis itself forgets: the gateway sends again what a restarted Redis lost.

Real kills: a Redis without persistence SIGKILLed and started again empty on the same socket,
several times, under 64 requests in flight; ``conveyor run``'s own embedded Redis SIGKILLed under
HTTP load (it brings it back). Each request gets its right answer exactly once, and nothing is left
in Redis afterwards. (A Redis Cluster master killed while its replica lagged: tests/test_cluster.py.)
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import itertools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import redis

from broker.keys import GROUP, Keys
from gateway import Gateway, GatewaySettings
from tests.helpers import REPO_ROOT, conveyor_env, requests_in, running_workers, wait_for
from tests.ops_stages import free_port
from tests.test_chaos import CountingGateway
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system

APP = "tests.chaos_stages"
T = 30.0


def _left_in_redis(url: str, pipeline: str, stages: int) -> list[tuple[str, int, int]]:
    """(stream, entries, pending) of every stage stream that still holds something."""
    client = redis.Redis.from_url(url)
    try:
        left = []
        for i in range(stages):
            stream = Keys(pipeline).stream(i)
            entries = client.xlen(stream)
            pending = client.xpending(stream, GROUP)["pending"] if entries else 0
            if entries or pending:
                left.append((stream, entries, pending))
        return left
    finally:
        client.close()


def test_redis_restarted_empty_under_load_loses_nothing(private_redis: EmbeddedRedis) -> None:
    """64 in flight; Redis SIGKILLed and started again empty three times: every request answered
    right, once; the gateway sent again what each restart lost."""
    url = private_redis.url
    in_flight, restarts = 64, 3
    with running_workers(url, f"{APP}:reconnect", ["Square", "Neg"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        workers.wait_ready("c-reconnect", T)

        async def main() -> tuple[dict[int, Any], int, int]:
            answers: dict[int, Any] = {}
            async with CountingGateway(url, "c-reconnect", GatewaySettings(timeout_s=T)) as gw:
                numbers = iter(range(10_000_000))
                calm = asyncio.Event()

                async def client() -> None:
                    while not calm.is_set():  # requests all along, until the last restart is behind
                        x = next(numbers)
                        try:
                            answers[x] = await gw.predict(x)
                        except Exception as exc:  # recorded: the assertion below names it
                            answers[x] = exc

                async def chaos() -> None:
                    for _ in range(restarts):
                        await asyncio.sleep(1.0)
                        private_redis.kill()  # SIGKILL: everything in it is gone
                        await asyncio.sleep(0.3)
                        await asyncio.to_thread(private_redis.start)  # same socket, empty
                    await asyncio.sleep(1.0)
                    calm.set()

                await asyncio.gather(chaos(), *(client() for _ in range(in_flight)))
                assert gw.in_flight == 0
                duplicates = sum(n - 1 for n in gw.hub.pushed.values() if n > 1)
                return answers, gw.hub.recall.resubmitted, duplicates

        answers, resubmitted, duplicates = asyncio.run(asyncio.wait_for(main(), 6 * T))
        wrong = {x: a for x, a in answers.items() if a != -x * x}
        assert not wrong, f"{len(wrong)} of {len(answers)} wrong or failed: {list(wrong.items())[:3]}"
        print(f"\n{len(answers)} requests, {restarts} restarts: {resubmitted} requests sent again, {duplicates} "
              "answered twice by Redis (dropped by the gateway)")
        assert resubmitted > 0, "nothing was in flight at a restart: the test did not test"
        wait_for(lambda: not _left_in_redis(url, "c-reconnect", 2), T, "nothing left pending",
                 lambda: str(_left_in_redis(url, "c-reconnect", 2)))
        workers.check_alive()


@pytest.mark.parametrize("batch_entries", [False, True], ids=["single-entries", "batch-entries"])
def test_the_audit_finds_what_redis_dropped_without_a_restart(private_redis: EmbeddedRedis,
                                                              batch_entries: bool) -> None:
    """FLUSHALL (as an operator, or eviction, might) while requests wait in a stream: no reconnect
    says so, the audit of requests older than ``audit_after_s`` does. A first turn may be taken whole
    by the (suspended) worker's blocked read, with batch entries; a second turn then waits in the
    stream, undelivered, and exists nowhere else once it is flushed: the audit must send it again."""
    url = private_redis.url
    with running_workers(url, f"{APP}:reconnect", ["Square", "Neg"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        workers.wait_ready("c-reconnect", T)

        N, TURNS = 100, 4

        async def main() -> tuple[list[Any], int, int]:
            settings = GatewaySettings(timeout_s=T, audit_after_s=0.5, batch_entries=batch_entries)
            async with Gateway(url, "c-reconnect", settings) as gw:
                # The spec is read: the audit knows the stages. A burst, not one request: the first stage's
                # latest stats then show cheap items (a batch of one costs Square 2 ms: no batch entries).
                for _ in range(20):  # bounded: on a busy machine a burst's items may look costly, so again
                    await asyncio.gather(*(gw.predict(x) for x in range(64)))
                    await asyncio.wait_for(gw.views.refreshed(), T)  # the first stage's workers read: turns sized
                    if not batch_entries or gw.lanes[0].sizing.batch_size >= 2:
                        break
                admin = redis.asyncio.Redis.from_url(url)
                try:
                    # Suspend the first stage's workers so that requests stay in its stream.
                    for proc in _stage_processes(workers, "Square"):
                        proc.suspend()
                    stream = Keys("c-reconnect").stream(0)
                    futures: list[asyncio.Future[Any]] = []
                    waiting = 0
                    # Turns of N until one waits undelivered: each suspended consumer's blocked read
                    # may take a turn whole (with batch entries).
                    for turn in range(TURNS):
                        futures += [asyncio.ensure_future(gw.predict(x)) for x in range(turn * N, (turn + 1) * N)]
                        # Requests, not entries: a turn may reach the first stage as batch entries.
                        await _until(lambda: _requests(admin, stream), len(futures))
                        [group] = await admin.xinfo_groups(stream)
                        waiting = requests_in(await admin.xrange(stream, min=b"(" + group["last-delivered-id"]))
                        if waiting:
                            break
                    entries = await admin.xlen(stream)
                    # With batch entries, fewer entries than requests, unless a loaded machine's items looked too
                    # costly for them at the turns (the gateway sizes them from the stage's latest stats): the
                    # audit must find the requests all the same.
                    assert (entries <= len(futures)) if batch_entries else (entries == len(futures)), entries
                    await admin.flushall()  # the entries, the groups, the spec: gone, Redis still up
                finally:
                    for proc in _stage_processes(workers, "Square"):
                        proc.resume()
                    await admin.aclose()
                answers = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), T)
                return answers, gw.hub.recall.resubmitted, waiting

        answers, resubmitted, waiting = asyncio.run(asyncio.wait_for(main(), 3 * T))
        failed = [a for a in answers if isinstance(a, BaseException)][:3]
        assert answers == [-x * x for x in range(len(answers))], failed
        # Entries already delivered to a (suspended) worker's socket are answered by it; those never
        # delivered (a turn at least) existed only in the flushed stream.
        assert waiting > 0 and resubmitted >= waiting, (waiting, resubmitted)


def _stage_processes(workers: Any, stage: str) -> list[psutil.Process]:
    return [psutil.Process(p.pid) for p in workers.stage(stage).children()]


async def _requests(client: redis.asyncio.Redis, stream: str) -> int:
    return requests_in(await client.xrange(stream))


async def _until(read: Any, at_least: int, timeout_s: float = T) -> None:
    deadline = time.monotonic() + timeout_s
    while await read() < at_least:
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_conveyor_run_brings_its_redis_back_and_loses_nothing(tmp_path: Path) -> None:
    """``conveyor run``'s embedded Redis is SIGKILLed twice under HTTP load: it is started again on
    the same socket, and every request gets its answer."""
    port = free_port()
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "workers.cli", "run", "examples.scale_shift:pipeline",
                                "--port", str(port), "--redis-dir", str(tmp_path / "redis")], cwd=REPO_ROOT,
                               env=conveyor_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    results: dict[int, Any] = {}
    try:
        wait_for(lambda: run.poll() is not None or _ready(port), 60, "conveyor run to be ready", log.read_text)
        assert run.poll() is None, log.read_text()
        stop = threading.Event()
        counter = iter(range(1_000_000))

        def client() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=T)
            try:
                while not stop.is_set():
                    x = next(counter)
                    conn.request("POST", "/v1/predict", body=str(x), headers={"Content-Type": "application/json"})
                    response = conn.getresponse()
                    results[x] = (response.status, json.loads(response.read()))
            finally:
                conn.close()

        threads = [threading.Thread(target=client) for _ in range(16)]
        for thread in threads:
            thread.start()
        try:
            for _ in range(2):
                time.sleep(1.0)
                server = _redis_server_of(run.pid)
                assert server is not None, log.read_text()
                server.kill()  # SIGKILL, as the OOM killer would
                server.wait(timeout=10)
                wait_for(lambda s=server: (now := _redis_server_of(run.pid)) is not None and now.pid != s.pid, 20,
                         "conveyor run to start its Redis again", log.read_text)
            time.sleep(1.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=2 * T)
        assert run.poll() is None, log.read_text()
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 0, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
    wrong = {x: r for x, r in results.items() if r != (200, {"result": 2 * x + 3})}
    assert results and not wrong, f"{len(wrong)} of {len(results)} wrong: {list(wrong.items())[:3]}"
    text = log.read_text()
    assert "embedded Redis exited" in text and "another run than before" in text, text


def _ready(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except OSError:
        return False


def _redis_server_of(pid: int) -> psutil.Process | None:
    """The redis-server ``conveyor run`` (pid) started, if one runs now."""
    servers = [p for p in psutil.Process(pid).children(recursive=True)
               if p.name() == "redis-server" and p.status() != psutil.STATUS_ZOMBIE]
    return servers[0] if servers else None


def test_submissions_retry_at_least_every_second_while_redis_is_away(private_redis: EmbeddedRedis,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """While Redis is away the gateway tries its submissions again with a backoff capped at a second, as
    its reply reader does: what callers sent meanwhile goes out within about a second of Redis being back.
    Capped at 5 s, it went out up to 5 s later, and callers with a few seconds left timed out for nothing."""
    url = private_redis.url
    with running_workers(url, f"{APP}:reconnect", ["Square", "Neg"], CONVEYOR_LOG_LEVEL="WARNING") as workers:
        workers.wait_ready("c-reconnect", T)

        async def main() -> list[float]:
            async with Gateway(url, "c-reconnect", GatewaySettings(timeout_s=T)) as gw:
                assert await gw.predict(3) == -9
                private_redis.kill()
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="conveyor.gateway"):
                    waiting = [asyncio.ensure_future(gw.predict(x)) for x in range(3)]
                    await asyncio.sleep(10.0)  # the span observed: retries back off to their cap in ~5 s
                    tries = [r.created for r in caplog.records if "unavailable for submissions" in r.getMessage()]
                    for future in waiting:
                        future.cancel()
                    await asyncio.gather(*waiting, return_exceptions=True)
                await asyncio.to_thread(private_redis.start)
                return tries

        tries = asyncio.run(asyncio.wait_for(main(), 3 * T))
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(tries) >= 8 and max(gaps) < 1.5, gaps


def test_the_audit_leaves_the_turn_on_its_way(redis_url: str) -> None:
    """A turn the flusher took is in no stream until its call runs, which after a pause or a lost
    connection's retry may be after the audit's own call: the audit leaves it (it sent it again as lost,
    said Redis lost it, and it ran twice). Once the call's reply came, the request is audited as any other."""
    import redis.asyncio as aredis

    from broker.codec import encode
    from broker.submit import Submitter
    from gateway.client.lane import InFlight, Lane
    from gateway.client.recall import Recall

    async def main() -> tuple[list[InFlight], list[InFlight], InFlight]:
        keys = Keys("t-audit-sending")
        submitter = Submitter(keys, keys.reply("g").encode())
        lane = Lane(keys, submitter, keys.reply("g").encode(), b"g-", asyncio.Event(), lambda: 1)
        record = InFlight(None, lane, submitter.entry(b"g-1", encode(1), b""), 0.0, T)  # type: ignore[arg-type]
        sent: list[InFlight] = []
        recall = Recall({b"g-1": record}, lambda lane, records: sent.extend(records), audit_after_s=1.0)
        lane.outbox.append(record)
        lane.take_turn()  # on its way: its call not answered yet
        client = aredis.Redis.from_url(redis_url)
        try:
            await recall.audit(client, 10.0)
            on_its_way = list(sent)
            lane.sending = []  # the call's reply came (the flusher clears it): in Redis, or lost by it since
            await recall.audit(client, 20.0)
        finally:
            await client.aclose()
        return on_its_way, sent, record

    on_its_way, sent, record = asyncio.run(main())
    assert on_its_way == [] and sent == [record]



@pytest.mark.parametrize("before", [4, 0], ids=["call-lost", "call-reaches-new-run"])
def test_another_run_leaves_the_turn_on_its_way(private_redis: EmbeddedRedis, before: int) -> None:
    """Redis SIGKILLed and started again empty while a turn of submissions is on its way (taken, its call
    not answered): the reader's reconnect sees another run and sends again what was in flight, but not
    that turn, whose call reaches the new run or, lost (its connection was to the old run), is queued
    again by the flusher. Queued by both, each of its requests was added twice to the first stage's
    stream, and ran twice. What the old run held (``before`` requests) is sent again, once."""
    from broker.codec import encode
    from broker.protocol import expand
    from gateway.client.hub import Hub

    during = 8
    stream = Keys("t-run-sending").stream(0)

    async def main() -> tuple[collections.Counter[bytes], int]:
        hub = Hub(private_redis.url, GatewaySettings(timeout_s=T))
        await hub.start()  # its tasks not run yet: the hooks below see the reader's first check
        admin = redis.asyncio.Redis.from_url(private_redis.url)
        waiters: list[Any] = []
        try:
            lane = hub.lane(Keys("t-run-sending"))
            send, check_run = hub._submissions.send, hub.recall.check_run
            restarted, sends = False, 0
            checked, on_its_way, another_run = asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def held_send(calls: Any) -> Any:
                nonlocal sends
                sends += 1
                try:
                    if restarted:  # the turn is on its way while the reader reconnects to the new run
                        on_its_way.set()
                        await asyncio.wait_for(another_run.wait(), T)
                    return await send(calls)
                finally:
                    sends -= 1

            async def held_check_run(client: Any, reply_key: bytes, lanes: Any) -> None:
                if restarted:
                    await asyncio.wait_for(on_its_way.wait(), T)
                await check_run(client, reply_key, lanes)
                (another_run if restarted else checked).set()

            hub._submissions.send = held_send  # type: ignore[method-assign]
            hub.recall.check_run = held_check_run  # type: ignore[method-assign]
            await asyncio.wait_for(checked.wait(), T)  # the first run recorded
            waiters += [hub.enqueue(lane, encode(x), T) for x in range(before)]  # lost with the old run
            await _until(lambda: _requests(admin, stream), before)
            private_redis.kill()
            restarted = True
            waiters += [hub.enqueue(lane, encode(x), T) for x in range(before, before + during)]
            await asyncio.wait_for(on_its_way.wait(), T)  # their turn taken, held until the new run is seen
            await asyncio.to_thread(private_redis.start)  # same socket, empty
            await asyncio.wait_for(another_run.wait(), T)

            async def idle() -> int:
                return int(not (lane.outbox or lane.sending or sends))

            await _until(idle, 1)
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await admin.xrange(stream))
            added = collections.Counter(fields[b"id"] for entry_id, entry in entries
                                        for _, fields in expand(entry_id, entry) if fields is not None)
            return added, hub.recall.resubmitted
        finally:
            await admin.aclose()
            await hub.close()  # no worker: what is in flight fails ("gateway closed")
            await asyncio.gather(*waiters, return_exceptions=True)

    added, resubmitted = asyncio.run(asyncio.wait_for(main(), 3 * T))
    assert sorted(added.values()) == [1] * (before + during), added
    assert resubmitted == before
