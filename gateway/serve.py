"""Run ``conveyor gateway``: one process, or N processes sharing the port with SO_REUSEPORT.

Why processes: the HTTP front is CPU-bound Python; one process uses at most one core. With
``--processes N`` the kernel spreads new connections over N listening sockets bound to the
same address (SO_REUSEPORT), each in its own process with its own Redis connections. The
parent only supervises: it forwards SIGTERM/SIGINT as SIGTERM to every child (each drains as
one gateway does), and when one child dies on its own it stops the others and exits non-zero,
so that the service manager (compose, systemd) restarts the whole set.

The parent also makes a private directory (removed once the children are gone) where each child
publishes its per-process metrics, so that a scrape reaching any child answers the sum over all of
them (:mod:`gateway.monitor.process_counts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from broker.addresses import host_port
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, Backoff, is_transient_reply, unreachable
from broker.keys import Keys
from broker.logs import Throttle
from gateway.client import GatewaySettings
from gateway.client.pipelines import Pipelines
from gateway.http.server import STOP_SIGNALS, CannotListen, HttpServer, HttpSettings, check_port_free
from gateway.http.server import run as serve_http
from gateway.monitor.metrics import Metrics
from gateway.monitor.process_counts import ProcessCountsSettings, SiblingCounts

__all__ = ["GatewayJob", "LoopUnavailable", "check_loop", "resolve_loop", "run_loop", "serve", "serve_processes"]

T = TypeVar("T")
log = logging.getLogger("gateway.serve")

_START_TIMEOUT_S = 60.0  # children import numpy, redis, ...: slow on a loaded machine
_STOP_GRACE_S = 10.0  # beyond the drain timeout, before a child that will not exit is killed
_PR_SET_PDEATHSIG = 1  # prctl(2)


class LoopUnavailable(RuntimeError):
    """``--loop uvloop`` without uvloop installed."""


@dataclass(frozen=True)
class GatewayJob:
    """Everything one gateway process needs (picklable: it crosses a process spawn, not Redis).

    ``names``: the pipelines served; ``discover``: also every pipeline registered under the prefix;
    ``counts``: where the processes of one ``--processes N`` gateway share their per-process metrics
    (None: one process, nothing shared)."""

    names: tuple[str, ...]
    redis_url: str
    gateway: GatewaySettings
    http: HttpSettings
    loop: str = "auto"
    log_format: str = "kv"
    discover: bool = False
    counts: ProcessCountsSettings | None = None

    def __post_init__(self) -> None:
        """Each name a key can be made of (else `broker.keys.KeyNameError`), before any process starts: a bad
        one failed at the first request, once Redis was reached, or waited for it unnoticed."""
        for name in self.names:
            Keys(name, self.gateway.prefix)


def check_loop(loop: str) -> None:
    """Raise `LoopUnavailable` (one line for the CLI) if ``loop`` cannot be used here."""
    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise LoopUnavailable("--loop uvloop needs uvloop: pip install 'conveyor[uvloop]'")


def resolve_loop(loop: str) -> str:
    """``auto`` is uvloop where it is installed (libuv's loop: about a third less gateway CPU per
    request, docs/http-front.md), else asyncio; the other names are taken as they are."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


