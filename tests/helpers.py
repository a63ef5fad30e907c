"""Process helpers for the end-to-end tests: real ``conveyor worker`` processes, real signals.

Every wait here is bounded and polls real state (the process table, Redis) against a
deadline; nothing sleeps in the hope that something happened meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
import redis

from broker import protocol
from broker.connection import RedisSettings
from broker.keys import Keys
from gateway.monitor.status import PipelineStatus, read_status

REPO_ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.02
T = TypeVar("T")


def requests_in(entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> int:
    """Requests in an ``XRANGE`` reply: a batch entry counts the requests it carries (a gateway's
    turn and a forward may be batch entries: docs/protocol.md)."""
    return sum(len(protocol.expand(entry_id, fields)) for entry_id, fields in entries)


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str,
             diagnostics: Callable[[], str] = lambda: "") -> T:
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}\n{diagnostics()}")
        time.sleep(POLL_S)


def conveyor_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", *args]


def conveyor_env(redis_url: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if redis_url is not None:
        env["CONVEYOR_REDIS_URL"] = redis_url
    env.update(extra)
    return env


def descendants(pid: int) -> list[psutil.Process]:
    """Live descendants of ``pid`` (zombies excluded), or [] if it is gone."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in procs if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if _alive(p)]


@dataclass
class WorkerProc:
    """One ``conveyor worker APP --stage NAME`` process (a supervisor) and its log."""

    app: str
    stage: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def children(self) -> list[psutil.Process]:
        """The worker child processes (``python -m workers.process.child``) currently alive."""
        return descendants(self.pid)

    def report(self) -> str:
        return f"--- worker {self.stage} (pid {self.pid}, exit {self.popen.poll()}):\n{self.log()}"

    def exit_code(self, timeout_s: float, what: str) -> int:
        """Its exit code, once it exits on its own within ``timeout_s``; else it is killed and the test fails."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(self.popen)
            raise AssertionError(f"conveyor worker still running {timeout_s:g}s into {what}\n{self.report()}") from None


def start_worker(redis_url: str, app: str, stage: str, workers: int | None = None,
                 log_dir: Path | None = None, **env: str) -> WorkerProc:
    """Start ``conveyor worker`` in a process group of its own, logging to a file."""
    if log_dir is None:  # one shared folder, rather than a new temp dir per call left behind
        log_dir = Path(tempfile.gettempdir()) / "conveyor-test-logs"
        log_dir.mkdir(exist_ok=True)
    log_path = log_dir / f"worker-{stage}-{time.monotonic_ns()}.log"
    argv = conveyor_argv("worker", app, "--stage", stage)
    if workers is not None:
        argv += ["--workers", str(workers)]
    with log_path.open("wb") as out:
        popen = subprocess.Popen(argv, cwd=REPO_ROOT, env=conveyor_env(redis_url, **env),
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return WorkerProc(app, stage, popen, log_path)


@dataclass
class Workers:
    """The ``conveyor worker`` processes of one test."""

    redis_url: str
    procs: list[WorkerProc] = field(default_factory=list)

    def stage(self, name: str) -> WorkerProc:
        return next(p for p in self.procs if p.stage == name)

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs)

    def check_alive(self) -> None:
        dead = [p for p in self.procs if p.popen.poll() is not None]
        if dead:
            raise AssertionError(f"worker process exited early\n{self.report()}")

    def wait_ready(self, pipeline: str, timeout_s: float = 30.0,
                   workers: Mapping[str, int] | None = None) -> PipelineStatus:
        return wait_ready(self.redis_url, pipeline, timeout_s, workers=workers, check=self.check_alive,
                          diagnostics=self.report)


def stop_process(popen: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(sig)


def kill_group(popen: subprocess.Popen[bytes]) -> None:
    """Last-resort cleanup of a process started with ``start_new_session=True``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=5)


@contextlib.contextmanager
def running_workers(redis_url: str, app: str, stages: Sequence[str | tuple[str, int]],
                    stop_timeout_s: float = 20.0, **env: str) -> Iterator[Workers]:
    """Run ``conveyor worker APP --stage NAME [--workers N]`` for each stage, then SIGTERM them.

    On a clean exit of the block, asserts every supervisor exited 0 within ``stop_timeout_s``
    and left no child process behind. If the block raised, the processes are cleaned up
    without masking its error.
    """
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-test-"))
    group = Workers(redis_url)
    failed = True
    try:
        for item in stages:
            name, count = (item, None) if isinstance(item, str) else item
            group.procs.append(start_worker(redis_url, app, name, count, log_dir, **env))
        yield group
        failed = False
    finally:
        _stop_all(group, stop_timeout_s, check=not failed)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept when something failed, for a post-mortem


def _stop_all(group: Workers, timeout_s: float, check: bool) -> None:
    tree = {p.pid: p.children() for p in group.procs}
    for proc in group.procs:
        stop_process(proc.popen)
    deadline = time.monotonic() + timeout_s
    problems = []
    for proc in group.procs:
        try:
            code = proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            if code != 0:
                problems.append(f"{proc.stage}: exit code {code}")
        except subprocess.TimeoutExpired:
            problems.append(f"{proc.stage}: still running {timeout_s:g}s after SIGTERM")
        left = alive(tree[proc.pid])
        if left:
            problems.append(f"{proc.stage}: children left behind {[p.pid for p in left]}")
        if proc.popen.poll() is None or left:
            kill_group(proc.popen)
            for child in alive(left):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
    if check and problems:
        raise AssertionError(f"workers did not stop cleanly: {problems}\n{group.report()}")


async def read_pipeline_status(redis_url: str, pipeline: str) -> PipelineStatus:
    client = RedisSettings(redis_url).async_client(1)
    try:
        return await read_status(client, Keys(pipeline))
    finally:
        await client.aclose()


def _ready(status: PipelineStatus, workers: Mapping[str, int] | None) -> bool:
    if not status.ready:
        return False
    wanted = workers or {}
    live = {s.name: s.live_workers for s in status.stages}
    return all(live.get(name, 0) >= n for name, n in wanted.items())


def wait_ready(redis_url: str, pipeline_name: str, timeout_s: float = 30.0, *,
               workers: Mapping[str, int] | None = None, check: Callable[[], None] = lambda: None,
               diagnostics: Callable[[], str] = lambda: "") -> PipelineStatus:
    """Poll ``read_status`` until every stage has a live worker (and ``workers[name]`` live
    workers for the stages named there); bounded by ``timeout_s``. ``check`` may raise to
    fail early (a worker process died)."""

    async def poll() -> PipelineStatus:
        deadline = time.monotonic() + timeout_s
        client = RedisSettings(redis_url).async_client(1)
        try:
            while True:
                status = await read_status(client, Keys(pipeline_name))
                if _ready(status, workers):
                    return status
                check()
                if time.monotonic() >= deadline:
                    raise AssertionError(f"pipeline {pipeline_name} not ready after {timeout_s:g}s: "
                                         f"{status}\n{diagnostics()}")
                await asyncio.sleep(POLL_S)
        finally:
            await client.aclose()

    return asyncio.run(poll())


def http_call(port: int, method: str, path: str, body: bytes | None = None,
              timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One HTTP request to a local gateway (JSON body), with a bounded wait."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def ping(url: str) -> bool:
    """Whether a Redis answers at ``url`` (2 s bound)."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return bool(client.ping())
    finally:
        client.close()
