"""The pace of one HTTP connection: its one timer, and when it reads (a mixin of
:class:`gateway.http.connection.HttpProtocol`, which holds the state named below).

One timer per connection, re-armed lazily, checks the current deadline: the read side's (head,
body, keep-alive idle, linger) and the write side's (a response stuck in our buffer: the client
stopped reading, no byte of our answers taken for ``send_timeout_s``: the connection is dropped).
Reading pauses while too many pipelined requests wait (in number, or in body bytes behind the one being
answered: ``max_body_bytes`` of them, else a client could have a connection hold dozens of the largest
bodies) or while the client does not read our answers.
And how it ends: closed, aborted, or (lingering) after the client's last bytes are discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import struct
import termios
from collections import deque
from itertools import islice
from typing import Any

log = logging.getLogger("gateway.http.server")

MAX_QUEUED = 32  # pipelined requests waiting for their turn before reading pauses
_LINGER_BYTES = 1024 * 1024  # a lingering connection closes once the client sent this much more


class Pacing:
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    queue: deque[Any]
    closed: bool
    lingering: bool
    reading_paused: bool
    write_paused: bool
    read_deadline: float
    write_deadline: float
    unsent_at: int  # bytes not yet taken when the write deadline was set (_unsent)
    paused_at = 0.0  # when reading was paused (loop time)
    send_timeout_s: float
    timer: asyncio.TimerHandle | None
    timer_at: float
    discarded: int
    server: Any  # gateway.http.state.ServerState: the slot a connection holds
    settings: Any  # gateway.http.settings.HttpSettings

    def _read_timed_out(self) -> None:
        raise NotImplementedError

    def _set_read_deadline(self, when: float) -> None:
        self.read_deadline = when
        self._arm(when)

    def _arm(self, when: float) -> None:
        """One timer per connection, re-armed lazily: moving a deadline later costs nothing."""
        if when < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(when, self._on_timer)
            self.timer_at = when

    def _on_timer(self) -> None:
        self.timer, self.timer_at = None, math.inf
        if self.closed:
            return
        now = self.loop.time()
        if self.write_deadline <= now:
            unsent = self._unsent()
            if unsent is None or unsent >= self.unsent_at:
                log.debug("client stopped reading: dropping the connection")
                self._abort()
                return
            # It reads, slowly: the kernel wakes a writer only once a third of a send buffer of megabytes
            # is free, which a slow reader may take longer than send_timeout_s to take.
            self.unsent_at, self.write_deadline = unsent, now + self.send_timeout_s
        if self.read_deadline <= now and not self.reading_paused:  # paused by us: see _resume_reading
            self._read_timed_out()
        nxt = min(math.inf if self.reading_paused else self.read_deadline, self.write_deadline)
        if nxt < math.inf and not self.closed:
            self._arm(max(nxt, now + 0.001))

    def _unsent(self) -> int | None:
        """Bytes of our answers not yet taken by the client: our buffer and the socket's send queue
        (None where the system does not say: then a deadline passed means the client stopped reading)."""
        transport = self.transport
        if transport is None or not hasattr(termios, "TIOCOUTQ"):
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return None
        return int(queued) + transport.get_write_buffer_size()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.lingering:
            self.reading_paused = True
            self.paused_at = self.loop.time()
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def _queue_full(self) -> bool:
        """Too many requests wait to be answered: reading pauses (see the module docstring)."""
        return len(self.queue) >= MAX_QUEUED or self._queued_bytes() >= self.settings.max_body_bytes

    def _queued_bytes(self) -> int:
        """The body bytes of the requests waiting behind the one being answered (the first)."""
        queue = self.queue
        return sum(len(getattr(item, "body", b"")) for item in islice(queue, 1, None)) if len(queue) > 1 else 0

    def _maybe_resume_reading(self) -> None:
        if (self.reading_paused and not self.write_paused and len(self.queue) < MAX_QUEUED // 2
                and self._queued_bytes() <= self.settings.max_body_bytes // 2):
            self._resume_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            if self.read_deadline < math.inf:  # the time we did not read is not the client's: the deadline moves
                self.read_deadline += self.loop.time() - self.paused_at
                self._arm(self.read_deadline)
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()

    def _discard(self, size: int) -> None:
        self.discarded += size
        if self.lingering and self.discarded > _LINGER_BYTES:
            self._close()

    def _close(self) -> None:
        """Release the slot first: a client that sees its connection end can count on it being free."""
        self.server.release(self)
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self.server.release(self)
        if self.transport is not None:
            self.transport.abort()