def run_loop(coro: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``coro`` on the asyncio loop or on uvloop (``auto``: uvloop where installed); its result."""
    loop = resolve_loop(loop)
    log.info("event loop: %s", loop)
    if loop == "uvloop":
        try:
            check_loop(loop)
        except LoopUnavailable:
            coro.close()
            raise
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def serve(job: GatewayJob, started: Any = None) -> None:
    """One gateway process: wait for Redis, serve until SIGTERM/SIGINT, drain, close the Redis
    connections."""

    async def main() -> None:
        backend = Pipelines(job.redis_url, job.names, replace(job.gateway, json_answers=True), discover=job.discover)
        if not await start_when_reachable(backend, job.redis_url):
            return  # stopped while Redis could not be reached
        metrics = None
        if job.counts is not None:
            metrics = Metrics(backend, status_timeout_s=job.http.status_timeout_s,
                              siblings=SiblingCounts(job.counts, str(os.getpid())))
        publishing = asyncio.ensure_future(metrics.publish_periodically()) if metrics is not None else None
        try:
            await serve_http(backend, job.http, metrics, started=started, supervised=job.counts is not None)
        finally:
            if publishing is not None and metrics is not None:
                publishing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await publishing
                metrics.publish()  # drained: the final numbers, which the siblings keep summing
            await backend.close()

    run_loop(main(), job.loop)


async def start_when_reachable(backend: Pipelines, redis_url: str) -> bool:
    """Start ``backend``, retrying with backoff while Redis cannot be reached or refuses for now (BUSY
    running a script, MASTERDOWN, ...: as the workers do; said once, then at most every 10 s); False if
    SIGTERM or SIGINT came first."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = STOP_SIGNALS
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    backoff, throttle, attempts = Backoff(), Throttle(10.0), 0
    try:
        while not stop.is_set():
            try:
                if not await _unless_stopped(backend.start(), stop):
                    return False  # stopped while a start waited
                await asyncio.sleep(0)  # a signal that came with the start's end: its callback runs now
                if stop.is_set():
                    await backend.close()
                    return False
                return True
            except CONNECTION_OR_REPLY_ERRORS as exc:
                if not isinstance(exc, CONNECTION_ERRORS) and not is_transient_reply(exc):
                    raise  # a refusal that waiting cannot cure (an ACL, a renamed command)
                attempts += 1
                if throttle.allow("unreachable") is not None:
                    log.warning("%s retrying attempts=%d", unreachable(redis_url, exc), attempts)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff.next_delay_s())
        return False
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _unless_stopped(start: Any, stop: asyncio.Event) -> bool:
    """Whether ``start`` ended before ``stop`` was set (then cancelled): a Redis that accepts connections
    but does not answer holds a start for its socket timeout, which a SIGTERM must not wait out."""
    started, stopped = asyncio.ensure_future(start), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not started.done():
        started.cancel()
        with contextlib.suppress(asyncio.CancelledError, *CONNECTION_ERRORS):
            await started
        return False
    started.result()  # its error, if it failed
    return True


def _child(job: GatewayJob, index: int, ready: Any, parent_pid: int) -> None:
    """Entry point of one child of `serve_processes`."""
    from broker.logs import configure_logging

    _end_with(parent_pid)
    configure_logging(job.log_format)

    def started(server: HttpServer) -> None:
        ready.put(os.getpid())

    try:
        serve(job, started)
    except CannotListen as exc:
        print(f"conveyor gateway: {exc.strerror}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if job.counts is not None and _parent_gone(parent_pid):
            _leave_counts(job.counts.directory)


def _parent_gone(parent_pid: int) -> bool:
    """Whether the parent died (or is dying: a zombie whose other threads are being killed, which this process
    is still a child of, so ``getppid`` alone does not tell); False where it cannot be known (no /proc)."""
    if os.getppid() != parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # gone, where /proc is; unknown (alive: getppid said so) where not
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def _leave_counts(directory: str) -> None:
    """Remove this process's metrics snapshot and, if it was the last, the directory: its parent died (killed)
    and can no longer remove it, and it may sit in memory (/dev/shm). Nobody sums them any more."""
    for name in (str(os.getpid()), f".{os.getpid()}.tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):  # a sibling's file is still there (it removes the directory), or it did
        os.rmdir(directory)


def _end_with(parent_pid: int) -> None:
    """This process gets SIGTERM (a drain) when its parent dies, SIGKILLed or OOM-killed (Linux's
    ``PR_SET_PDEATHSIG``): orphans would go on serving the port unsupervised, never stopped."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def _reserve(host: str, port: int) -> socket.socket:
    """Bind (not listen) a SO_REUSEPORT socket: it resolves port 0 to one port for every child
    and keeps the port ours until they listen."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class _Stop:
    """Signal flags of the parent (handlers only set flags)."""

    def __init__(self) -> None:
        self.requested = 0

    def handler(self, signum: int, frame: object) -> None:
        self.requested = signum


def serve_processes(job: GatewayJob, processes: int) -> int:
    """Run ``processes`` gateway processes on one port; returns the exit code for the CLI."""
    check_port_free(job.http.host, job.http.port)
    reserve = _reserve(job.http.host, job.http.port)
    port = int(reserve.getsockname()[1])
    counts_dir = tempfile.mkdtemp(prefix="conveyor-gateway-", dir=_counts_parent())  # this user's only
    child_job = replace(job, http=replace(job.http, port=port, reuse_port=True),
                        counts=ProcessCountsSettings(counts_dir))
    ctx = multiprocessing.get_context("spawn")
    # The queue starts multiprocessing's resource tracker, which inherits SIGHUP ignored: a closed terminal's
    # SIGHUP (to the whole group) would kill it, and its tracebacks would end the drain's log.
    hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ready = ctx.Queue()
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop.handler) for sig in STOP_SIGNALS} | {signal.SIGHUP: hangup}
    children = [ctx.Process(target=_child, args=(child_job, i, ready, os.getpid()), name=f"gateway-{i}",
                            daemon=False) for i in range(processes)]
    try:
        for child in children:
            child.start()
        _await_ready(children, ready, processes, stop)
        reserve.close()
        if not stop.requested:
            log.info("gateway: %d processes listening on %s", processes, host_port(job.http.host, port))
        return _supervise(children, stop, job.http.drain_timeout_s)
    finally:
        reserve.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(counts_dir, ignore_errors=True)  # the children are gone (_supervise waited for them)


