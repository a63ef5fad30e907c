"""Items whose callers left are dropped before they run (:mod:`broker.cancels`).

The heartbeat reads each partition's flag ``P:cancels`` (:class:`CancelWatch`, a beat hook: no round
trip of its own); while one is up, each batch's markers are read before ``predict`` (one ``MGET``), and
the cancelled items are acked without running, counted as ``cancelled``. With no cancel of late, the
worker's loop pays one attribute test per batch. A cancel is seen within a heartbeat (``heartbeat_s``)
of the first one, and at once by a slow stage (a batch of ``SLOW_BATCH_S`` or more), whose markers are
read with every batch: there a round trip is under 1 % of the batch, and a heartbeat's delay would
let many cancelled items run. Items already running finish (a streaming stage stops between steps).
"""

from __future__ import annotations

from typing import Any

from broker.cancels import cancelled
from broker.errors import SyncClient
from broker.keys import Keys
from broker.liveness import Beat
from workers.loop.problems import Problems
from workers.loop.routing import Work

__all__ = ["SLOW_BATCH_S", "CancelWatch"]

SLOW_BATCH_S = 0.02  # a batch this long: its markers are read whatever the flag says


class CancelWatch:
    """Whether cancel markers may be live in any partition this worker reads (set by the heartbeat
    thread, read by the loop: one plain attribute)."""

    def __init__(self, partitions: list[Keys], client: SyncClient, problems: Problems) -> None:
        self._flags = list(dict.fromkeys(keys.cancels for keys in partitions))
        self._client = client
        self._problems = problems
        self.live = False
        self.slow = False  # the last batch took SLOW_BATCH_S or more (set by the loop)

    def drop(self, work: Work, keys: Keys) -> Work:
        """``work`` less its cancelled items (they are acked with the batch, never run); one round trip."""
        if not (self.live or self.slow) or not work:
            return work
        marks = cancelled(self._client, keys, [item.request_id for item, _ in work])
        if not any(marks):
            return work
        self._problems.cancelled(sum(marks))
        return [pair for pair, mark in zip(work, marks, strict=True) if not mark]

    # -- BeatHook ------------------------------------------------------------------------------

    def queue(self, beat: Beat, ready: bool) -> None:
        for flag in self._flags:
            beat.cancels_flag(flag)

    def take(self, replies: list[Any]) -> None:
        if replies and not any(isinstance(r, Exception) for r in replies):
            self.live = any(bool(r) for r in replies)

    def stop(self, client: SyncClient) -> None:
        """Nothing to say at the end."""
