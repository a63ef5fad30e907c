"""A stage's ``setup()`` that never returns (a deadlocked thread pool, a stalled file system), for real.

It was shown "loading" by ``conveyor status`` for ever, nothing in the log, the stage a worker short and
its requests waiting their whole deadline. Now a worker slow to be ready is warned of every
``loading_warn_every_s`` (a minute), and past its stage's ``setup_timeout_s`` it is logged with its stack,
killed with what it forked and replaced, counted as a failed start (so a stage whose setup always hangs
ends ``conveyor worker`` as a crash loop does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis

from broker.connection import RedisSettings
from gateway import Gateway, GatewaySettings
from tests.helpers import alive, descendants, running_workers, start_worker, wait_for
from workers import Pipeline, Stage
from workers.process.child import ChildSettings
from workers.process.starts import SlowStarts
from workers.process.supervisor import Supervisor, SupervisorSettings, Unit, WorkerSlot
from workers.process.watch import BusyCell, StuckWatch

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0
STARTS_KEY = "t:t-setup-hangs:starts"  # a worker's pid, as its setup() begins
HELPERS_KEY = "t:t-setup-hangs:helpers"  # the pid of a process its setup() forked
GO_KEY = "t:t-setup-slow:go"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])


class HangsFirst(Stage):
    """Its first worker's setup() forks a helper and then hangs for ever; the next ones load at once."""

    always = False

    def setup(self) -> None:
        client = _redis()
        try:
            first = client.rpush(STARTS_KEY, os.getpid()) == 1
            if first or self.always:
                helper = subprocess.Popen(["sleep", "300"])  # in the worker's process group
                client.rpush(HELPERS_KEY, helper.pid)
        finally:
            client.close()
        if first or self.always:
            threading.Event().wait()

    def predict(self, x: int) -> int:
        return x + 1


class AlwaysHangs(HangsFirst):
    always = True


class SlowSetup(Stage):
    """Loads once the test says so (BLPOP), bounded."""

    def setup(self) -> None:
        client = _redis()
        try:
            client.blpop([GO_KEY], timeout=T)
        finally:
            client.close()

    def predict(self, x: int) -> int:
        return x


hangs_first = Pipeline("t-setup-hangs").add(HangsFirst, name="hangs", setup_timeout_s=1)
always_hangs = Pipeline("t-setup-hangs").add(AlwaysHangs, name="hangs", setup_timeout_s=1)
slow = Pipeline("t-setup-slow").add(SlowSetup, name="load")


def _pids(client: redis.Redis, key: str) -> list[int]:
    return [int(p) for p in client.lrange(key, 0, -1)]


def _gone(pid: int) -> bool:
    try:
        return not alive([psutil.Process(pid)])
    except psutil.NoSuchProcess:
        return True


def test_a_setup_that_hangs_is_reported_and_replaced_and_the_stage_serves(redis_url: str,
                                                                        redis_client: redis.Redis) -> None:
    with running_workers(redis_url, "tests.test_setup_timeout:hangs_first", ["hangs"]) as workers:
        supervisor = workers.stage("hangs")
        workers.wait_ready("t-setup-hangs", T)
        first, second = _pids(redis_client, STARTS_KEY)
        log = supervisor.log(50_000)
        line = next(row for row in log.splitlines() if "worker stuck in setup()" in row)
        assert "setup_timeout_s=1s" in line and f"pid={first}" in line and "stage=hangs" in line, log
        assert "test_setup_timeout.py" in log and "in setup" in log, log  # its stack, where it hangs
        assert f"pid={first} code=-9 ready=false restart_in=" in log, log  # a failed start, restarted
        # What its setup() forked died with it (its process group), and it never beat: no stuck mark.
        [helper] = _pids(redis_client, HELPERS_KEY)
        wait_for(lambda: _gone(helper), T, "the hung worker's helper killed", supervisor.report)
        assert _gone(first) and not _gone(second)
        assert redis_client.zcard("conveyor:{t-setup-hangs}:stuck:0") == 0

        async def serve() -> object:
            async with Gateway(redis_url, "t-setup-hangs", GatewaySettings(timeout_s=10)) as gw:
                return await gw.predict(41)

        assert asyncio.run(serve()) == 42


def test_a_setup_that_always_hangs_ends_conveyor_worker_as_a_crash_loop(redis_url: str, redis_client: redis.Redis,
                                                                        tmp_path: Path) -> None:
    proc = start_worker(redis_url, "tests.test_setup_timeout:always_hangs", "hangs", log_dir=tmp_path)
    code = proc.exit_code(T, "its hung setups")
    log = proc.log(50_000)
    assert code == 1, log
    assert log.count("worker stuck in setup()") == 3, log
    assert re.search(r"failed to start 3 times in a row \(exit codes -?\d+,-?\d+,-?\d+\): giving up", log), log
    assert len(_pids(redis_client, STARTS_KEY)) == 3
    assert descendants(proc.pid) == [] and all(_gone(p) for p in _pids(redis_client, HELPERS_KEY)), log


