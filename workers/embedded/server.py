"""A private, throw-away redis-server for ``conveyor run`` and the tests.

Why a real server and not fakeredis: the pipeline relies on consumer groups, XAUTOCLAIM,
Lua scripts and blocking reads under several processes, which only a real server does
faithfully. Why private: a developer's ``conveyor run`` must neither need a Redis set up
by hand nor touch one that holds other data.

The server listens on a Unix socket in a fresh temporary directory and on no TCP port, so
nothing else on the machine can reach it by accident, and it persists nothing: stopping it
removes the directory and with it every trace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from broker.local_runs import LISTING, list_pipelines
from broker.probe import probe
from workers.embedded.binary import BINARY_ENV, find_redis_server
from workers.embedded.directory import MAX_SOCKET_PATH, EmbeddedRedisError, RedisDirError, claim_dir, default_redis_dir
from workers.process.procs import detached_preexec

# BINARY_ENV and find_redis_server live in workers.embedded.binary; importable from here too.
__all__ = ["BINARY_ENV", "EmbeddedRedis", "EmbeddedRedisError", "RedisDirError", "default_redis_dir",
           "find_redis_server"]

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.01
_LOG_TAIL_BYTES = 4000

# Files the server and this module create in a chosen directory (removed on stop, then the
# directory itself if nothing else is left in it).
_OWN_FILES = ("redis.sock", "redis.log", "redis.out", LISTING)


def _tail(path: Path, limit: int = _LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a log file, decoded leniently; '' if it is missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _make_dir() -> Path:
    """A fresh private directory whose socket path fits in ``sun_path``.

    macOS puts $TMPDIR under a long /var/folders/... path; if the socket path would not
    fit there, fall back to /tmp rather than fail at bind time with an obscure error.
    """
    path = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
    if len(os.fsencode(path / "redis.sock")) <= MAX_SOCKET_PATH or not os.path.isdir("/tmp"):
        return path
    path.rmdir()
    return Path(tempfile.mkdtemp(prefix="conveyor-redis-", dir="/tmp"))


class EmbeddedRedis:
    """A redis-server child process on a Unix socket in its own temporary directory.

    Life cycle: :meth:`start` creates the directory and the process; :meth:`stop` ends
    both and may be called any number of times (put it in a ``finally``). For chaos tests,
    :meth:`kill` and :meth:`restart` end the process but keep the directory, so that the
    server comes back on the same socket path, hence the same :attr:`url`, and clients
    that reconnect find it again; :meth:`start` after :meth:`kill` does the same.

    The constructor only stores settings: nothing runs until :meth:`start`.
    """

    def __init__(
        self,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = _START_TIMEOUT_S,
        stop_timeout_s: float = _STOP_TIMEOUT_S,
        directory: Path | None = None,
        detach: bool = False,
        listed: Sequence[str] = (),
    ) -> None:
        """Store settings. ``binary`` defaults to :func:`find_redis_server` at start time.

        ``extra_args`` come after conveyor's own arguments, so they can override them
        (redis-server keeps the last value given for an option).

        ``directory``: put the socket there (created if missing; on stop our files are
        removed, then the directory if it is empty) instead of a fresh temporary directory,
        so that the URL is known in advance. ``detach``: run the server in a session of its
        own, so a Ctrl-C in the terminal does not reach it and the owner stops it last (see
        :mod:`workers.process.procs`); it still dies with its owner on Linux. ``listed``: the
        pipelines a ``conveyor run`` serves, written in the directory at every start (it may have been
        made again), by which commands without ``--redis`` find the run (:mod:`broker.local_runs`).
        """
        self._binary = binary
        self._extra_args = tuple(extra_args)
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._chosen_dir = directory
        self._detach = detach
        self._listed = list(listed)
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- properties ---------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The private temporary directory (socket, log); it exists until :meth:`stop`."""
        if self._dir is None:
            raise EmbeddedRedisError("embedded Redis is not started")
        return self._dir

    @property
    def socket_path(self) -> Path:
        """Path of the server's Unix socket; stable across :meth:`kill` and :meth:`restart`."""
        return self.directory / "redis.sock"

    @property
    def log_path(self) -> Path:
        """The server's log file, kept in the private directory."""
        return self.directory / "redis.log"

    @property
    def url(self) -> str:
        """``unix://...`` URL for ``redis.Redis.from_url``; stable until :meth:`stop`."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """Pid of the running server process, or None if none is running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive (it may not be answering yet)."""
        return self.pid is not None

    def exit_status(self) -> str:
        """How the last server process ended, for a log line ("running" if it has not)."""
        if self._proc is None:
            return "not started"
        code = self._proc.poll()
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    @property
    def binary(self) -> str | None:
        """The redis-server binary in use: as given, or as found by the first start."""
        return self._binary

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Start the server and wait until it answers PING; return its URL.

        Reuses the directory if there is one (after :meth:`kill`), so the URL is the same.
        Raises :class:`EmbeddedRedisError`, with the tail of the server's log, if it exits
        or does not answer within the start timeout; the process is then gone, and so is
        the directory if this call created it.
        """
        if self.running:
            raise EmbeddedRedisError(f"embedded Redis is already running (pid {self.pid})")
        if self._binary is None:
            self._binary = find_redis_server()
        created = self._dir is None
        if self._dir is None:
            self._dir = _make_dir() if self._chosen_dir is None else claim_dir(self._chosen_dir)
        elif not self._dir.is_dir():  # removed while the server was down (a /tmp cleaner): made again, same path
            self._dir = claim_dir(self._dir)
        try:
            if self._listed:
                list_pipelines(self._dir, self._listed)
            self._spawn(self._binary)
            self._wait_ready()
        except BaseException:
            # Also on KeyboardInterrupt while waiting: leave neither process nor directory.
            self._end_process()
            if created:
                self._remove_dir()
            raise
        return self.url

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after the stop timeout); remove its dir.

        Idempotent and safe at any point, including after a failed start or :meth:`kill`,
        so that ``conveyor run`` can call it from a ``finally`` on Ctrl-C.
        """
        try:
            self._end_process()
        finally:
            self._remove_dir()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; keep the directory for a later start.

        The stale socket file stays behind, as after a real crash; :meth:`start` and
        :meth:`restart` bring the server back on the same path.
        """
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            self._reap(proc)
        finally:
            self._proc = None

    def restart(self) -> str:
        """Stop the server gracefully (if running) and start it again on the same socket.

        The data is lost (nothing is persisted): to clients this looks like a Redis
        failover to an empty replica. Returns the (unchanged) URL.
        """
        if self._dir is None:
            raise EmbeddedRedisError("embedded Redis is not started: nothing to restart")
        self._end_process()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self._dir if self._dir is not None else "not started"
        return f"EmbeddedRedis({where}, pid={self.pid})"

    # -- internals ----------------------------------------------------------------------

    def _args(self, binary: str) -> list[str]:
        d = self.directory
        return [
            binary,
            "--port", "0",  # no TCP listener: only the private socket
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",  # no RDB snapshots
            "--appendonly", "no",
            "--dir", str(d),
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.log_path),
            *self._extra_args,
        ]  # fmt: skip

    def _spawn(self, binary: str) -> None:
        # A stale socket from a killed server would make the readiness wait below see the
        # file at once (the server would unlink it too, but only once it runs).
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        # Errors before the log file is opened (bad arguments) go to stdout/stderr: keep
        # them in a file rather than a pipe that nobody would drain.
        with open(self.directory / "redis.out", "ab") as out:
            self._proc = subprocess.Popen(
                self._args(binary),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                # Not detached (the tests' servers): the server stays in our process group, so
                # a Ctrl-C or a group kill ends it even if our own cleanup never runs.
                # Detached (`conveyor run`): out of the terminal's reach, stopped last by its
                # owner once the gateway and workers have drained, and killed by the kernel
                # if the owner dies first.
                start_new_session=self._detach,
                preexec_fn=detached_preexec() if self._detach else None,
            )

    def _wait_ready(self) -> None:
        """Wait for the socket file, then for PING to succeed; bounded by the start timeout."""
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        sock = self.socket_path
        last_error: Exception | None = None
        while True:
            if proc.poll() is not None:
                raise EmbeddedRedisError(
                    f"redis-server ({self._binary}) exited with code {proc.returncode} at start"
                    f"{self._diagnostics()}"
                )
            if sock.exists():
                last_error = probe(sock)
                if last_error is None:  # PONG, or a demand for a password (extra_args set one): it is up
                    return
            if time.monotonic() >= deadline:
                cause = f" (last error: {last_error})" if last_error is not None else ""
                raise EmbeddedRedisError(
                    f"redis-server ({self._binary}) did not answer on {sock} within "
                    f"{self._start_timeout_s:g} s{cause}{self._diagnostics()}"
                )
            time.sleep(_POLL_S)

    def _diagnostics(self) -> str:
        parts = []
        for path in (self.directory / "redis.out", self.log_path):
            text = _tail(path)
            if text:
                parts.append(f"\n--- {path.name} ---\n{text}")
        return "".join(parts) or "\n(the server wrote no log)"

    def _end_process(self) -> None:
        """SIGTERM, wait up to the stop timeout, then SIGKILL; keep the directory."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self._stop_timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            self._reap(proc)
        finally:
            self._proc = None

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait (bounded) for a signalled process to be gone, so its pid is not a zombie."""
        try:
            proc.wait(timeout=self._stop_timeout_s)
        except subprocess.TimeoutExpired as e:
            raise EmbeddedRedisError(
                f"redis-server pid {proc.pid} did not exit {self._stop_timeout_s:g} s after SIGKILL"
            ) from e

    def _remove_dir(self) -> None:
        if self._dir is None:
            return
        if self._chosen_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:  # a directory the user named: remove only what we put there
            for name in _OWN_FILES:
                with contextlib.suppress(FileNotFoundError):
                    (self._dir / name).unlink()
            with contextlib.suppress(OSError):
                self._dir.rmdir()  # fails, as it should, if something else is in it
        self._dir = None
