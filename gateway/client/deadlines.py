"""The deadlines of a gateway's requests, on one event-loop timer for all of them.

Why not ``loop.call_later`` per request: each one allocates a `TimerHandle`, pushes it onto the
loop's heap and, once the request is answered (nearly always first), cancels it, which the loop
then has to sift out again (docs/http-front.md). Here a request's deadline is one tuple on our own
heap, and answered requests are not removed at all: an entry whose request is no longer in flight
(in the hub's table of requests, which this reads) is skipped when it reaches the top, and the heap
is rebuilt from the live entries once stale ones are the majority (amortised O(1) per request,
memory bounded by about twice the requests in flight). One `TimerHandle` is armed at the earliest
deadline and re-armed only when a new deadline is earlier than it (with one timeout for every
request, deadlines arrive in order and it never is).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Protocol

__all__ = ["Deadlines"]


class Record(Protocol):
    """What ``live`` maps an id to: its record carries the serial its deadline was added under."""

    serial: int

# Rebuild the heap once it holds more than twice the live requests plus this many entries.
_SLACK = 1024


class Deadlines:
    """Calls ``expire(request_id)`` at each request's deadline, unless the request left ``live``
    (the gateway's requests in flight: id -> record) before. An id may come again once its request
    left (a caller's own id used twice): an entry expires only the record it was added for."""

    def __init__(self, live: Mapping[bytes, Record], expire: Callable[[bytes], None]) -> None:
        self._live = live
        self._expire = expire
        # (loop time, serial, request id): the serial tells this request from a later one under its id
        # (never the record itself, which would keep an answered request's input and result alive).
        self._heap: list[tuple[float, int, bytes]] = []
        self._serials = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        """Entries held, stale ones included (for tests of the bound)."""
        return len(self._heap)

    def add(self, loop: asyncio.AbstractEventLoop, request_id: bytes, when: float) -> int:
        """Expire ``request_id`` at ``when`` (loop time), if its record in ``live`` then carries the
        serial returned (the caller sets it on the record)."""
        heap, serial = self._heap, next(self._serials)
        if len(heap) >= 2 * len(self._live) + _SLACK:  # before the push: the record does not carry its serial yet,
            self._compact()  # so a compaction after it dropped this very entry (its request then never timed out)
        heapq.heappush(heap, (when, serial, request_id))
        if when < self._timer_at:
            self._arm(loop, when)
        return serial

    def _current(self, serial: int, request_id: bytes) -> bool:
        record = self._live.get(request_id)
        return record is not None and record.serial == serial

    def close(self) -> None:
        """Stop the timer; the entries are dropped (the gateway fails its pending requests itself)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        self._heap.clear()

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire, loop)
        self._timer_at = when

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, math.inf
        heap = self._heap
        now = loop.time()
        current = self._current
        while heap and (heap[0][0] <= now or not current(heap[0][1], heap[0][2])):
            _, serial, request_id = heapq.heappop(heap)
            if current(serial, request_id):
                self._expire(request_id)
        if heap:
            self._arm(loop, heap[0][0])

    def _compact(self) -> None:
        """In place: an expiry may submit a request (the HTTP front answers in the expiring call), whose
        ``add`` compacts while ``_fire`` still walks the heap; a new list would leave it the old one."""
        current = self._current
        self._heap[:] = [entry for entry in self._heap if current(entry[1], entry[2])]
        heapq.heapify(self._heap)
