"""Errors a user can read: a mistyped pipeline, a result too large or unencodable, a port taken."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import cast

import psutil
import pytest
import redis

from broker import codec, protocol
from broker.keys import Keys
from broker.spec import StageInfo, decode_spec, encode_spec
from gateway import DeadlineExceeded, Gateway, GatewaySettings, StageError, UnknownPipeline
from gateway.http.server import HttpServer, HttpSettings
from tests.error_stages import UNENCODABLE_FIRST, UNENCODABLE_LAST, dates, raises, sizes, times, versions_old
from tests.helpers import (
    REPO_ROOT,
    conveyor_argv,
    conveyor_env,
    http_call,
    ping,
    running_workers,
    start_worker,
    stop_process,
    wait_for,
)
from tests.ops_stages import free_port
from tests.test_http import Client, Resp, predict_json
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0
TYPO = "no-such-pipeline"


def _keys_of(client: redis.Redis, pipeline: str) -> list[bytes]:
    return list(client.scan_iter(match=f"*{{{pipeline}}}*", count=1000))


# -- a pipeline nobody registered ------------------------------------------------------------


def test_predict_on_an_unregistered_pipeline_names_it_soon_and_writes_nothing(
        redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    redis_client.set(Keys("scale-shift").spec, encode_spec([StageInfo(0, "Scale", 1, 0.0, None)]))
    redis_client.sadd(Keys("scale-shift").registry, "scale-shift")  # as its workers do when they register

    async def main() -> float:
        settings = GatewaySettings(register_wait_s=0.5)
        with caplog.at_level(logging.WARNING, logger="conveyor.gateway"):
            async with Gateway(redis_url, TYPO, settings) as gw:
                started = time.monotonic()
                with pytest.raises(UnknownPipeline) as info:
                    await asyncio.gather(*(gw.predict(i) for i in range(20)))
                assert info.value.pipeline == TYPO
                assert TYPO in str(info.value) and "scale-shift" in str(info.value)  # the hint for a typo
                return time.monotonic() - started

    elapsed = asyncio.run(main())
    assert elapsed < 5.0  # not the 30 s default deadline
    assert any(TYPO in r.getMessage() and "not registered" in r.getMessage() for r in caplog.records)
    assert _keys_of(redis_client, TYPO) == []  # no stream (or anything) left that would never expire


def test_the_wait_for_registration_spends_the_requests_own_deadline(redis_url: str,
                                                                     redis_client: redis.Redis) -> None:
    """A request's deadline counts from its arrival: waiting for a worker to register the
    pipeline spends it (the deadline is not restarted once registered), and an absurd timeout
    is refused at once, not dead-lettered by a worker later."""
    name = "t-registers-late"

    async def main() -> float:
        async with Gateway(redis_url, name, GatewaySettings(register_wait_s=5.0)) as gw:
            with pytest.raises(ValueError, match="up to a week"):
                gw.submit(1, timeout_s=8 * 24 * 3600.0)
            # Registered (no worker) 0.6 s into a 1 s request: it must fail at ~1 s, not ~1.6 s.
            asyncio.get_running_loop().call_later(
                0.6, redis_client.set, Keys(name).spec, encode_spec([StageInfo(0, "Nobody")]))
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await gw.predict(1, timeout_s=1.0)
            return time.monotonic() - started

    assert asyncio.run(main()) < 1.4


def test_http_says_the_pipeline_is_not_registered(redis_url: str) -> None:
    async def main() -> list[tuple[int, dict[str, object]]]:
        async with Gateway(redis_url, TYPO, GatewaySettings(register_wait_s=0.3)) as gw:
            server = HttpServer(gw, HttpSettings(port=0))
            await server.start()
            try:
                replies = [await asyncio.to_thread(http_call, server.port, "GET", "/readyz"),
                           await asyncio.to_thread(http_call, server.port, "POST", "/v1/predict", b"1")]
            finally:
                await server.close()
            return [(status, json.loads(body)) for status, body in replies]

    (ready_status, ready), (predict_status, predict) = asyncio.run(main())
    assert ready_status == 503
    assert TYPO in str(ready["error"]) and "not registered" in str(ready["error"])
    assert predict_status == 503, predict
    error = predict["error"]
    assert isinstance(error, dict) and error["type"] == "UnknownPipeline" and TYPO in error["message"]


def test_a_request_waits_for_workers_that_register_meanwhile(redis_url: str) -> None:
    """A gateway started before its workers (compose starts them together) is not an error."""

    async def main() -> object:
        async with Gateway(redis_url, sizes.name, GatewaySettings(register_wait_s=T)) as gw:
            pending = asyncio.ensure_future(gw.predict(3))
            await asyncio.sleep(0)  # submitted before any worker exists
            with running_workers(redis_url, "tests.error_stages:sizes", ["Make", "Double"]):
                return await asyncio.wait_for(pending, T)

    assert asyncio.run(main()) == b"x" * 6


# -- results too large, or unencodable, name their stage ---------------------------------------


def test_too_large_and_unencodable_results_name_their_stage(redis_url: str) -> None:
    limit = 4096

    async def main() -> dict[object, StageError | object]:
        async with Gateway(redis_url, sizes.name) as gw:
            inputs: list[object] = [10, 3000, 5000, UNENCODABLE_FIRST, UNENCODABLE_LAST]
            outcomes = await asyncio.gather(*(gw.predict(x, timeout_s=T) for x in inputs), return_exceptions=True)
            return dict(zip(inputs, outcomes, strict=True))

    with running_workers(redis_url, "tests.error_stages:sizes", ["Make", "Double"],
                         CONVEYOR_MAX_PAYLOAD_BYTES=str(limit)) as workers:
        workers.wait_ready(sizes.name)
        out = asyncio.run(main())
    assert out[10] == b"x" * 20
    for x, stage, size in [(5000, "Make", 5000), (3000, "Double", 6000)]:  # forwarded / final result
        err = out[x]
        assert isinstance(err, StageError), err
        assert (err.type, err.stage) == ("ResultTooLarge", stage)
        match = re.fullmatch(rf"result of stage '{stage}' too large: (\d+) bytes > max_payload_bytes={limit}",
                             err.message)
        assert match is not None and int(match.group(1)) >= size, err.message  # the size once encoded
    for x, stage in [(UNENCODABLE_FIRST, "Make"), (UNENCODABLE_LAST, "Double")]:
        err = out[x]
        assert isinstance(err, StageError), err
        assert (err.type, err.stage) == ("UnencodableResult", stage)
        assert f"stage {stage!r}" in err.message


def test_a_date_json_cannot_carry_fails_its_request_alone_saying_to_ask_in_msgpack(redis_url: str) -> None:
    """A date past the year 9999 asked as JSON was a 500 saying "unrepresentable numpy.datetime64: 2932897
    days"; now it says to ask in msgpack, and the request beside it in its batch, and the next request on its
    connection, are answered."""
    async def main() -> list[Resp]:
        async with Gateway(redis_url, dates.name, GatewaySettings(timeout_s=T)) as gw:
            server = HttpServer(gw, HttpSettings(port=0))
            await server.start()
            clients = [await Client.open(server.port), await Client.open(server.port)]
            try:  # at once on two connections: gathered into one batch by its deadline (a connection's
                for client, x in zip(clients, ["far", "near"], strict=True):  # pipelined requests go one by one)
                    await client.send(predict_json(x))
                far, near = [await asyncio.wait_for(client.response("POST"), T) for client in clients]
                await clients[0].send(predict_json("after"))
                return [far, near, await asyncio.wait_for(clients[0].response("POST"), T)]
            finally:
                for client in clients:
                    await client.close()
                await server.close()

    with running_workers(redis_url, "tests.error_stages:dates", ["Dates"]) as workers:
        workers.wait_ready(dates.name)
        far, near, after = asyncio.run(main())
    assert far.status == 500, far.body
    error = far.json()["error"]
    assert error["type"] == "UnencodableResult", error
    assert "10000-01-01, outside the years 0000 to 9999" in error["message"], error
    assert "send the request as msgpack (Content-Type: application/msgpack)" in error["message"], error
    assert near.status == 200 and near.json() == {"result": {"day": "2026-11-29T00:00:00", "batch": 2}}, near.body
    assert after.status == 200 and after.json() == {"result": {"day": "2026-11-29T00:00:00", "batch": 1}}, after.body


def test_a_time_at_a_multiplied_unit_is_answered_and_the_gateway_lives_on(redis_url: str, tmp_path: Path) -> None:
    """np.datetime64(100, "2D") asked as JSON killed the gateway (orjson's SIGILL) and every request it held;
    now the time comes at its plain unit (the same day), and the gateway answers the next request."""
    port, log = free_port(), tmp_path / "gateway.log"
    with running_workers(redis_url, "tests.error_stages:times", ["Times"]) as workers:
        workers.wait_ready(times.name)
        with log.open("wb") as out:
            gateway = subprocess.Popen(conveyor_argv("gateway", times.name, "--redis", redis_url, "--port", str(port)),
                                       cwd=REPO_ROOT, env=conveyor_env(), stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            wait_for(lambda: _ready(port), T, "the gateway to be ready", log.read_text)
            odd = _predict_or_none(port, "2D")
            after = _predict_or_none(port, "after")
            died = gateway.poll()
        finally:
            stop_process(gateway)
            gateway.wait(T)
    assert died is None, f"the gateway died (exit {died}): {log.read_text()[-2000:]}"
    assert odd == (200, {"result": "1970-07-20T00:00:00"}), odd  # day 200 (100 of 2 days) from 1970
    assert after == (200, {"result": "after"}), after


def _ready(port: int) -> bool:
    try:
        return http_call(port, "GET", "/readyz", timeout_s=2.0)[0] == 200
    except OSError:
        return False


def _predict_or_none(port: int, x: str) -> tuple[int, object] | None:
    """The status and body of a JSON predict, or None if the gateway answered nothing (it died)."""
    try:
        status, body = http_call(port, "POST", "/v1/predict", json.dumps(x).encode(), timeout_s=T)
    except OSError:
        return None
    return status, json.loads(body)


def test_what_stage_code_raises_beyond_exception_answers_its_item_and_the_worker_lives_on(redis_url: str) -> None:
    """sys.exit(), a KeyboardInterrupt, asyncio's CancelledError, a library's own BaseException, a message
    with a lone surrogate, an exception whose str() raises: each ended the worker at every delivery (six
    restarts, then "its worker crashed")."""
    bad = ["exit", "interrupt", "cancelled", "halt", "surrogate", "unprintable", "huge"]

    async def main() -> list[object]:
        async with Gateway(redis_url, raises.name) as gw:
            return await asyncio.gather(*(gw.predict(x, timeout_s=T) for x in [*bad, "fine"]),
                                        return_exceptions=True)

    with running_workers(redis_url, "tests.error_stages:raises", ["Raises"]) as workers:
        workers.wait_ready(raises.name)
        children = {c.pid for c in psutil.Process(workers.procs[0].popen.pid).children()}
        out = dict(zip([*bad, "fine"], asyncio.run(main()), strict=True))
        assert {c.pid for c in psutil.Process(workers.procs[0].popen.pid).children()} == children  # none replaced
    assert out["fine"] == "fine"
    types = {x: (e.type, e.stage) for x, e in out.items() if isinstance(e, StageError)}
    assert types == {"exit": ("SystemExit", "Raises"), "interrupt": ("KeyboardInterrupt", "Raises"),
                     "cancelled": ("CancelledError", "Raises"), "halt": ("Halt", "Raises"),
                     "surrogate": ("FileNotFoundError", "Raises"), "unprintable": ("Unprintable", "Raises"),
                     "huge": ("ValueError", "Raises")}, out
    assert cast(StageError, out["surrogate"]).message == "no such file: caf\\udce9"
    assert "str() of this Unprintable raised RuntimeError" in cast(StageError, out["unprintable"]).message
    assert len(cast(StageError, out["huge"]).message) < 70_000  # cut, said so
    assert cast(StageError, out["huge"]).message.endswith("more characters cut)")


def test_workers_of_another_definition_of_a_live_pipeline_refuse_to_start(redis_url: str) -> None:
    """A half-done upgrade that adds a stage mixed both definitions' answers, and nothing said so."""
    with running_workers(redis_url, "tests.error_stages:versions_old", ["Make"]) as workers:
        workers.wait_ready("t-versions")
        new = start_worker(redis_url, "tests.error_stages:versions_new", "Double")
        try:
            code = new.popen.wait(timeout=60)  # the supervisor gives up on a worker that never gets ready
        finally:
            stop_process(new.popen)
        log = new.log_path.read_text()
        assert code != 0 and "is registered as Make and 1 of its workers are live" in log, log
        assert "Traceback" not in log
        stored = decode_spec(redis.Redis.from_url(redis_url).get(Keys("t-versions").spec) or b"")
        assert [s.name for s in stored] == [s.name for s in versions_old.stages]  # the old definition stays
        assert asyncio.run(_predict_once(redis_url, "t-versions", 3)) == b"xxx"


async def _predict_once(redis_url: str, pipeline: str, x: object) -> object:
    async with Gateway(redis_url, pipeline) as gw:
        return await gw.predict(x, timeout_s=T)


def test_a_stage_that_meets_a_request_past_its_deadline_raises_a_timeout_error(redis_url: str) -> None:
    """The worker's clock could pass a deadline a moment before the gateway's timer: the caller got a
    StageError where ``except TimeoutError`` was written (10 of 82,000 timeouts in a soak)."""
    keys = Keys("t-late")
    client = redis.Redis.from_url(redis_url)
    client.set(keys.spec, encode_spec([StageInfo(0, "Only")]))

    async def main() -> BaseException:
        async with Gateway(redis_url, "t-late", GatewaySettings(timeout_s=5)) as gw:
            task = asyncio.ensure_future(gw.predict(1, request_id="late-1"))
            entry = await asyncio.to_thread(_first_entry, client, keys.stream(0))
            record = {"id": "late-1", "ok": False, "error": {"type": "DeadlineExceeded", "stage": "Only",
                                                             "message": "deadline passed before the stage ran"}}
            client.rpush(entry[b"reply"], protocol.array_of([codec.encode(record)]))  # as the stage answers
            return (await asyncio.gather(task, return_exceptions=True))[0]

    err = asyncio.run(main())
    assert isinstance(err, TimeoutError) and isinstance(err, DeadlineExceeded) and isinstance(err, StageError)
    assert err.stage == "Only"


def _first_entry(client: redis.Redis, stream: str) -> dict[bytes, bytes]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        entries = client.xrange(stream, count=1)
        if entries:
            return cast(dict[bytes, bytes], entries[0][1])
        time.sleep(0.01)
    raise AssertionError("the request never reached the stream")


# -- conveyor run: a port taken ---------------------------------------------------------------


def test_conveyor_run_on_a_taken_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            conveyor_argv("run", "examples.scale_shift:pipeline", "--port", str(port), "--redis-dir",
                          str(tmp_path / "r")),
            cwd=REPO_ROOT, env=conveyor_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=T)
    err = done.stderr.decode()
    assert done.returncode != 0
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "address already in use" in lines[0] and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0]
    assert not (tmp_path / "r").exists()  # nothing was started


def test_a_second_conveyor_run_of_one_pipeline_says_so_in_one_line(tmp_path: Path) -> None:
    """Two runs would share the socket path: the second one refuses, naming the way out."""
    with EmbeddedRedis(directory=tmp_path / "r", detach=True) as first:
        done = subprocess.run(
            conveyor_argv("run", "examples.scale_shift:pipeline", "--port", "0", "--redis-dir", str(tmp_path / "r")),
            cwd=REPO_ROOT, env=conveyor_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=T)
        assert ping(first.url)  # untouched
    err = done.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert "already answers" in lines[0] and "--redis-dir" in lines[0]
    assert not (tmp_path / "r").exists()  # the first server's stop removed what it made
