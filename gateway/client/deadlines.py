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

__all__ = ["Deadlines"]

_GONE = object()  # what ``live`` holds for an id no longer in flight

# Rebuild the heap once it holds more than twice the live requests plus this many entries.
_SLACK = 1024


class Deadlines:
    """Calls ``expire(request_id)`` at each request's deadline, unless the request left ``live``
    (the gateway's requests in flight: id -> record) before. An id may come again once its request
    left (a caller's own id used twice): an entry expires only the record it was added for."""

    def __init__(self, live: Mapping[bytes, object], expire: Callable[[bytes], None]) -> None:
        self._live = live
        self._expire = expire
        self._heap: list[tuple[float, int, bytes, object]] = []  # (loop time, order, request id, its record)
        self._order = itertools.count()  # ties broken by arrival: records never compared
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        """Entries held, stale ones included (for tests of the bound)."""
        return len(self._heap)

    def add(self, loop: asyncio.AbstractEventLoop, request_id: bytes, when: float, record: object) -> None:
        """Expire ``request_id`` at ``when`` (loop time), if it is still ``record`` in ``live`` then."""
        heap = self._heap
        heapq.heappush(heap, (when, next(self._order), request_id, record))
        if when < self._timer_at:
            self._arm(loop, when)
        if len(heap) > 2 * len(self._live) + _SLACK:
            self._compact()

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
        heap, live = self._heap, self._live
        now = loop.time()
        while heap and (heap[0][0] <= now or live.get(heap[0][2], _GONE) is not heap[0][3]):
            _, _, request_id, record = heapq.heappop(heap)
            if live.get(request_id, _GONE) is record:
                self._expire(request_id)
        if heap:
            self._arm(loop, heap[0][0])

    def _compact(self) -> None:
        """In place: an expiry may submit a request (the HTTP front answers in the expiring call), whose
        ``add`` compacts while ``_fire`` still walks the heap; a new list would leave it the old one."""
        live = self._live
        self._heap[:] = [entry for entry in self._heap if live.get(entry[2], _GONE) is entry[3]]
        heapq.heapify(self._heap)
