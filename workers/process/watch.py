"""How the supervisor sees, without a message per batch, that a worker's ``predict`` runs too long.

Each worker has a cell in memory shared with its supervisor: when a batch starts, the worker
writes when that batch becomes *stuck* (``max_run_s`` after it started if the stage sets one,
else ``stuck_grace_s`` after the last deadline of its items) and when it stops being wanted (its
last deadline); when the batch ends it writes zeros. Two stores of a few bytes, no system call:
a message through the status pipe would wake the supervisor twice per batch. The supervisor reads
the cells at each of its turns (at least every second) and, for a worker past its stuck time,
dumps the stuck call's stack (``faulthandler``, on SIGUSR1, into a file it reads back), logs it,
marks the worker stuck in Redis (``P:stuck:<i>``, for ``status`` and ``/readyz``) and replaces it.
A batch whose items carry no deadline is watched only by ``max_run_s``. The stage's ``setup()`` is
watched the same way, as a batch with no deadline: stuck ``setup_timeout_s`` after it began (if the
stage sets one), its worker then replaced as one that died before it was ready (no mark in Redis: it
read nothing, and never beat). The cell also says when the batch in hand began (its first call:
:meth:`BusyCell.busy`), from which autoscaling counts a worker in a batch busy, its stats being
written only at its commit (:mod:`workers.process.scaling`).

The stack is one record's block (:func:`broker.logs.block`): the record's line says what happened,
the stack's lines follow it, once. (It used to be a ``stack=%s`` inside the message's prose, which
the structured formatter keeps whole as the event and also takes as a field: the stack twice, on one
escaped line.) The worker appends to its stack file (``O_APPEND``), so a dump after the supervisor
emptied the file starts at its beginning; the supervisor reads the file once its size stops growing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import signal
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from broker.connection import RedisSettings
from broker.keys import Keys
from broker.liveness import mark_stuck
from broker.logs import block
from broker.protocol import now_ms
from workers.pipeline import StageSpec

log = logging.getLogger("conveyor.supervisor")

_STACK_WAIT_S = 1.0  # how long the supervisor waits for a stuck worker's stack
_STACK_POLL_S = 0.02  # the file is read once its size is the same two polls in a row
_NO_STACK = "(no stack: the worker did not answer SIGUSR1)"


def _monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


def _size(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


def _unnamed_file() -> int:
    """A file with no name (unlinked at once), appended to: a worker's stack file, which it opens again as
    ``/dev/fd/N``. Nothing is left in /tmp by a supervisor that is SIGKILLed (a directory of them was)."""
    with tempfile.TemporaryFile() as named_or_not:
        fd = os.dup(named_or_not.fileno())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd

# Stuck at, unwanted at (0: not watched), the batch's start (0: idle): Unix ms, the worker loop's; and the
# process's last sign of life: CLOCK_MONOTONIC ms (one clock for the whole host, which neither a step of the
# wall clock nor a suspended machine moves), its stamping thread's (BusyCell.keep_alive).
_CELL = struct.Struct("<qqqq")
_BATCH = struct.Struct("<qqq")
_ALIVE = struct.Struct("<q")
_ALIVE_AT = _BATCH.size
# ``unwanted_at_ms`` of a cell whose worker is in ``setup()`` (a batch's is a deadline, or 0): what it is stuck
# in is told by the worker itself, not by whether the supervisor has read its 'R' yet.
IN_SETUP = -1
ALIVE_EVERY_S = 1.0


@dataclass(frozen=True)
class Busy:
    stuck_at_ms: int
    unwanted_at_ms: int
    began_ms: int
    alive_at_ms: int


class BusyBoard:
    """The supervisor's side: one cell per slot, in a file both processes map (``memfd`` on Linux)."""

    def __init__(self, slots: int) -> None:
        self._size = max(1, slots) * _CELL.size
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("conveyor-busy", 0)
        else:  # a temporary file, unlinked at once: only the descriptor is shared
            self.fd, path = tempfile.mkstemp(prefix="conveyor-busy-")
            os.unlink(path)
        os.ftruncate(self.fd, self._size)
        os.set_inheritable(self.fd, False)  # passed on explicitly (pass_fds), to the workers only
        self._map = mmap.mmap(self.fd, self._size)

    def read(self, slot: int) -> Busy:
        return Busy(*_CELL.unpack_from(self._map, slot * _CELL.size))

    def clear(self, slot: int) -> None:
        """A new worker in this slot starts idle (its predecessor may have died mid-batch)."""
        _CELL.pack_into(self._map, slot * _CELL.size, 0, 0, 0, 0)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class BusyCell:
    """A worker's side: its cell of the board (``fd`` inherited from the supervisor)."""

    def __init__(self, fd: int, slot: int) -> None:
        self._offset = slot * _CELL.size
        self._map = mmap.mmap(fd, self._offset + _CELL.size)
        os.close(fd)  # the mapping keeps the memory
        self._began_ms = 0  # when the batch in hand began (0: idle)

    def busy(self, stuck_at_ms: int, unwanted_at_ms: int) -> None:
        """A call begins: its stuck and unwanted times; the batch's start is its first call's (a read run as
        several calls, or a continuous stage's live batches, is one batch until :meth:`idle`: its stats are
        written at its commit, and autoscaling counts it busy from its start)."""
        self._began_ms = self._began_ms or now_ms()
        _BATCH.pack_into(self._map, self._offset, stuck_at_ms, unwanted_at_ms, self._began_ms)

    def keep_alive(self) -> None:
        """Stamp the cell every ALIVE_EVERY_S from a thread of its own, which touches nothing else: a
        process that stops stamping while idle is frozen (SIGSTOP, a cgroup freeze, a C call that holds
        the GIL), not merely cut off from Redis, and its supervisor replaces it."""
        def stamp() -> None:
            while True:
                _ALIVE.pack_into(self._map, self._offset + _ALIVE_AT, _monotonic_ms())
                time.sleep(ALIVE_EVERY_S)

        threading.Thread(target=stamp, name="alive", daemon=True).start()

    def batch(self, spec: StageSpec, deadlines: list[int | None]) -> None:
        """A batch starts (its items' deadlines): it becomes stuck ``max_run_s`` from now if the
        stage sets one, else ``stuck_grace_s`` after its last deadline (never without deadlines)."""
        unwanted = 0 if None in deadlines else max(d for d in deadlines if d is not None)
        stuck = 0
        if spec.max_run_s:
            stuck = now_ms() + int(spec.max_run_s * 1000)
        elif unwanted and spec.stuck_grace_s is not None:
            stuck = unwanted + int(spec.stuck_grace_s * 1000)
        self.busy(stuck, unwanted)

    def setup(self, timeout_s: float | None) -> None:
        """The stage's ``setup()`` begins (its start is what the supervisor's warnings count from): it becomes
        stuck ``timeout_s`` from now (None: never). :meth:`idle` when it ends."""
        self.busy(now_ms() + int(timeout_s * 1000) if timeout_s else 0, IN_SETUP)

    def idle(self) -> None:
        self._began_ms = 0
        _BATCH.pack_into(self._map, self._offset, 0, 0, 0)


