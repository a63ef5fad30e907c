"""The process side, for real: crash loops, SIGKILLed workers, SIGTERM/SIGINT, ``conveyor run``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from broker.codec import encode
from broker.keys import GROUP, Keys
from gateway import Gateway
from tests import stages
from tests.helpers import (
    REPO_ROOT,
    WorkerProc,
    alive,
    conveyor_argv,
    conveyor_env,
    descendants,
    http_call,
    kill_group,
    running_workers,
    start_worker,
    stop_process,
    wait_for,
    wait_ready,
)
from workers.process.procs import REPEAT_WITHIN_S

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0


def test_a_stage_whose_setup_keeps_failing_makes_conveyor_worker_exit_non_zero(redis_url: str, tmp_path: Path) -> None:
    proc = start_worker(redis_url, "tests.stages:crash", "BrokenSetup", log_dir=tmp_path)
    code = proc.exit_code(T, "a crash loop")
    log = proc.log()
    assert code != 0, log
    assert "model file is missing" in log
    assert "failed to start 3 times in a row (exit codes 3,3,3): giving up" in log, log  # 3: setup() raised
    assert log.count("started worker") >= 2  # it was retried before giving up
    assert descendants(proc.pid) == []


def holder_of_pending(client: redis.Redis, stream: str) -> bytes | None:
    """The consumer that holds the stream's only pending entry, if exactly one is pending."""
    rows = client.xpending_range(stream, GROUP, "-", "+", 10)
    return rows[0]["consumer"] if len(rows) == 1 else None


def test_sigkilled_worker_is_replaced_and_requests_still_succeed(redis_url: str, redis_client: redis.Redis) -> None:
    stream = Keys("t-sleepy").stream(0)
    with running_workers(redis_url, "tests.stages:sleepy", [("Sleepy", 2)]) as workers:
        workers.wait_ready("t-sleepy", T, workers={"Sleepy": 2})
        supervisor = workers.stage("Sleepy")
        before = supervisor.children()
        assert len(before) == 2

        async def main() -> tuple[Any, list[Any], psutil.Process]:
            async with Gateway(redis_url, "t-sleepy") as gw:
                slow = asyncio.ensure_future(gw.predict(-1.0))  # holds its worker for 1 s
                consumer = await asyncio.to_thread(wait_for, lambda: holder_of_pending(redis_client, stream), T,
                                                   "a worker to take the slow request")
                victim = next(p for p in before if consumer.decode() in p.cmdline())
                victim.kill()  # SIGKILL while it holds the slow request: only its successor can finish it
                rest = await asyncio.gather(*(gw.predict(x) for x in range(200)))
                # well before claim_idle_s (30 s): the successor drained its slot's pending entry
                return await asyncio.wait_for(slow, 10), rest, victim

        slow, rest, victim = asyncio.run(asyncio.wait_for(main(), 2 * T))
        assert slow == 0.0
        assert rest == [x + 1 for x in range(200)]
        # A new worker took the dead one's place (same slot, new pid); the other one lived on.
        after = wait_for(lambda: (c := supervisor.children()) and len(c) == 2 and victim.pid not in
                         {p.pid for p in c} and c, T, "a replacement worker", supervisor.report)
        survivor = next(p for p in before if p.pid != victim.pid)
        assert survivor.pid in {p.pid for p in after}
        assert "code=-9" in supervisor.log() and "restart_in=" in supervisor.log()
        assert redis_client.xpending(stream, GROUP)["pending"] == 0
        # The replacement is the same consumer (a stable name per slot), and each worker process
        # ran setup() exactly once.
        assert len(redis_client.xinfo_consumers(stream, GROUP)) == 2
        setups = [int(pid) for pid in redis_client.lrange(stages.Sleepy.setups_key, 0, -1)]
        assert sorted(setups) == sorted(p.pid for p in [*before, *(p for p in after if p.pid != survivor.pid)])


