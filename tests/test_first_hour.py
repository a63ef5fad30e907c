"""A new user's first hour, broken on purpose: a hung stage, a stage that raises, a batched predict
that miscounts, a Redis that cannot be reached, an input too large. Each must be said clearly, where
the user looks, and lose nothing else (real workers, real Redis)."""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import redis

from broker.connection import unreachable
from broker.keys import Keys
from gateway import Gateway, GatewaySettings, PayloadTooLarge
from gateway.cli import format_status
from gateway.http.server import HttpServer, HttpSettings
from gateway.monitor.metrics import Metrics
from tests.helpers import (
    REPO_ROOT,
    conveyor_argv,
    conveyor_env,
    http_call,
    read_pipeline_status,
    running_workers,
    wait_for,
)

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.first_hour_stages"
NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens there


def _stuck_scenario(redis_url: str, runs: Path) -> None:
    """A request that hangs its stage's only worker, and three behind it, all with 1 s deadlines."""
    async def scenario() -> list[BaseException | object]:
        async with Gateway(redis_url, "t-hangs", GatewaySettings(timeout_s=1.0)) as gw:
            hung = asyncio.ensure_future(gw.predict("hang"))
            await asyncio.to_thread(wait_for, lambda: runs.exists() and "hang" in runs.read_text(), 10,
                                    "the worker started the hanging call")
            behind = [asyncio.ensure_future(gw.predict(f"behind-{i}")) for i in range(3)]
            return list(await asyncio.gather(hung, *behind, return_exceptions=True))

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes


def test_a_worker_that_stops_is_no_longer_counted_live(redis_url: str, redis_client: redis.Redis) -> None:
    """A clean stop takes the worker out of its stage's heartbeats: `conveyor status` and the live gauge
    said it live ~5 s after it exited (an autoscaling step down looked undone)."""
    hb = Keys("t-hangs").heartbeats(0)
    with running_workers(redis_url, f"{APP}:hangs", ["hangs"]) as workers:
        workers.wait_ready("t-hangs")
        assert redis_client.zcard(hb) == 1
    assert redis_client.zcard(hb) == 0  # the supervisor has exited: its worker said goodbye first


def test_a_worker_frozen_between_batches_is_replaced(redis_url: str) -> None:
    """A worker stopped while idle (SIGSTOP: its heartbeat stops, no batch is in hand for the deadlines to
    watch) was shown NOT LIVE for ever while its supervisor, its parent, did nothing: the stage stayed down.
    Its stamp of life goes stale; past frozen_after_s (10 s) it is logged, killed and replaced."""
    import psutil

    with running_workers(redis_url, f"{APP}:hangs", ["hangs"]) as workers:
        workers.wait_ready("t-hangs")
        supervisor = workers.stage("hangs")
        [child] = psutil.Process(supervisor.popen.pid).children()
        child.send_signal(signal.SIGSTOP)
        log = wait_for(lambda: "worker frozen" in supervisor.log(50_000) and supervisor.log(50_000), 30,
                       "the supervisor replaces the frozen worker", supervisor.report)
        line = next(line for line in log.splitlines() if "worker frozen" in line)
        assert "no sign of life for 1" in line and f"pid={child.pid}" in line and "stage=hangs" in line, line
        workers.wait_ready("t-hangs", 30)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE

        async def serve() -> object:
            async with Gateway(redis_url, "t-hangs", GatewaySettings(timeout_s=10)) as gw:
                return await gw.predict("again")

        assert asyncio.run(serve()) == "again"