class StatusPipe:
    """Tells the supervisor 'ready', 'idle' (after its first batch) and 'drained' with one byte, so
    it can spot a worker that dies before it is ready (a stuck ``predict`` it sees through the
    worker's :class:`workers.process.watch.BusyCell`, without a message per batch)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def send(self, code: bytes) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._fd, code)


class StuckWatch:
    """The supervisor's side: the board, a stack file per slot, and what is done to a stuck worker."""

    def __init__(self, slots: int, redis: RedisSettings) -> None:
        self._board = BusyBoard(slots)
        self._stacks = [_unnamed_file() for _ in range(slots)]
        self._redis = redis

    def child_args(self, index: int) -> list[str]:
        """The worker's command-line arguments for its cell and stack file (and its cell cleared)."""
        self._board.clear(index)
        return ["--busy-fd", str(self._board.fd), "--busy-slot", str(index), "--stack-file",
                f"/dev/fd/{self._stacks[index]}"]

    @property
    def fd(self) -> int:
        return self._board.fd

    def fds(self, index: int) -> tuple[int, int]:
        """What the worker of slot ``index`` inherits: the board, its stack file."""
        return self._board.fd, self._stacks[index]

    def wait_s(self, index: int) -> float | None:
        """Seconds until this slot's batch becomes stuck (None: not watched now)."""
        busy = self._board.read(index)
        return None if not busy.stuck_at_ms else max(0.0, (busy.stuck_at_ms - now_ms()) / 1000)

    def unwanted(self, index: int) -> bool:
        """Whether the batch in hand is past every deadline of its items: nobody waits for it."""
        busy = self._board.read(index)
        return busy.unwanted_at_ms > 0 and now_ms() >= busy.unwanted_at_ms  # not IN_SETUP: a setup has no deadline

    def stuck(self, index: int) -> bool:
        busy = self._board.read(index)
        return bool(busy.stuck_at_ms) and now_ms() >= busy.stuck_at_ms

    def in_setup(self, index: int) -> bool:
        """Whether this slot's worker is in its stage's ``setup()``."""
        return self._board.read(index).unwanted_at_ms == IN_SETUP

    def batch_s(self, index: int) -> float | None:
        """Seconds since this slot's worker began the batch it is in now (None: idle, in ``setup()``, or not there
        yet): autoscaling counts it busy (:mod:`workers.process.scaling`), its stats not written until it commits."""
        busy = self._board.read(index)
        if not busy.began_ms or busy.unwanted_at_ms == IN_SETUP:
            return None
        return max(0.0, (now_ms() - busy.began_ms) / 1000)

    def began_s(self, index: int) -> float | None:
        """Seconds since this slot's worker began its batch or, before it is ready, its ``setup()`` (None: idle,
        or not there yet)."""
        began_ms = self._board.read(index).began_ms
        return None if not began_ms else max(0.0, (now_ms() - began_ms) / 1000)

    def frozen_s(self, index: int) -> float:
        """Seconds since this slot's worker last stamped its cell, while it is between batches (0: in a
        batch, which the deadlines watch, or not stamping yet). Read twice: a torn read must not count."""
        ages = []
        for _ in range(2):
            busy = self._board.read(index)
            if busy.began_ms or not busy.alive_at_ms:
                return 0.0
            ages.append(max(0.0, (_monotonic_ms() - busy.alive_at_ms) / 1000))
        return min(ages)

    def replace(self, index: int, proc: subprocess.Popen[bytes], stage: StageSpec, consumer: str,
                keys: Keys | None, frozen_s: float = 0.0, loading: bool = False) -> None:
        """Log the stuck call (``loading``: its ``setup()``; or, ``frozen_s``, the frozen process) with its stack,
        mark the worker stuck in Redis (in its pipeline's ``keys``; not a loading one, which never beat: ``status``
        counts it loading), kill it (the supervisor starts another)."""
        if loading:
            why = (f"worker stuck in setup(): still loading after setup_timeout_s={stage.setup_timeout_s:g}s; "
                   "replacing it (counted as a failed start)")
        elif frozen_s:
            why = (f"worker frozen: no sign of life for {frozen_s:.1f}s between batches (stopped, or a call holding "
                   "the GIL); replacing it")
        else:
            why = ("worker stuck: predict " + (f"ran past max_run_s={stage.max_run_s:g}s" if stage.max_run_s else
                   f"still running {stage.stuck_grace_s:g}s after every deadline of its batch passed")
                   + "; replacing it (set stuck_grace_s=None to turn this off, or max_run_s)")
        stack = self._dump_stack(index, proc)
        if keys is not None and not loading:  # marked before it is said: whoever reads the log finds the mark
            self._mark(keys, stage.index, consumer)
        log.error("%s; its stack follows stage=%s consumer=%s pid=%d", why, stage.name, consumer, proc.pid,
                  extra=block("stack", stack))
        proc.kill()
        self._board.clear(index)

    def _dump_stack(self, index: int, proc: subprocess.Popen[bytes]) -> str:
        """faulthandler's dump of every thread (SIGUSR1), read back once, within a bounded wait."""
        fd = self._stacks[index]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # emptied: the worker appends, so its dump starts at the beginning
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
        # The child's signal handler writes the dump in one burst; nothing signals its end but its size,
        # which stops growing.
        deadline = time.monotonic() + _STACK_WAIT_S
        size = 0
        while time.monotonic() < deadline:
            time.sleep(_STACK_POLL_S)
            now = _size(fd)
            if now and now == size:
                break
            size = now
        with contextlib.suppress(OSError):
            return os.pread(fd, _size(fd), 0).decode("utf-8", "replace").strip() or _NO_STACK
        return _NO_STACK

    def _mark(self, keys: Keys, stage: int, consumer: str) -> None:
        """``P:stuck:<i>``, for ``conveyor status`` and ``/readyz``; best effort (a failure is logged)."""
        client = RedisSettings(self._redis.url, socket_timeout_s=2.0, connect_timeout_s=2.0).sync_client()
        try:
            mark_stuck(client, keys, stage, consumer)
        finally:
            client.close()

    def close(self) -> None:
        self._board.close()
        for fd in self._stacks:
            os.close(fd)
