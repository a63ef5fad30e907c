"""The gateway's Python API: :class:`Gateway`, for a pipeline of any partition count.

A Gateway submits through a :class:`gateway.client.hub.Hub`, its own or one shared with the other
pipelines a process serves (``conveyor gateway NAME NAME ...``). Each partition of a pipeline is a
full copy of the key layout under its own hash tag (see :mod:`broker.keys`), with its own first
stream and result keys, in its own Redis Cluster slot: a request stays in the partition it was
submitted to, which is one lane of the hub; admission is in ``submit.lua``, per partition.

The partition count is read from the pipeline spec (written by the workers) at start, unless
given; with no spec yet the gateway submits to partition 0 only (which every worker serves, so
this is correct, just not spread) and looks for the spec again every 2 s while requests come,
adding the other partitions once it names them.

Requests go round robin over the partitions, retrying on the next one when a partition answers
``Overloaded`` (``max_backlog`` is a per-partition bound: the pipeline holds up to N times
``max_backlog``), or to the partition a caller's key hashes to (CRC32 of the key, mod N) for
affinity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from types import TracebackType
from typing import Any, cast

from broker import codec, protocol
from broker.connection import CONNECTION_OR_REPLY_ERRORS
from broker.keys import Keys
from broker.refusals import log_refusal_once
from broker.spec import PipelineIO
from gateway.client.hub import Hub
from gateway.client.lane import Lane
from gateway.client.registration import Registration, read_first_stage
from gateway.client.settings import GatewaySettings
from gateway.client.sizing import FirstStage
from gateway.client.slot import Waiter
from gateway.errors import Overloaded, PayloadTooLarge
from gateway.monitor.status import PipelineStatus, read_all_partitions

log = logging.getLogger("conveyor.gateway")


def partition_of(key: str | bytes, partitions: int) -> int:
    """The partition a caller's key maps to: what a foreign producer should compute too."""
    data = key.encode() if isinstance(key, str) else key
    return zlib.crc32(data) % partitions


async def read_partition_count(client: Any, keys: Keys) -> int | None:
    """The partition count from partition 0's spec; None if no worker wrote one yet."""
    first = await read_first_stage(client, keys)
    return None if first is None else first.partitions