def test_a_hung_stage_is_reported_shown_and_replaced(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:hangs", ["hangs"], FIRST_HOUR_RUNS=str(runs)) as workers:
        workers.wait_ready("t-hangs")
        _stuck_scenario(redis_url, runs)
        supervisor = workers.stage("hangs")
        log = wait_for(lambda: "worker stuck" in supervisor.log(50_000) and supervisor.log(50_000), 15,
                       "the supervisor reports the stuck worker", supervisor.report)
        lines = log.splitlines()
        at = next(n for n, line in enumerate(lines) if "worker stuck" in line)
        line = lines[at]
        assert "stage=hangs" in line and "consumer=hangs@" in line and "stuck_grace_s" in line
        # The stuck call's stack follows the record's line, a line per frame, indented, and is said once.
        stack = list(itertools.takewhile(lambda row: row.startswith("  "), lines[at + 1:]))
        assert any("first_hour_stages.py" in row and row.rstrip().endswith("in predict") for row in stack), log
        assert any(row.strip().startswith("Current thread") for row in stack), stack
        assert log.count("first_hour_stages.py") == 1 and "\\n" not in line, log

        # While its replacement loads, status shows the worker stuck and the pipeline not ready.
        status = asyncio.run(read_pipeline_status(redis_url, "t-hangs"))
        assert [c.stuck_since_ms is not None for c in status.stages[0].consumer_details] == [True]
        assert "STUCK since" in format_status("t-hangs", status)
        assert not status.ready and "stage hangs" in status.not_ready_stages[0]

        # Then the stage serves again, and the requests that waited behind it past their deadline never ran.
        workers.wait_ready("t-hangs", 20)

        async def again() -> object:
            async with Gateway(redis_url, "t-hangs", GatewaySettings(timeout_s=10.0)) as gw:
                return await gw.predict("ok")

        assert asyncio.run(again()) == "ok"
        assert "behind" not in runs.read_text()
        assert not asyncio.run(read_pipeline_status(redis_url, "t-hangs")).stages[0].stuck_workers


def test_wrong_length_batches_are_logged_once_and_counted(redis_url: str, redis_client: redis.Redis) -> None:
    with running_workers(redis_url, f"{APP}:miscounts", ["miscounts"]) as workers:
        workers.wait_ready("t-miscounts")

        async def load() -> tuple[list[object], bytes]:
            async with Gateway(redis_url, "t-miscounts", GatewaySettings(timeout_s=20.0)) as gw:
                answers = []
                for _ in range(3):  # several rounds: several bad batches, one log line
                    answers += await asyncio.gather(*(gw.predict(i) for i in range(16)))
                await asyncio.to_thread(wait_for, lambda: redis_client.hget(
                    Keys("t-miscounts").counts(0), "batch_length_errors"), 10, "the count reaches Redis")
                await asyncio.wait_for(gw.views.refreshed(), 10)  # and the gateway's view of it (read every second)
                metrics = Metrics(gw)
                await metrics.refresh()
                return answers, metrics.render()

        answers, metrics = asyncio.run(load())
        assert answers == list(range(16)) * 3  # isolation kept every answer right
        log = workers.stage("miscounts").log(50_000)
        lines = [line for line in log.splitlines() if "returned the wrong number of results" in line]
        assert len(lines) == 1 and "stage=miscounts" in lines[0] and "expected=" in lines[0], lines
        found = re.search(rb'conveyor_stage_batch_length_errors\{index="0",pipeline="t-miscounts",'
                          rb'stage="miscounts"\} (\d+)', metrics)
        assert found and int(found.group(1)) >= 3, metrics.decode()


def test_a_stage_that_raises_is_logged_at_the_worker(redis_url: str, redis_client: redis.Redis) -> None:
    with running_workers(redis_url, f"{APP}:raises", ["raises"]) as workers:
        workers.wait_ready("t-raises")

        async def calls() -> list[BaseException | object]:
            async with Gateway(redis_url, "t-raises", GatewaySettings(timeout_s=20.0)) as gw:
                return list(await asyncio.gather(*(gw.predict(i) for i in range(5)), return_exceptions=True))

        assert all(type(o).__name__ == "StageError" for o in asyncio.run(calls()))
        wait_for(lambda: int(redis_client.hget(Keys("t-raises").counts(0), "stage_errors") or 0) == 5, 10,
                 "the errors are counted in Redis")
        lines = [line for line in workers.stage("raises").log(50_000).splitlines() if "stage raised" in line]
        assert len(lines) == 1, lines  # the same error five times: said once a minute, not five times
        assert all(f in lines[0] for f in ("stage=raises", "request=", "type=ValueError", "cannot take"))


def test_an_input_too_large_is_refused_before_redis(redis_url: str, redis_client: redis.Redis) -> None:
    """Refused at the gateway with the workers' own limit (from the spec): nothing written, 413."""
    stream = Keys("scale-shift").stream(0)
    with running_workers(redis_url, "examples.scale_shift:pipeline", ["Scale", "Shift"],
                         CONVEYOR_MAX_PAYLOAD_BYTES="2000") as workers:
        workers.wait_ready("scale-shift")

        async def scenario() -> tuple[int, bytes]:
            async with Gateway(redis_url, "scale-shift", GatewaySettings(timeout_s=10.0)) as gw:
                assert await gw.predict(np.arange(10)) is not None  # a small one passes
                with pytest.raises(PayloadTooLarge, match="max_payload_bytes=2000"):
                    await gw.predict(np.zeros(1000))
                server = HttpServer(gw, HttpSettings(port=0))
                await server.start()
                try:
                    body = ("[" + ",".join(["0.5"] * 1000) + "]").encode()  # 4 kB of JSON, 9 kB as msgpack
                    return await asyncio.to_thread(http_call, server.port, "POST", "/v1/predict", body)
                finally:
                    await server.close()

        before = redis_client.xinfo_stream(stream)["entries-added"]
        status, body = asyncio.run(scenario())
        assert status == 413 and b"max_payload_bytes=2000" in body
        assert redis_client.xinfo_stream(stream)["entries-added"] == before + 1  # only the small one


@pytest.mark.unit
def test_a_gateway_used_before_start_says_so() -> None:
    """A Gateway used outside ``async with`` (or before ``start()``): one clear error in the caller's
    stack, not an IndexError and a background task that dies on a missing connection."""
    async def scenario() -> None:
        gw = Gateway(NOWHERE, "scale-shift")
        with pytest.raises(RuntimeError, match=r"not started, or closed: use `async with Gateway"):
            await gw.predict(3)
        await asyncio.sleep(0)  # a background task started by the call would fail here
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await gw.close()

    asyncio.run(scenario())


@pytest.mark.unit
@pytest.mark.parametrize("timeout_s", ["5", True, 0, float("nan"), -1])
def test_a_timeout_that_is_no_positive_number_is_a_value_error(timeout_s: object) -> None:
    async def scenario() -> None:
        gw = Gateway(NOWHERE, "scale-shift")
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            await gw.predict(3, timeout_s=timeout_s)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_gateway_used_after_close_says_so_at_once(redis_url: str) -> None:
    """Not after the request's timeout: its lanes went with the close."""
    async def scenario() -> None:
        async with Gateway(redis_url, "never-registered", GatewaySettings(timeout_s=30)) as gw:
            pass
        for call in (gw.predict(3), anext(gw.stream(3))):
            with pytest.raises(RuntimeError, match="not started, or closed"):
                await asyncio.wait_for(call, 5)

    asyncio.run(scenario())


def test_a_gateway_used_from_another_event_loop_says_so_before_sending(redis_url: str) -> None:
    """Started on one loop, awaited on another (two ``asyncio.run`` calls, a thread's loop): the request
    went out, then its caller got asyncio's "attached to a different loop", so a retry ran it twice."""
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    gw = Gateway(redis_url, "t-two-loops", GatewaySettings(timeout_s=5))
    try:
        asyncio.run_coroutine_threadsafe(gw.start(), home).result(10)

        async def elsewhere() -> None:
            for call in (gw.predict(3), anext(gw.stream(3))):
                with pytest.raises(RuntimeError, match="started on another event loop"):
                    await asyncio.wait_for(call, 5)
            assert gw.in_flight == 0

        asyncio.run(elsewhere())
    finally:
        asyncio.run_coroutine_threadsafe(gw.close(), home).result(10)
        home.call_soon_threadsafe(home.stop)
        thread.join(10)
        home.close()


def test_a_gateway_started_again_after_close_never_hands_a_new_caller_an_old_answer(redis_url: str) -> None:
    """start() after close() reused the gateway's id, and its lanes' counters began again: the run of a
    request left in flight answered the first request after the restart, which took it as its own."""
    with running_workers(redis_url, "tests.stream_stages:slow", ["Slow"]) as workers:
        workers.wait_ready("t-slow")

        async def scenario() -> None:
            gw = Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=10))
            await gw.start()
            old = gw.submit("old")  # its run takes 0.1 s
            await asyncio.sleep(0.03)
            await gw.close()
            with pytest.raises(ConnectionError):
                await old
            await gw.start()
            try:
                assert await asyncio.wait_for(gw.predict("new"), 10) == "new"
            finally:
                await gw.close()

        asyncio.run(scenario())


