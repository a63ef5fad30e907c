"""Starts, watches and replaces worker processes; gives up on a stage that cannot start.

Each child holds the write end of a pipe and reports 'R' (ready), 'B' (busy) and 'I'
(idle). The supervisor waits on those pipes with a selector, so it wakes when a child
reports or dies (EOF), never polling. A child that dies before it is ready, several times
in a row, means the stage cannot start here (bad setup, missing model): the supervisor
stops everything and exits non-zero so compose or Kubernetes replaces the container rather
than leaving a zombie that looks alive (one that autoscaling added lowers its stage's maximum instead:
:mod:`workers.process.extras`). A child killed after it was ready is replaced. One whose
``setup()`` runs past its stage's ``setup_timeout_s`` is killed, as one that died before it was ready
(:mod:`workers.process.watch`); one slow to be ready is warned of every minute (:mod:`workers.process.starts`).

Stopping (SIGTERM, or SIGINT: Ctrl-C) goes in an order, so that no admitted request is lost:
first the companions (``conveyor run``'s gateway) get SIGTERM and drain, answering every
request they admitted, while the workers keep running to produce those answers; then the
workers get SIGTERM, and each finishes and commits the batch in hand and exits. A second
stop request (an impatient second Ctrl-C) makes the companions give up their drain at once.
Workers run in sessions of their own (:mod:`workers.process.procs`), so a Ctrl-C in the terminal
reaches only this process, which then stops them in that order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol

from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.keys import Keys
from broker.pins import PinClaims, PinRequest
from broker.refusals import log_refusal_once
from workers.pipeline import StageSpec
from workers.process.child import ChildSettings
from workers.process.companion import Companion
from workers.process.extras import Extras
from workers.process.pinning import allowed_cpus, assign_cpus, claims_cpu, host_id, say_if_cores_shared, thread_env
from workers.process.procs import HangupRepeats, detached_preexec
from workers.process.scaling import Scaling
from workers.process.starts import SlowStarts
from workers.process.watch import StuckWatch

log = logging.getLogger("conveyor.supervisor")


@dataclass(frozen=True)
class SupervisorSettings:
    max_start_failures: int = 3  # consecutive deaths before 'ready' that end the supervisor
    restart_base_s: float = 0.2
    restart_cap_s: float = 10.0
    stable_after_s: float = 10.0  # a worker up this long resets its restart backoff
    grace_s: float = 10.0  # on stop, how long workers may take to finish their batch
    drain_s: float = 30.0  # on stop, how long companions (the gateway) may take to drain, first
    hurry_s: float = 5.0  # after a companion's drain was cut short, how long before SIGKILL
    frozen_after_s: float = 10.0  # a ready worker with no sign of life this long between batches is replaced
    loading_warn_every_s: float = 60.0  # a worker not ready this long after it started is warned of, and again


class Keeper(Protocol):
    def keep(self) -> None:
        """Bring back what is kept if it died; never blocks for long."""


@dataclass(frozen=True)
class Unit:
    """A stage to run ``count`` workers of: loaded in each worker as ``app`` (``module:attribute``),
    its pipeline's ``keys`` to claim cores and mark stuck workers in (None: no such marks)."""

    app: str
    spec: StageSpec
    count: int
    keys: Keys | None = None
    max_count: int = 0  # more than count: autoscaled between the two (workers.process.scaling)
    partitions: tuple[Keys, ...] = ()  # the pipeline's partitions, whose load autoscaling reads
    levels: int = 1  # the pipeline's priority levels (each a stream per stage: all count in the backlog)