def _counts_parent() -> str | None:
    """Where the processes' metrics directory goes: under ``$TMPDIR`` if set (None: tempfile's choice), else
    in memory (``/dev/shm``) where it can be written, else the system's temporary directory. Why memory: each
    process renames a snapshot over its last one every period, on its event loop, and a rename on a journaled
    disk waits for the disk."""
    if os.environ.get("TMPDIR"):
        return None
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _await_ready(children: list[Any], ready: Any, processes: int, stop: _Stop) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    count = 0
    while count < processes and not stop.requested and time.monotonic() < deadline:
        if any(c.exitcode is not None for c in children):
            return  # _supervise sees it and stops the rest
        try:
            ready.get(timeout=0.2)
            count += 1
        except queue.Empty:  # keep waiting, bounded by the deadline
            continue


def _supervise(children: list[Any], stop: _Stop, drain_timeout_s: float) -> int:
    """Wait for the children; on a stop request forward SIGTERM once, then wait for the drains."""
    forwarded = False
    stop_deadline = 0.0
    code = 0
    while any(c.is_alive() for c in children):
        if stop.requested and not forwarded:
            log.info("gateway: received %s: stopping %d processes", signal.Signals(stop.requested).name,
                     sum(c.is_alive() for c in children))
            _signal_all(children, signal.SIGTERM)
            forwarded, stop_deadline = True, time.monotonic() + drain_timeout_s + _STOP_GRACE_S
        elif not forwarded and any(c.exitcode is not None for c in children):
            dead = [c for c in children if c.exitcode is not None]
            log.error("gateway: process %s exited (code %s): stopping the others", dead[0].name, dead[0].exitcode)
            code = 1
            _signal_all(children, signal.SIGTERM)
            forwarded, stop_deadline = True, time.monotonic() + drain_timeout_s + _STOP_GRACE_S
        if forwarded and time.monotonic() > stop_deadline:
            log.error("gateway: processes still running after the drain: killing them")
            _signal_all(children, signal.SIGKILL)
            code = 1
        multiprocessing.connection.wait([c.sentinel for c in children if c.is_alive()], timeout=0.2)
    if any(c.exitcode for c in children):
        code = 1
    log.info("gateway: all processes stopped")
    return code


def _signal_all(children: list[Any], sig: int) -> None:
    for child in children:
        if child.is_alive() and child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sig)
