"""A worker's heartbeat thread: ``P:hb:<i>`` every ``heartbeat_s``, and the lease of a long batch.

Once the worker is ready, each beat writes its member of every partition's heartbeat set
(``status``, ``/readyz`` and the janitor read them) and, while a batch has run longer than a third
of ``claim_idle_s``, renews the lease on its entries (``XCLAIM JUSTID``) so that no other worker
claims them. Whatever else must be said to Redis at the same rhythm rides on the same pipelined
round trip (a :class:`broker.liveness.Beat`) as a :class:`BeatHook`, which adds its commands and
gets its own replies back: the core's claim (from before ``setup()``, which may outlast the claim's
TTL), the count of live workers.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from broker import protocol
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.errors import ReplyError, SyncClient, error_text
from broker.keys import Keys
from broker.liveness import Beat, leave
from broker.logs import Throttle
from broker.refusals import log_refusal_once
from broker.registry import other_definition

log = logging.getLogger("conveyor.worker")


class Wake:
    """What ends the heartbeat thread's wait at once: a byte on a socket pair of its own (the self-pipe
    idiom), so that a stop asked by a signal handler is seen now, without polling the flag, and without
    a lock (a ``threading.Event`` takes one, which a handler interrupting its holder would wait on for ever)."""

    def __init__(self) -> None:
        self._r: socket.socket | None = None
        self._w: socket.socket | None = None

    def open(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def set(self) -> None:
        """End the wait (from any thread, or a signal handler): one send that never blocks."""
        w = self._w
        if w is not None:
            with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed meanwhile: too late
                w.send(b"\0")

    def wait(self, timeout_s: float) -> None:
        """Until :meth:`set` or ``timeout_s``; what was sent is taken."""
        if self._r is not None and select.select([self._r], [], [], timeout_s)[0]:
            with contextlib.suppress(OSError):
                self._r.recv(4096)

    def close(self) -> None:
        r, w, self._r, self._w = self._r, self._w, None, None
        for sock in (r, w):
            if sock is not None:
                sock.close()


class BeatHook(Protocol):
    """Something said to Redis with every beat, on the heartbeat's round trip."""

    def queue(self, beat: Beat, ready: bool) -> None:
        """Add this beat's commands (``ready``: the worker's ``setup()`` is done)."""

    def take(self, replies: list[Any]) -> None:
        """The replies to the commands :meth:`queue` added, in order (errors as exception objects)."""

    def stop(self, client: SyncClient) -> None:
        """The heartbeat ends (the worker stops): a last word, best effort."""


class Lease:
    """The entries of the batch in hand: set by the worker's loop, read by the heartbeat thread.

    One tuple, replaced whole, so the thread never sees one batch's stream with another's ids. A
    batch of several priority levels holds entries of each level's stream."""

    def __init__(self) -> None:
        self.held: tuple[tuple[tuple[str, list[bytes]], ...], float] = ((), 0.0)  # (stream, ids)s, since

    def hold(self, stream: str, ids: list[bytes]) -> None:
        self.held = (((stream, ids),), time.monotonic())

    def hold_all(self, parts: list[tuple[str, list[bytes]]]) -> None:
        self.held = (tuple(parts), time.monotonic())

    def release(self) -> None:
        self.held = ((), 0.0)


class LiveWorkers:
    """Counts the stage's live workers at each beat (``on_count(n)``: the singleton read size)."""

    def __init__(self, hb_key: str, consumer: str, on_count: Callable[[int], None]) -> None:
        self._hb_key = hb_key
        self._consumer = consumer
        self._on_count = on_count

    def queue(self, beat: Beat, ready: bool) -> None:
        if ready:
            beat.live_workers(self._hb_key)

    def take(self, replies: list[Any]) -> None:
        if replies and not isinstance(replies[0], Exception):
            live = {protocol.as_bytes(m) for m in replies[0]} | {self._consumer.encode()}  # its first beat
            self._on_count(len(live))

    def stop(self, client: SyncClient) -> None:
        """Nothing to undo."""


class RegistrationRenewal:
    """The pipeline's registration, written again with each beat where it is gone (its spec evicted
    by an ``allkeys-*`` policy, deleted by hand): :meth:`broker.liveness.Beat.registration`. A spec of
    other stages found there (written by a worker of another definition as this one's was gone: the
    check at start saw none) is said at once, and every minute while it stays: the two definitions'
    workers share streams by position and answer each other's requests."""

    def __init__(self, pipeline: str, partitions: Sequence[Keys], spec: bytes, max_backlog: int | None) -> None:
        self.pipeline, self.partitions, self.spec, self.max_backlog = pipeline, partitions, spec, max_backlog
        self._throttle = Throttle(60.0)

    def queue(self, beat: Beat, ready: bool) -> None:
        for keys in self.partitions:
            beat.registration(keys, self.spec, self.max_backlog)

    def take(self, replies: list[Any]) -> None:
        if len(replies) != 3 * len(self.partitions):  # a Redis Cluster: no spec read back (Beat.registration)
            return
        for stored in replies[2::3]:  # each partition's [spec]; a refusal is logged by the beat
            raw = stored[0] if isinstance(stored, list) and stored else None
            other = None if raw is None or raw == self.spec else other_definition(protocol.as_bytes(raw), self.spec)
            if other is not None and self._throttle.allow(("other", other)) is not None:
                log.error("pipeline %r is %s: the two share streams by position and answer each other's "
                          "requests; stop one of them", self.pipeline, other)

    def stop(self, client: SyncClient) -> None:
        """Nothing to undo."""