def test_a_second_start_and_a_wrong_partition_count_are_refused_clearly(redis_url: str) -> None:
    """A second start() opened another hub, failed with MaxConnectionsError and closed the first (its requests
    failed); Gateway(partitions=3) on a pipeline of one sent two thirds of the requests where no worker reads."""
    with running_workers(redis_url, "tests.stream_stages:slow", ["Slow"]) as workers:
        workers.wait_ready("t-slow")

        async def scenario() -> None:
            async with Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=10)) as gw:
                pending = gw.submit("kept")
                with pytest.raises(RuntimeError, match="already started"):
                    await gw.start()
                assert await pending == "kept"
            with pytest.raises(ValueError, match=r"partitions=3.*whose spec says 1"):
                async with Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=10), partitions=3):
                    pass

        asyncio.run(scenario())


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def test_status_says_which_redis_and_one_line_when_unreachable(redis_url: str) -> None:
    done = _run(conveyor_argv("status", "nothere", "--redis", "redis://someone:secret@127.0.0.1:1/0"), conveyor_env())
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr, done.stderr
    assert "cannot reach Redis at redis://someone:***@127.0.0.1:1/0" in done.stderr and "secret" not in done.stderr
    done = _run(conveyor_argv("status", "nothere"), conveyor_env(redis_url))
    assert done.returncode == 1 and f"[redis: {redis_url}]" in done.stdout and "not registered" in done.stdout


