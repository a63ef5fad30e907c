"""How big a gateway's batch entries to a first stage are: its live workers and item cost, kept current.

A turn of several submissions goes to the first stage as batch entries (``submit.lua``; the rule is
:class:`broker.packing.EntrySizing`'s, which forwarding workers follow too): at least one per live
worker of the first stage, none larger than its ``batch_size``, none while its items cost more than
0.5 ms each, and none where a ``max_backlog`` is in force (admission counts entries; the script
decides that). The stage's batch size, and whether its workers read batch entries at all (workers
older than them do not say so in the spec), come from the pipeline's spec; its live workers and its
latest stats entry from its heartbeats and stats. Read here, a few commands per partition at most
once a second, and only while requests come (:meth:`FirstStage.check`, from ``Gateway.submit``);
where any of it cannot be read (an ACL from before batch entries, a failover), single entries.
Off: ``GatewaySettings.batch_entries`` (``conveyor gateway --no-batch-entries``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis
import redis.asyncio as aredis

from broker.keys import Keys
from broker.packing import queue_reads
from broker.refusals import log_refusal_once
from gateway.client.lane import Lane
from gateway.client.registration import read_first_stage

log = logging.getLogger("conveyor.gateway")

REFRESH_S = 1.0  # how old a lane's view of its first stage may get while requests come
# A refresh that fails leaves single entries until the next (a cluster client's own errors are not RedisErrors).
REFRESH_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class FirstStage:
    """Keeps each lane's :attr:`Lane.sizing` current for one pipeline's gateway."""

    def __init__(self, enabled: bool, keys: Keys) -> None:
        self._enabled = enabled
        self._keys = keys  # the pipeline's (partition 0's spec is the pipeline's)
        self._next_s = 0.0
        self.task: asyncio.Task[None] | None = None

    def check(self, client: aredis.Redis, lanes: Sequence[Lane]) -> None:
        """From each submission: start a refresh if the view is older than ``REFRESH_S``."""
        if not self._enabled or self.task is not None or time.monotonic() < self._next_s:
            return
        self._next_s = time.monotonic() + REFRESH_S
        self.task = asyncio.ensure_future(self._refresh(client, list(lanes)))

    def close(self) -> list[asyncio.Task[None]]:
        """No refresh from now on; the one running, if any (for the gateway's close to cancel)."""
        self._enabled = False
        return [self.task] if self.task is not None else []

    async def _refresh(self, client: aredis.Redis, lanes: list[Lane]) -> None:
        try:
            batch_size = await self._batch_size(client)
            for lane in lanes:
                readable = batch_size >= 2 and await _read_stage(client, lane)
                lane.sizing.batch_size = batch_size if readable else 0
        except REFRESH_ERRORS as exc:
            log_refusal_once(exc)
            log.debug("reading the first stage's workers failed (will retry) error=%r", exc)
            for lane in lanes:
                lane.sizing.batch_size = 0
        finally:
            self.task = None

    async def _batch_size(self, client: aredis.Redis) -> int:
        """The first stage's batch_size if its workers read batch entries (the spec says), else 0."""
        first = await read_first_stage(client, self._keys)
        return first.batch_size if first is not None and first.batch_entries else 0


async def _read_stage(client: aredis.Redis, lane: Lane) -> bool:
    """Whether the lane's first stage's workers and latest stats could be read (its sizing updated)."""
    pipe = client.pipeline(transaction=False)
    queue_reads(pipe, lane.keys, 0)
    live, stats = await pipe.execute(raise_on_error=False)
    for reply, command, key in ((live, "zrange", lane.keys.heartbeats(0)), (stats, "xrevrange", lane.keys.stats(0))):
        if isinstance(reply, BaseException):
            log_refusal_once(reply, command, key)
    return lane.sizing.take(live, stats)