class Heartbeat:
    def __init__(self, settings: RedisSettings, hb_keys: Sequence[str], consumer: str, stage_name: str,
                 interval_s: float, claim_idle_s: float, hooks: Sequence[BeatHook] = (),
                 on_stop: tuple[Callable[[], bool], Callable[[], None]] | None = None,
                 wake: Wake | None = None) -> None:
        """``on_stop``: (stopping, interrupt): once ``stopping()`` (a flag a signal handler set, then
        ``wake``), the thread calls ``interrupt()``, which ends the worker's blocked read (an idle worker
        would otherwise stop only when its read times out)."""
        self._settings = settings
        self._hb_keys = list(hb_keys)  # one per partition: each partition's janitor and status read its own
        self._consumer = consumer
        self._stage_name = stage_name
        # Beat at least every claim_idle_s / 3, so that a renewed lease never ages past claim_idle_s.
        self._interval_s = min(interval_s, claim_idle_s / 3)
        self._renew_after_s = claim_idle_s / 3
        self._hooks = list(hooks)
        self.lease = Lease()
        self._ready = False
        self._stopped = False
        self._on_stop = on_stop
        self._wake = wake or Wake()
        self._poke = False  # ready() or stop(): beat now
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self, *hooks: BeatHook) -> None:
        """Start beating: only the hooks' commands until :meth:`ready`."""
        self._hooks += hooks
        self._wake.open()
        self._thread.start()

    def ready(self) -> None:
        """Setup is done: beat at once (readyz must see the worker live now, not heartbeat_s later)."""
        self._ready = self._poke = True
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (the hooks say their last word, e.g. the core's claim is released); bounded."""
        self._stopped = self._poke = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._wake.close()

    def _loop(self) -> None:
        client = self._settings.sync_client()
        while not self._stopped:
            self._poke = False  # a poke from now on is for the next beat
            try:
                self._beat(client)
            except CONNECTION_ERRORS:
                pass
            except ReplyError as exc:  # e.g. NOGROUP for the lease after Redis restarted empty
                if not log_refusal_once(exc):
                    log.warning("heartbeat failed stage=%s error=%s", self._stage_name, error_text(exc))
            self._wait()
        if self._ready:
            leave(client, self._hb_keys, self._consumer)
        for hook in self._hooks:
            try:
                hook.stop(client)
            except CONNECTION_OR_REPLY_ERRORS as exc:
                if not log_refusal_once(exc):
                    log.debug("heartbeat hook's last word failed error=%s", error_text(exc))
        client.close()

    def _wait(self) -> None:
        """Until the next beat (or :meth:`ready`, :meth:`stop`); with ``on_stop``, the worker's read is
        interrupted once the stop flag is set (the stop wakes this wait)."""
        until = time.monotonic() + self._interval_s
        while not self._poke and (left := until - time.monotonic()) > 0:
            watch = self._on_stop
            if watch is not None and watch[0]():
                self._on_stop = None  # once
                try:
                    watch[1]()
                except CONNECTION_OR_REPLY_ERRORS as exc:  # the read then ends at its own timeout
                    log.debug("interrupting a stopping worker's read failed error=%s", error_text(exc))
                continue
            self._wake.wait(left)

    def _beat(self, client: SyncClient) -> None:
        beat = Beat(client)
        spans: list[tuple[BeatHook, int, int]] = []
        for hook in self._hooks:
            start = len(beat)
            hook.queue(beat, self._ready)
            spans.append((hook, start, len(beat)))
        own = len(beat)
        if self._ready:
            self._queue_beat(beat)
        if not len(beat):
            return
        replies = beat.send()
        for hook, start, end in spans:
            hook.take(replies[start:end])
        for reply in replies[own:]:
            if isinstance(reply, ReplyError):
                raise reply  # logged by the loop (e.g. NOGROUP for the lease after a restart)

    def _queue_beat(self, beat: Beat) -> None:
        now = protocol.now_ms()
        for hb_key in self._hb_keys:
            beat.alive(hb_key, self._consumer, now)
        held, since = self.lease.held
        if held and time.monotonic() - since > self._renew_after_s:
            # Renew the lease: a long batch must not be claimed by another worker.
            for stream, ids in held:
                if ids:
                    beat.lease(stream, self._consumer, ids)