def test_status_at_a_port_that_does_not_speak_redis_says_so_in_one_line() -> None:
    """A URL naming another service (an HTTP server on a wrong port) ended `conveyor status` with redis-py's
    InvalidResponse traceback and exit 1 instead of the unreachable line and exit 2."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"redis://127.0.0.1:{server.server_address[1]}/0"
        done = _run(conveyor_argv("status", "scale-shift", "--redis", url), conveyor_env())
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and f"cannot reach Redis at {url}" in done.stderr, done.stderr


def test_a_redis_that_refuses_our_password_is_not_called_unreachable() -> None:
    """A password missing from the URL read "cannot reach Redis ... is the server running?"."""
    url = "redis://127.0.0.1:6390/0"
    hello = "HELLO must be called with the client already authenticated, otherwise the HELLO AUTH ..."
    for exc in (redis.AuthenticationError(hello), RuntimeError(f"redis unreachable: {hello}"),
                redis.ResponseError("WRONGPASS invalid username-password pair or user is disabled.")):
        said = unreachable(url, exc)
        assert said.startswith(f"Redis at {url} refused the connection's credentials") and "PASSWORD@" in said
    assert unreachable(url, ConnectionRefusedError("refused")).startswith("cannot reach Redis")


@pytest.mark.parametrize("command", ["gateway", "worker", "run"])
def test_long_running_commands_wait_for_redis_in_one_line(command: str, tmp_path: Path) -> None:
    """No traceback, the URL and what to check, retries; a worker never says ready; a stop ends it."""
    argv = {"gateway": conveyor_argv("gateway", "scale-shift", "--port", "0"),
            "worker": conveyor_argv("worker", "examples.scale_shift:pipeline", "--stage", "Shift"),
            "run": conveyor_argv("run", "examples.scale_shift:pipeline", "--port", "0")}[command]
    log_path = tmp_path / "out.log"
    with log_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=conveyor_env(NOWHERE), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: "cannot reach Redis at redis://127.0.0.1:1/0" in log_path.read_text(), 20,
                 "the one-line message", log_path.read_text)
        assert proc.poll() is None, f"{command} gave up:\n{log_path.read_text()}"
        proc.send_signal(signal.SIGINT if command == "run" else signal.SIGTERM)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "Traceback" not in text and "worker ready" not in text, text
    assert "is the server running, and is the URL right (--redis or CONVEYOR_REDIS_URL)?" in text