def test_sigterm_stops_conveyor_worker_cleanly_mid_traffic(redis_url: str, redis_client: redis.Redis,
                                                           tmp_path: Path) -> None:
    """SIGTERM: workers finish the item in hand, commit, exit; nothing stays pending, nothing
    is lost: what was not taken yet waits in the stream for the next workers."""
    stream = Keys("t-sleepy").stream(0)
    proc = start_worker(redis_url, "tests.stages:sleepy", "Sleepy", workers=2, log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-sleepy", T, workers={"Sleepy": 2}, diagnostics=proc.report)
        children = proc.children()
        assert len(children) == 2

        async def main() -> list[Any]:
            async with Gateway(redis_url, "t-sleepy") as gw:
                tasks = [asyncio.ensure_future(gw.predict(x)) for x in range(300)]
                first = await asyncio.wait_for(asyncio.shield(tasks[0]), T)
                assert first == 1
                stop_process(proc.popen)  # SIGTERM while items are in flight
                code = await asyncio.to_thread(proc.popen.wait, T)
                assert code == 0, proc.report()
                assert alive(children) == []
                assert redis_client.xpending(stream, GROUP)["pending"] == 0
                assert redis_client.xlen(stream) > 0, "everything was processed before the stop took effect"
                # the next workers pick up where these left off
                with running_workers(redis_url, "tests.stages:sleepy", [("Sleepy", 2)]):
                    return await asyncio.wait_for(asyncio.gather(*tasks), T)

        assert asyncio.run(main()) == [x + 1 for x in range(300)]
    finally:
        if proc.popen.poll() is None:
            kill_group(proc.popen)


def test_another_stop_request_while_workers_finish_their_batch_kills_them(redis_url: str, redis_client: redis.Redis,
                                                                         tmp_path: Path) -> None:
    """A second SIGTERM (a third Ctrl-C under `conveyor run`) while a worker finishes a long batch was
    ignored: the supervisor waited out the batch, up to grace_s. It now kills the worker at once; what it
    held stays pending, to be delivered again."""
    stream = Keys("t-sleepy").stream(0)
    proc = start_worker(redis_url, "tests.stages:sleepy", "Sleepy", workers=1, log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-sleepy", T, workers={"Sleepy": 1}, diagnostics=proc.report)

        redis_client.xadd(stream, {"id": "long-1", "data": encode(-60), "v": "1"})  # a foreign producer's
        wait_for(lambda: redis_client.xpending(stream, GROUP)["pending"] == 1, T, "the worker holding it", proc.report)
        proc.popen.send_signal(signal.SIGINT)  # Ctrl-C, then again at once: both count (only SIGHUP pairs are one)
        wait_for(lambda: "finish their batch" in proc.log_path.read_text(), T, "the workers' stop", proc.report)
        asked = time.monotonic()
        proc.popen.send_signal(signal.SIGINT)
        proc.popen.wait(T)
        assert time.monotonic() - asked < 5, proc.report()
        assert "another stop request: killing it" in proc.log_path.read_text(), proc.report()
        assert redis_client.xpending(stream, GROUP)["pending"] == 1  # not lost: delivered again to the next
    finally:
        if proc.popen.poll() is None:
            kill_group(proc.popen)


def test_a_stop_said_twice_at_once_still_lets_the_workers_finish_their_batch(redis_url: str, redis_client: redis.Redis,
                                                                             tmp_path: Path) -> None:
    """A closed terminal sends SIGHUP twice, milliseconds apart: taken as two requests, the second killed the
    workers mid-batch. One stop said twice is one stop: the batch is finished and committed."""
    stream = Keys("t-sleepy").stream(0)
    proc = start_worker(redis_url, "tests.stages:sleepy", "Sleepy", workers=1, log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-sleepy", T, workers={"Sleepy": 1}, diagnostics=proc.report)
        redis_client.xadd(stream, {"id": "twice-1", "data": encode(-2), "v": "1"})
        wait_for(lambda: redis_client.xpending(stream, GROUP)["pending"] == 1, T, "the worker holding it", proc.report)
        proc.popen.send_signal(signal.SIGHUP)
        first = time.monotonic()
        wait_for(lambda: "finish their batch" in proc.log_path.read_text(), T, "the workers' stop", proc.report)
        if time.monotonic() - first > REPEAT_WITHIN_S - 0.05:  # with a margin
            pytest.skip("the stop phase began too late to repeat the stop within REPEAT_WITHIN_S of the first")
        proc.popen.send_signal(signal.SIGHUP)  # the same stop again, the workers already told to stop
        assert proc.popen.wait(T) == 0, proc.report()
        assert "killing" not in proc.log(), proc.report()
        assert redis_client.xpending(stream, GROUP)["pending"] == 0  # finished and committed
    finally:
        if proc.popen.poll() is None:
            kill_group(proc.popen)


def test_what_a_worker_forked_does_not_outlive_a_clean_stop(redis_url: str, redis_client: redis.Redis,
                                                             tmp_path: Path) -> None:
    redis_client.delete(stages.Forking.helper_key)
    proc = start_worker(redis_url, "tests.stages:forking", "Forking", workers=1, log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-forking", T, workers={"Forking": 1}, diagnostics=proc.report)
        helper = int(redis_client.lindex(stages.Forking.helper_key, 0) or 0)
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(T) == 0, proc.report()
        wait_for(lambda: not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE,
                 T, "the worker's helper gone with it", proc.report)
    finally:
        _end_forking(proc, redis_client)


def _end_forking(proc: WorkerProc, redis_client: redis.Redis) -> None:
    """The Forking stage's supervisor and every helper its workers forked, gone whatever the test did."""
    if proc.popen.poll() is None:
        kill_group(proc.popen)
    for pid in redis_client.lrange(stages.Forking.helper_key, 0, -1):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    redis_client.delete(stages.Forking.helper_key)


def test_a_stop_with_stuck_detection_off_waits_for_a_batch_past_its_deadlines(redis_url: str,
                                                                             redis_client: redis.Redis,
                                                                             tmp_path: Path) -> None:
    """stuck_grace_s=None (calls this long are meant): a SIGTERM while a batch ran past its items' deadlines
    crashed the supervisor (TypeError formatting None), leaving the worker running and exiting 1."""
    stream = Keys("t-patient").stream(0)
    proc = start_worker(redis_url, "tests.stages:patient", "Patient", log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-patient", T, workers={"Patient": 1}, diagnostics=proc.report)
        deadline_ms = int(time.time() * 1000) + 300
        redis_client.xadd(stream, {"id": "late-1", "data": encode(-3), "deadline_ms": str(deadline_ms), "v": "1"})
        wait_for(lambda: redis_client.xpending(stream, GROUP)["pending"] == 1, T, "the worker holding it", proc.report)
        wait_for(lambda: time.time() * 1000 > deadline_ms + 300, T, "its deadline passed")
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(T) == 0, proc.report()
        assert "Traceback" not in proc.log() and "killing" not in proc.log(), proc.report()
        assert redis_client.xpending(stream, GROUP)["pending"] == 0  # its batch finished and committed
    finally:
        if proc.popen.poll() is None:
            kill_group(proc.popen)


def test_a_worker_dead_while_a_process_it_forked_lives_is_restarted_and_its_helper_killed(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    """The supervisor heard of a death only from its status pipe closing; a helper forked by setup() holds
    the pipe, so a dead worker was never restarted (its stage one worker short until a restart by hand)."""
    proc = start_worker(redis_url, "tests.stages:forking", "Forking", workers=1, log_dir=tmp_path)
    try:
        wait_ready(redis_url, "t-forking", T, workers={"Forking": 1}, diagnostics=proc.report)
        helper = int(redis_client.lindex(stages.Forking.helper_key, 0) or 0)
        assert psutil.pid_exists(helper)

        async def main() -> int:
            async with Gateway(redis_url, "t-forking") as gw:
                with contextlib.suppress(Exception):  # its worker dies: dead-lettered or timed out
                    await gw.predict(-1, timeout_s=3)
                return int(await gw.predict(1, timeout_s=T))  # served by the worker started again

        assert asyncio.run(main()) == 2, proc.report()
        assert "worker exited" in proc.log(), proc.report()
        wait_for(lambda: not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE,
                 T, "the dead worker's helper killed", proc.report)
    finally:
        _end_forking(proc, redis_client)


def test_a_stop_while_the_model_loads_does_not_wait_for_the_load(redis_url: str, redis_client: redis.Redis,
                                                                 tmp_path: Path) -> None:
    """A worker in setup() has read nothing: SIGTERM waited for its minute of loading (then grace_s, then
    SIGKILL), three Ctrl-Cs in a row included."""
    redis_client.delete(stages.SlowSetup.began_key)
    proc = start_worker(redis_url, "tests.stages:slow_setup", "SlowSetup", log_dir=tmp_path)
    try:
        wait_for(lambda: redis_client.llen(stages.SlowSetup.began_key) == 1, T, "the model's load begun", proc.report)
        asked = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(T) == 0, proc.report()
        assert time.monotonic() - asked < 5, proc.report()
        assert "stopped while its stage's setup() ran" in proc.log(), proc.report()
    finally:
        if proc.popen.poll() is None:
            kill_group(proc.popen)


# -- conveyor run ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ready(port: int) -> bool:
    try:
        return http_call(port, "GET", "/readyz")[0] == 200
    except OSError:
        return False


class Lines(threading.Thread):
    """Reads a pipe line by line into a queue, so the test can wait for a line with a bound."""

    def __init__(self, pipe: Any) -> None:
        super().__init__(daemon=True)
        self.pipe = pipe
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []

    def run(self) -> None:
        for raw in iter(self.pipe.readline, b""):
            self.lines.put(raw.decode(errors="replace"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s:g}s: {self.seen}")


@pytest.fixture
def run_log() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="conveyor-run-test-") as d:
        yield Path(d) / "stderr.log"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_conveyor_run_serves_and_stops_without_leftovers(sig: signal.Signals, run_log: Path) -> None:
    port = free_port()
    with run_log.open("wb") as err:
        popen = subprocess.Popen(conveyor_argv("run", "examples.scale_shift:pipeline", "--port", str(port),
                                               "--redis-dir", str(run_log.parent / "redis")),
                                 cwd=REPO_ROOT, env=conveyor_env(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    lines = Lines(popen.stdout)
    lines.start()

    def report() -> str:
        return f"exit={popen.poll()}\nstdout={lines.seen}\n{run_log.read_text(errors='replace')[-4000:]}"

    try:
        url = lines.wait_for(r"Redis at (unix://\S+)", T).group(1)
        redis_dir = Path(url.removeprefix("unix://")).parent
        assert redis_dir.is_dir()
        wait_for(lambda: popen.poll() is not None or http_ready(port), T, "the gateway's /readyz", report)
        assert popen.poll() is None, report()

        status, body = http_call(port, "POST", "/v1/predict", b"3")
        assert (status, json.loads(body)) == (200, {"result": 9}), report()
        status, body = http_call(port, "POST", "/v1/predict", b'"a"')  # "a" * 2 is "aa"; "aa" + 3 raises
        assert status == 422, body
        assert json.loads(body)["error"]["type"] == "TypeError" and json.loads(body)["error"]["stage"] == "Shift"

        tree = descendants(popen.pid)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "redis-server" in names and "gateway" in names and names.count("workers.process.child") == 3, names

        os.kill(popen.pid, sig)
        code = popen.wait(timeout=T)
        assert code == 0, report()
        assert alive(tree) == [], [p.cmdline() for p in alive(tree)]
        assert not redis_dir.exists(), f"embedded Redis left {redis_dir} behind"
    finally:
        if popen.poll() is None:
            kill_group(popen)
        lines.join(timeout=5)
        if popen.stdout is not None:
            popen.stdout.close()