@dataclass
class WorkerSlot:
    unit: Unit
    spec: StageSpec
    number: int
    cpu: int | None
    consumer: str
    proc: subprocess.Popen[bytes] | None = None
    pipe: int | None = None
    ready_at: float | None = None
    start_failures: int = 0
    quick_deaths: int = 0
    restart_at: float | None = 0.0
    history: list[int] = field(default_factory=list)  # exit codes, for tests and logs
    killed_for_timeout: bool = False
    claim: bool = False  # the worker claims a core host-wide, preferring ``cpu`` (workers.process.pinning)
    index: int = 0  # its place among the supervisor's slots (its cell on the busy board)
    parked: bool = False  # not wanted now: autoscaling stopped it, or has not started it yet
    retiring: bool = False  # its worker was stopped by autoscaling, and finishes its batch (workers.process.extras)


class Supervisor:
    def __init__(self, units: Sequence[Unit], child: ChildSettings, settings: SupervisorSettings | None = None,
                 cpu_offset: int = 0, companions: Sequence[Companion] = (),
                 keepers: Sequence[Keeper] = ()) -> None:
        """``units``: the stages to run, of one pipeline or of several (``conveyor run`` of a module).
        ``keepers``: asked at least every second to bring back what they keep (``conveyor run``'s
        embedded Redis); ``companions`` too (its gateway), which are also stopped first."""
        self.companions = list(companions)
        self.keepers = list(keepers)
        self.units = list(units)
        self.child = child
        self._child_record = child.to_json()
        self.settings = settings or SupervisorSettings()
        self.cpu_offset = cpu_offset
        self.stopping = False
        self.hurry = False  # a second stop request: cut the companions' drain short
        self.stop_requests = 0  # one more while the workers finish their batch: they are killed
        self._repeats = HangupRepeats()
        self.slots: list[WorkerSlot] = []

    def request_stop(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """Signal handler: the first call starts the ordered stop, a second one hurries it (the
        gateway's drain cut short; the workers killed if they are finishing their batch already)."""
        if self._repeats(signum):
            return
        self.hurry = self.stopping
        self.stopping = True
        self.stop_requests += 1

    def _make_slots(self) -> None:
        allowed = allowed_cpus()
        # Unique even where containers share a host name and PID 1 (host networking).
        host = self._host = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        spread = self.cpu_offset
        for unit in self.units:
            spec = unit.spec
            for n in range(max(unit.count, unit.max_count)):
                cpu = assign_cpus(n, spec.cpus, allowed, offset=spread)
                consumer = f"{spec.name}@{host}:{n}"
                self.slots.append(WorkerSlot(unit, spec, n, cpu, consumer, restart_at=None if n >= unit.count else 0.0,
                                             claim=claims_cpu(self.child.worker.pin, spec.cpus), index=len(self.slots),
                                             parked=n >= unit.count))
            spread += max(unit.count, unit.max_count)
        say_if_cores_shared(sum(not (s.parked or s.spec.cpus) for s in self.slots), allowed)
        for keys in dict.fromkeys(u.keys for u in self.units if u.keys is not None):
            self._lay_out_claims(allowed, keys)

    def _lay_out_claims(self, allowed: list[int], keys: Keys) -> None:
        """Claim the cores of every claiming slot in one atomic call, in slot order: alone on the
        host this is the slot spread itself; beside other workers, the free cores come first.
        Best effort: if Redis does not answer, each worker claims its own as it starts."""
        slots = [s for s in self.slots if s.claim and s.cpu is not None and s.unit.keys == keys and not s.parked]
        if not slots:
            return
        claims = PinClaims(keys, host_id(), self.child.worker.pin_ttl_ms)
        requests = [PinRequest(s.consumer, s.spec.index, s.cpu) for s in slots if s.cpu is not None]
        client = RedisSettings(self.child.redis_url, socket_timeout_s=2.0, connect_timeout_s=2.0).sync_client()
        try:
            for slot, cpu in zip(slots, claims.claim(client, allowed, requests), strict=True):
                slot.cpu = cpu
        except CONNECTION_OR_REPLY_ERRORS as exc:
            log_refusal_once(exc, "pins.lua", claims.key)
            log.warning("could not claim cores ahead of the workers (each claims its own): %r", exc)
        finally:
            client.close()

    # -- main loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (exit 0) or until a stage keeps failing to start (exit 1)."""
        self._make_slots()
        self._stuck = StuckWatch(len(self.slots), RedisSettings(self.child.redis_url))
        self._scaling = Scaling(self.units, self.slots, self.child.redis_url, self._host, self._stuck.batch_s)
        self._extras = Extras(self.slots, self._scaling, self.settings.max_start_failures)
        self._starts = SlowStarts(self.settings.loading_warn_every_s)
        self._selector = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        old_fd = signal.set_wakeup_fd(wake_w)
        # A Python-level SIGCHLD handler (doing nothing) makes every child's exit write to the
        # wake-up fd: a companion's end wakes the selector at once, without polling.
        old_chld = signal.signal(signal.SIGCHLD, _ignore)
        self._selector.register(wake_r, selectors.EVENT_READ, None)
        code = 0
        try:
            code = self._watch()
            self._drain_companions()
        finally:
            self._stop_all()
            self._scaling.close()
            signal.signal(signal.SIGCHLD, old_chld)
            signal.set_wakeup_fd(old_fd)
            self._stuck.close()
            self._selector.close()
            os.close(wake_r)
            os.close(wake_w)
        return code

    def _watch(self) -> int:
        while not self.stopping:
            self._step(self._next_timeout())
            self._scaling.turn(time.monotonic())
            for keeper in [*self.keepers, *self.companions]:  # at least every second: the selector never
                keeper.keep()  # sleeps longer, and a child's exit wakes it at once (SIGCHLD)
            if self._extras.turn():  # a minimum worker failed to start again and again (an extra caps its stage)
                return 1
        return 0

    def _step(self, timeout_s: float) -> None:
        """One turn: (re)start due workers, enforce max_run_s, wait for a report, a death or
        a signal (at most ``timeout_s``)."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)
            self._check_runtime(slot)
        for key, _ in self._selector.select(timeout=max(0.0, timeout_s)):
            if key.data is None:
                _drain(key.fd)
            else:
                self._on_pipe(key.data)
        for slot in self.slots:  # dead, its status pipe still open: a process it forked holds the pipe
            if slot.proc is not None and slot.pipe is not None and slot.proc.poll() is not None:
                self._on_exit(slot)

    def _drain_companions(self) -> None:
        """Stop the companions first, while the workers still run to answer what they admitted.

        SIGTERM, then up to ``drain_s`` (the gateway's own drain answers every admitted
        request, a result or a deadline error); past it, or on a second stop request, a second
        SIGTERM (the gateway then cancels what is left) and ``hurry_s`` later SIGKILL.
        """
        live = [c.proc for c in self.companions if c.proc is not None and c.proc.poll() is None]
        if not live:
            return
        started = time.monotonic()
        log.info("stopping: the gateway stops accepting and drains (up to %gs)", self.settings.drain_s)
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = started + self.settings.drain_s
        hurried = False
        while any(p.poll() is None for p in live):
            now = time.monotonic()
            if not hurried and (self.hurry or now >= deadline):
                hurried = True
                why = "second stop request" if self.hurry else f"drain took over {self.settings.drain_s:g}s"
                log.warning("stopping: %s: cutting the gateway's drain short", why)
                for proc in live:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                deadline = now + self.settings.hurry_s
            elif hurried and now >= deadline:
                for proc in live:
                    if proc.poll() is None:
                        log.error("stopping: pid %d still running: killing it", proc.pid)
                        proc.kill()
                        proc.wait()
                break
            self._step(min(deadline - now, self._next_timeout()))
        log.info("stopping: gateway stopped after %.1fs", time.monotonic() - started)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        waits = [1.0, self._scaling.due_in_s(now)]
        for slot in self.slots:
            if slot.proc is None and slot.restart_at is not None:
                waits.append(slot.restart_at - now)
            stuck_in = self._stuck.wait_s(slot.index) if slot.proc is not None else None
            if stuck_in is not None:
                waits.append(stuck_in)
        return max(0.0, min(waits))

    # -- children ------------------------------------------------------------------------

    def _spawn(self, slot: WorkerSlot) -> None:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, **thread_env(slot.spec.threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "workers.process.child", "--app", slot.unit.app, "--stage", slot.spec.name,
               "--consumer", slot.consumer, "--status-fd", str(write_fd)]
        if slot.cpu is not None:
            cmd += ["--cpu", str(slot.cpu)]
        if slot.claim:
            cmd += ["--claim-cpu"]
        if slot.killed_for_timeout:
            cmd += ["--previous-exit", "timeout"]
        cmd += self._stuck.child_args(slot.index)
        try:
            # A session of its own: a Ctrl-C in the terminal reaches only us, and we stop it in
            # order (see the module docstring); it still dies with us (workers.process.procs).
            slot.proc = subprocess.Popen(cmd, env=env, pass_fds=(write_fd, *self._stuck.fds(slot.index)),
                                         stdin=subprocess.PIPE, start_new_session=True, preexec_fn=detached_preexec())
        finally:
            os.close(write_fd)
        self._send_settings(slot.proc)
        slot.pipe = read_fd
        slot.ready_at = None
        slot.restart_at = None
        self._selector.register(read_fd, selectors.EVENT_READ, slot)
        log.info("started worker stage=%s slot=%d pid=%d cpu=%s", slot.spec.name, slot.number,
                 slot.proc.pid, slot.cpu)

    def _send_settings(self, proc: subprocess.Popen[bytes]) -> None:
        """One JSON line on the child's stdin, then EOF (a child that died at once: its status pipe says so)."""
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(self._child_record)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()

    def _on_pipe(self, slot: WorkerSlot) -> None:
        assert slot.pipe is not None
        data = os.read(slot.pipe, 4096)
        if not data:
            self._on_exit(slot)
            return
        now = time.monotonic()
        for code in data:
            if code == ord("R"):
                slot.ready_at = now
                slot.start_failures = 0
                self._starts.ready(slot.index, slot.spec, slot.number)
            elif code == ord("D"):  # drained what its predecessor held
                slot.killed_for_timeout = False
            elif code == ord("I"):
                # It finished a batch: not a crash loop, so a later death restarts it promptly
                # (otherwise workers killed every few seconds end up 10 s apart, the stage idle).
                slot.quick_deaths = 0

    def _on_exit(self, slot: WorkerSlot) -> None:
        assert slot.proc is not None and slot.pipe is not None
        self._selector.unregister(slot.pipe)
        os.close(slot.pipe)
        try:
            returncode = slot.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its status pipe but lives on: unsupervisable
            log.error("worker pid=%d closed its status pipe: killing it", slot.proc.pid)
            slot.proc.kill()
            returncode = slot.proc.wait()
        _kill_group(slot.proc.pid)  # what it forked (a stage's helper) dies with it, not with the next one
        slot.history.append(returncode)
        now = time.monotonic()
        if slot.parked or slot.retiring:  # stopped by autoscaling: not a crash, restarted only if wanted again
            log.info("worker stopped stage=%s slot=%d pid=%d code=%s (scaled down)", slot.spec.name, slot.number,
                     slot.proc.pid, returncode)
            slot.proc, slot.pipe, slot.ready_at, slot.retiring = None, None, None, False
            slot.restart_at = None if slot.parked else now
            return
        if slot.ready_at is None:
            slot.start_failures += 1
            slot.quick_deaths += 1
        elif now - slot.ready_at < self.settings.stable_after_s:
            slot.quick_deaths += 1
        else:
            slot.quick_deaths = 0
        delay = min(self.settings.restart_cap_s, self.settings.restart_base_s * 2 ** max(0, slot.quick_deaths - 1))
        log.warning("worker exited stage=%s slot=%d pid=%d code=%s ready=%s restart_in=%.2fs", slot.spec.name,
                    slot.number, slot.proc.pid, returncode, slot.ready_at is not None, delay)
        slot.proc, slot.pipe = None, None
        slot.restart_at = now + delay

    def _check_runtime(self, slot: WorkerSlot) -> None:
        """A worker whose batch is stuck (past ``max_run_s``, or past its deadlines plus
        ``stuck_grace_s``: workers.process.watch), whose ``setup()`` is (past ``setup_timeout_s``), or that is
        frozen between batches (no sign of life for ``frozen_after_s``), is reported with its stack and replaced;
        one still loading is warned of (workers.process.starts)."""
        if slot.proc is None:
            return
        loading = self._stuck.in_setup(slot.index)  # not ready_at: its 'R' and first batch may be unread yet
        if self._stuck.stuck(slot.index):
            self._stuck.replace(slot.index, slot.proc, slot.spec, slot.consumer, slot.unit.keys, loading=loading)
            # One stuck in setup() read nothing: its predecessor's timeout (if any) still stands for the next.
            slot.killed_for_timeout = slot.killed_for_timeout if loading else bool(slot.spec.max_run_s)
        elif slot.ready_at is None:
            self._starts.check(slot.index, slot.proc.pid, self._stuck.began_s(slot.index), slot.spec, slot.number)
        elif (frozen := self._stuck.frozen_s(slot.index)) > self.settings.frozen_after_s:
            self._stuck.replace(slot.index, slot.proc, slot.spec, slot.consumer, slot.unit.keys, frozen)

    def _stop_all(self) -> None:
        requests = self.stop_requests  # before anything is said or sent: a request after it escalates
        live = [s for s in self.slots if s.proc is not None]
        if live:
            log.info("stopping: the %d workers finish their batch, commit and exit (up to %gs)",
                     len(live), self.settings.grace_s)
        started = time.monotonic()
        for slot in live:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.grace_s
        for slot in live:
            assert slot.proc is not None
            if slot.spec.stuck_grace_s is not None and self._stuck.unwanted(slot.index) and slot.proc.poll() is None:
                # Its batch is past every deadline: nobody waits for it (stuck_grace_s=None: calls this long are meant).
                log.warning("stopping: worker pid=%d runs a batch past every deadline of its items: not waited for, "
                            "killed (what it read is delivered again, and answered as expired)", slot.proc.pid)
                _kill(slot.proc)
            if not self._exited(slot.proc, deadline, requests):
                why = "another stop request" if self.stop_requests != requests else "did not stop within grace_s"
                log.error("worker pid=%d %s: killing it (what it read is delivered again)", slot.proc.pid, why)
                _kill(slot.proc)
            _kill_group(slot.proc.pid)  # what it forked does not outlive it, stopped cleanly or not
            if slot.pipe is not None:
                self._selector.unregister(slot.pipe)
                os.close(slot.pipe)
                slot.pipe = None
            slot.proc = None
        if live:
            log.info("stopping: workers stopped after %.1fs", time.monotonic() - started)

    def _exited(self, proc: subprocess.Popen[bytes], deadline: float, requests: int) -> bool:
        """Whether ``proc`` exits by ``deadline``; False at once on a stop request past ``requests``
        (looked at every quarter second: an impatient operator's Ctrl-C is obeyed, not queued)."""
        while self.stop_requests == requests:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(left, 0.25)))
                return True
            except subprocess.TimeoutExpired:
                if left <= 0.25:
                    return False
        return proc.poll() is not None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a worker and reap it (what it forked: :func:`_kill_group`, after)."""
    proc.kill()
    proc.wait()


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a worker's process group (each worker leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """SIGCHLD handler: its only job is to exist (see ``run``)."""


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 4096)