class Gateway:
    """The Python API: ``predict(x)`` runs ``x`` through pipeline ``pipeline`` and returns its
    answer. Raises `StageError` (a stage raised on it), `Overloaded` (the first stage's backlog is
    at its ``max_backlog``), `UnknownPipeline` (no worker ever registered that name here),
    ``TimeoutError`` (the deadline passed), and at once `CodecError` (an input that cannot travel)
    or `PayloadTooLarge` (over the workers' ``max_payload_bytes`` once encoded).

    ``key`` (on ``predict`` and ``submit``; over HTTP the header ``X-Conveyor-Partition-Key``):
    requests with one key go to one partition of a partitioned pipeline."""

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings | None = None,
                 partitions: int | None = None, hub: Hub | None = None) -> None:
        """``partitions``: the pipeline's partition count, if known (else read from its spec).
        ``hub``: a started hub shared with other pipelines (its owner closes it); by default the
        gateway has one of its own."""
        self.redis_url = redis_url
        self.pipeline = pipeline
        self.settings = settings or GatewaySettings()
        self.partitions = partitions
        self.keys = Keys(pipeline, self.settings.prefix)
        self.hub = hub or Hub(redis_url, self.settings)
        self._own_hub = hub is None
        self.registration = Registration(self.keys, self.settings.register_wait_s)
        self.first_stage = FirstStage(self.settings.batch_entries, self.keys)
        self.lanes: list[Lane] = []
        self._next = 0
        self._counted = partitions is not None  # the count is known (given, or read from a spec)
        self._next_count_s = 0.0
        self._growing: asyncio.Task[None] | None = None
        self._status_marks: dict[int, dict[int, bytes]] = {}

    async def start(self) -> None:
        if self._own_hub:
            await self.hub.start()
        try:
            self.registration.bind(self.hub.client)
            count = self.partitions
            if count is None:
                count = await read_partition_count(self.hub.client, self.keys)
                self._counted = count is not None
            self.lanes = [self.hub.lane(keys, self._stage_count) for keys in self.keys.partitions(count or 1)]
            await self.registration.log_if_missing()
        except BaseException:
            if self._own_hub:
                await self.hub.close()
            raise

    def _stage_count(self) -> int:
        return self.registration.stages

    def _check_count(self) -> None:
        """Started before any worker wrote the spec: look for it every 2 s (in the background)
        and, once it names more partitions, add their lanes, so the spread begins by itself."""
        if self._counted or self._growing is not None or time.monotonic() < self._next_count_s:
            return
        self._next_count_s = time.monotonic() + 2.0
        self._growing = asyncio.ensure_future(self._grow())

    async def _grow(self) -> None:
        try:
            count = await read_partition_count(self.hub.client, self.keys)
            if count is not None:
                if count > len(self.lanes):
                    self.lanes = [self.hub.lane(keys, self._stage_count) for keys in self.keys.partitions(count)]
                    log.info("pipeline %s has %d partitions: submitting to all of them", self.pipeline, count)
                self._counted = True
        except CONNECTION_OR_REPLY_ERRORS as exc:
            log_refusal_once(exc, "get", self.keys.spec)
            log.warning("reading the partition count failed (will retry) error=%r", exc)
        finally:
            self._growing = None

    async def close(self) -> None:
        tasks: list[asyncio.Future[Any]] = [*([self._growing] if self._growing else []), *self.registration.polls(),
                                            *self.first_stage.close()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._own_hub:
            await self.hub.close()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests submitted through this gateway's hub and not yet answered."""
        return self.hub.in_flight

    @property
    def healthy(self) -> bool:
        """False once a background task has died: readiness turns 503 so traffic goes elsewhere."""
        return self.hub.healthy

    # -- requests -------------------------------------------------------------------------

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False) -> Waiter:
        """:meth:`predict` without the coroutine: what ``x``'s answer will complete (the HTTP
        front adds a callback instead of creating a task per request); Overloaded, CodecError,
        PayloadTooLarge raise here. ``direct``: a `Slot` (one callback, run as the answer
        arrives, without an event-loop handle) where it can, else a future."""
        data = codec.encode(x)  # refuse what cannot travel here, in the caller's stack
        limit = self.registration.max_payload_bytes or self.settings.max_payload_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"input encodes to {len(data)} bytes, over max_payload_bytes={limit} of the "
                                  "pipeline's workers")
        timeout = self.settings.timeout_s if timeout_s is None else timeout_s
        if not (0 < timeout <= protocol.MAX_DEADLINE_AHEAD_MS / 1000):  # NaN fails too
            raise ValueError(f"timeout_s must be a positive number of seconds up to a week, got {timeout_s!r}")
        lanes = self.lanes
        if not lanes:
            raise RuntimeError(f"Gateway for {self.pipeline!r} is not started: use `async with Gateway(...) as gw:` "
                               "or `await gw.start()` first")
        self._check_count()
        self.first_stage.check(self.hub.client, lanes)
        if len(lanes) > 1 and key is None:  # round robin, which may retry another partition: a task
            return asyncio.ensure_future(self._round_robin(data, timeout))
        lane = lanes[0] if key is None else lanes[partition_of(key, len(lanes))]
        if not self.registration.registered:  # rare: until this pipeline is seen registered once
            return asyncio.ensure_future(self._when_registered(lane, data, timeout))
        return self.hub.enqueue(lane, data, timeout, direct)

    async def predict(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None) -> Any:
        """Run ``x`` through the pipeline; ``timeout_s``: its deadline (default ``settings.timeout_s``)."""
        return await cast(asyncio.Future[Any], self.submit(x, timeout_s, key))  # direct=False: never a Slot

    async def _when_registered(self, lane: Lane, data: bytes, timeout_s: float) -> Any:
        """The request's deadline counts from its arrival: the wait for registration spends it."""
        started = time.monotonic()
        await self.registration.wait(timeout_s)
        remaining = timeout_s - (time.monotonic() - started)
        if remaining <= 0:
            raise TimeoutError(f"no answer within {timeout_s:g}s: pipeline {self.pipeline!r} was registered "
                               "only as the request's deadline passed")
        return await cast(asyncio.Future[Any], self.hub.enqueue(lane, data, remaining))

    async def _round_robin(self, data: bytes, timeout_s: float) -> Any:
        if not self.registration.registered:
            await self.registration.wait(timeout_s)
        n = len(self.lanes)
        for attempt in range(n):
            lane = self.lanes[self._next % n]
            self._next = (self._next + 1) % n
            try:
                return await cast(asyncio.Future[Any], self.hub.enqueue(lane, data, timeout_s))
            except Overloaded:
                if attempt == n - 1:  # every partition is over its max_backlog
                    raise
        raise RuntimeError("unreachable: no partition")  # n >= 1, so the loop returns or raises

    async def pipeline_io(self, timeout_s: float | None = None) -> PipelineIO:
        """The tensors the pipeline declares (its spec), once a worker has registered it: waits for
        that as a request does (`UnknownPipeline`, ``TimeoutError``)."""
        if not self.registration.registered:
            await self.registration.wait(self.settings.timeout_s if timeout_s is None else timeout_s)
        return self.registration.io

    async def pipeline_registered(self) -> bool:
        """Whether a worker has registered this pipeline in this Redis (once true, no more round trips)."""
        return await self.registration.check()

    async def pipeline_status(self) -> PipelineStatus:
        if not self.hub.healthy:
            return PipelineStatus(False, [], "a gateway background task died (see its log)")
        return await read_all_partitions(self.hub.client, self.keys, self._status_marks)
