"""A gateway process's cancels, sent as they come: each partition's in one call (:mod:`broker.cancels`).

The hub takes a request whose caller left out of its table (:meth:`gateway.client.hub.Hub.cancel`) and
hands its id here; one task sends the markers of every partition, on the hub's client, off the
caller's path. A cancel that cannot be sent is logged and dropped: the item then runs and its answer
is a late one, nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from broker.cancels import send_cancels
from broker.errors import CONNECTION_OR_REPLY_ERRORS, error_text
from broker.keys import Keys

__all__ = ["REUSE_HOLD_MS", "Canceller"]

REUSE_HOLD_MS = 59_000  # a timed-out caller's id held (+1 s of markers' slack): a worker's result_ttl_ms

log = logging.getLogger("conveyor.gateway")


class Canceller:
    def __init__(self, client: Any, closing: Callable[[], bool]) -> None:
        """``closing()``: the hub is closing (its tasks are being cancelled)."""
        self._client = client
        self._closing = closing
        self._pending: dict[Keys, list[tuple[bytes, int]]] = {}
        self._wake = asyncio.Event()
        self._held: dict[bytes, float] = {}  # a caller's own ids that timed out: until when (monotonic s)

    def hold(self, keys: Keys, request_id: bytes, mark: bool = True) -> None:
        """A request under the caller's own id timed out: marked cancelled for ``REUSE_HOLD_MS`` (workers
        drop its run if still queued) and held here as long, so that the id is refused if used again
        meanwhile (its run would answer the next request: its stale DeadlineExceeded, or its result).
        ``mark=False``: held only (a stream that ended, whose result key its worker writes just after)."""
        now_s = time.monotonic()
        held = self._held
        # Held in the order they expire (one hold time; an id held again moves to the end): the expired are
        # at the front, pruned there at O(1) a hold, so that thousands of timeouts at once cost no more.
        while held:
            first = next(iter(held))
            if held[first] > now_s:
                break
            del held[first]
        held.pop(request_id, None)
        held[request_id] = now_s + REUSE_HOLD_MS / 1000
        if mark:
            self.add(keys, request_id, REUSE_HOLD_MS)

    def holds(self, request_id: bytes) -> bool:
        """Whether ``request_id`` timed out here a moment ago (:meth:`hold`)."""
        until = self._held.get(request_id)
        return until is not None and until > time.monotonic()

    def add(self, keys: Keys, request_id: bytes, remaining_ms: int) -> None:
        """Mark ``request_id`` (of partition ``keys``, ``remaining_ms`` before its deadline) cancelled;
        one whose deadline passed needs no marker (workers drop it anyway)."""
        if remaining_ms > 0:
            self._pending.setdefault(keys, []).append((request_id, remaining_ms))
            self._wake.set()

    async def run(self) -> None:
        while not self._closing():
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, {}
            for keys, cancels in batch.items():
                try:
                    await send_cancels(self._client, keys, cancels)
                except CONNECTION_OR_REPLY_ERRORS as exc:  # an optimisation lost: the items run, nobody reads them
                    # A cancellation of this task mid-command comes back from redis-py as a connection error
                    # (as the hub's reader sees it): closing, the task must end, not wait for the next cancel.
                    if self._closing():
                        return
                    log.warning("could not mark %d requests cancelled stream=%s error=%s", len(cancels),
                                keys.stream(0), error_text(exc))
