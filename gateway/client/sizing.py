"""How big a gateway's batch entries to a first stage are: its live workers and item cost, kept current.

A turn of several submissions goes to the first stage as batch entries (``submit.lua``; the rule is
:class:`broker.packing.EntrySizing`'s, which forwarding workers follow too): at least one per live
worker of the first stage, none larger than its ``batch_size``, none while its items cost more than
0.5 ms each, and none where a ``max_backlog`` is in force (admission counts entries; the script
decides that). The stage's batch size comes from its spec (:class:`Registration`); its live workers
and its latest stats entry are read here, one round trip per partition at most once a second,
and only while requests come (:meth:`FirstStage.check`, from ``Gateway.submit``).
Off: ``GatewaySettings.batch_entries`` (``conveyor gateway --no-batch-entries``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aredis

from broker.acl import log_refusal_once
from broker.connection import CONNECTION_OR_REPLY_ERRORS
from broker.packing import queue_reads
from gateway.client.lane import Lane
from gateway.client.registration import Registration

log = logging.getLogger("conveyor.gateway")

REFRESH_S = 1.0  # how old a lane's view of its first stage may get while requests come


class FirstStage:
    """Keeps each lane's :attr:`Lane.sizing` current for one pipeline's gateway."""

    def __init__(self, enabled: bool, registration: Registration) -> None:
        self._enabled = enabled
        self._registration = registration
        self._next_s = 0.0
        self.task: asyncio.Task[None] | None = None

    def check(self, client: aredis.Redis, lanes: Sequence[Lane]) -> None:
        """From each submission: start a refresh if the view is older than ``REFRESH_S``."""
        if not self._enabled or self.task is not None or time.monotonic() < self._next_s:
            return
        self._next_s = time.monotonic() + REFRESH_S
        if self._registration.first_batch_size >= 2:  # a singleton (or not yet known) first stage: never packed
            self.task = asyncio.ensure_future(self._refresh(client, list(lanes)))

    async def _refresh(self, client: aredis.Redis, lanes: list[Lane]) -> None:
        try:
            for lane in lanes:
                pipe = client.pipeline(transaction=False)
                queue_reads(pipe, lane.keys, 0)
                live, stats = await pipe.execute(raise_on_error=False)
                lane.sizing.batch_size = self._registration.first_batch_size
                lane.sizing.take(live, stats)
        except CONNECTION_OR_REPLY_ERRORS as exc:  # the view stays as it was; the next check retries
            log_refusal_once(exc, "zrange", lanes[0].keys.heartbeats(0) if lanes else "")
            log.debug("reading the first stage's workers failed (will retry) error=%r", exc)
        finally:
            self.task = None