def _supervise(supervisor: Supervisor, watch: Callable[[], None]) -> int:
    """Run ``supervisor`` here (its loop wants the main thread) while ``watch`` runs in a thread; stopped when
    ``watch`` ends, whatever it did; its failure raised here."""
    failures: list[BaseException] = []

    def run_watch() -> None:
        try:
            watch()
        except BaseException as exc:
            failures.append(exc)
        finally:
            supervisor.request_stop()

    thread = threading.Thread(target=run_watch, daemon=True)
    thread.start()
    code = supervisor.run()
    thread.join(T)
    if failures:
        raise failures[0]
    return code


def test_a_worker_slow_to_load_is_warned_of_until_it_is_ready(redis_url: str, redis_client: redis.Redis,
                                                               caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_REDIS_URL", redis_url)  # the stage's own client, in the worker
    caplog.set_level(logging.INFO, logger="conveyor.supervisor")
    unit = Unit("tests.test_setup_timeout:slow", slow.stage("load"), 1, slow.keys)
    supervisor = Supervisor([unit], ChildSettings(redis_url=redis_url), SupervisorSettings(loading_warn_every_s=0.5))

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(text)]

    in_setup = "in setup(); never replaced for it (the stage sets no setup_timeout_s)"

    def watch() -> None:
        # Two warnings while in setup(); on a loaded machine the app's import may take a warning or two before it.
        wait_for(lambda: sum(in_setup in t for t in said("worker still loading")) >= 2, T, "two warnings in setup()")
        warnings = said("worker still loading")
        [worker] = [p for p in psutil.Process().children() if "workers.process.child" in " ".join(p.cmdline())]
        for text in warnings:
            assert f"stage=load slot=0 pid={worker.pid} loading_s=" in text, text
            assert in_setup in text or "not in setup() yet (importing the app" in text, text
        loading_s = [float(t.split("loading_s=")[1].split()[0]) for t in warnings if in_setup in t][:2]
        assert 0.5 <= loading_s[0] < loading_s[1], warnings
        redis_client.rpush(GO_KEY, b"go")
        wait_for(lambda: said("worker ready after a slow start"), T, "the worker ready")
        assert len(said("worker still loading")) <= len(warnings) + 1  # no warning once it is ready

    assert _supervise(supervisor, watch) == 0
    assert not said("worker stuck in setup()") and supervisor.slots[0].history == []  # never restarted


class Quick(Stage):
    def predict(self, x: int) -> int:
        return x


quick = Pipeline("t-quick-first").add(Quick, max_run_s=0.05)


def test_a_first_batch_stuck_before_its_ready_is_read_is_a_stuck_predict(caplog: pytest.LogCaptureFixture) -> None:
    """A worker that sent 'R' and whose first batch passed ``max_run_s`` before the supervisor read that 'R' (it
    checks every slot before it reads their pipes) was taken, not being ready, for one stuck in ``setup()``:
    its message formatted ``setup_timeout_s`` (None) and the TypeError ended `Supervisor.run`, every worker with
    it. What it is stuck in is the worker's own word (its cell), not whether its 'R' was read."""
    caplog.set_level(logging.ERROR, "conveyor.supervisor")
    spec = quick.stage("Quick")
    supervisor = Supervisor([Unit("tests.test_setup_timeout:quick", spec, 1)],
                            ChildSettings(redis_url="redis://127.0.0.1:9/0"))
    watch = StuckWatch(1, RedisSettings("redis://127.0.0.1:9/0"))  # never reached: the unit has no keys
    supervisor._stuck, supervisor._starts = watch, SlowStarts(60.0)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        slot = WorkerSlot(supervisor.units[0], spec, 0, None, "quick@h:0", proc=proc, ready_at=None)
        BusyCell(os.dup(watch.fd), 0).batch(spec, [None])  # its first batch, past max_run_s at the check
        wait_for(lambda: watch.stuck(0), T, "the batch past max_run_s")
        supervisor._check_runtime(slot)
    finally:
        proc.kill()
        proc.wait()
        watch.close()
    assert "worker stuck: predict ran past max_run_s" in caplog.text, caplog.text


def test_the_stack_files_have_no_name_a_killed_supervisor_could_leave(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGKILLed `conveyor run` or `conveyor worker` left its directory of stack files in /tmp, one per run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where anything named would be made
    watch = StuckWatch(2, RedisSettings("redis://127.0.0.1:9/0"))  # never reached
    try:
        assert list(tmp_path.iterdir()) == []  # as a SIGKILL would find it: nothing to leave behind
        args = watch.child_args(1)
        stack_file = args[args.index("--stack-file") + 1]
        assert stack_file.startswith("/dev/fd/") and int(stack_file[8:]) in watch.fds(1)
        with open(stack_file, "a") as worker_side:  # as the worker opens it: appended to
            worker_side.write("Current thread 0x1 (most recent call first):\n")
        assert os.pread(watch.fds(1)[1], 100, 0).startswith(b"Current thread")
    finally:
        watch.close()
